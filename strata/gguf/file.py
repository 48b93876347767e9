"""`GGUFFile`: one opened GGUF file, its metadata and its tensors, read on demand.

Opening parses only the header; tensor bytes stay in the memory map until a
tensor is loaded, so a loader can stream weights to a device one at a time.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor

from strata.errors import ModelLoadError
from strata.gguf.dequant import FOREIGN_TYPES, SUPPORTED_TYPES, dequantize, foreign_dequantize
from strata.gguf.reader import open_reader, read_metadata


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's layout is described: shape in torch order ([out, in] for a weight)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class GGUFFile:
    """A GGUF file opened through gguf.GGUFReader; every problem is a ModelLoadError."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        reader = open_reader(self.path)
        if reader.byte_order != "I":
            self._fail("big-endian GGUF files are not supported")
        self.metadata: dict[str, Any] = read_metadata(self.path, reader)
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str) or not architecture:
            self._fail("metadata has no general.architecture")
        self.architecture: str = architecture
        self._data: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(
                name=t.name,
                shape=tuple(int(n) for n in reversed(t.shape.tolist())),
                ggml_type=t.tensor_type,
                nbytes=int(t.n_bytes),
            )
            for t in reader.tensors
        }
        self._reader = reader

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {self.architecture}, {len(self.tensors)} tensors)"

    def _fail(self, problem: str) -> NoReturn:
        raise ModelLoadError(str(self.path), problem)

    def _tensor(self, name: str) -> ReaderTensor:
        tensor = self._data.get(name)
        if tensor is None:
            self._fail(f"no tensor named {name!r}")
        return tensor

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes in ggml layout: a flat uint8 view into the memory map."""
        return self._tensor(name).data.view(np.uint8).reshape(-1)

    def load(
        self,
        name: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The dequantized tensor in torch order, on `device`, in `dtype`.

        The quantized bytes go to the device first (the smallest transfer) and
        are dequantized there, so on a GPU the arithmetic runs on the GPU.
        """
        info = self.tensors.get(name)
        if info is None:
            self._fail(f"no tensor named {name!r}")
        if info.ggml_type not in SUPPORTED_TYPES:
            if info.ggml_type not in FOREIGN_TYPES:
                supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES | FOREIGN_TYPES))
                self._fail(
                    f"tensor {name!r} has type {info.type_name}, which Strata cannot dequantize "
                    f"(supported: {supported})"
                )
            return foreign_dequantize(self.raw(name), info.ggml_type, info.shape).to(device, dtype)
        raw = torch.from_numpy(self.raw(name)).to(device)
        return dequantize(raw, info.ggml_type, info.shape, dtype, name=name)

    def identity(self) -> str:
        """sha256 over tensor names, types and shapes: ties saved state to these weights' layout."""
        h = hashlib.sha256()
        for info in self.tensors.values():
            shape = ",".join(str(n) for n in info.shape)
            h.update(f"{info.name}\t{info.type_name}\t{shape}\n".encode())
        return h.hexdigest()
