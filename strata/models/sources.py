"""Where weights come from: a GGUF file or a folder of safetensors, behind one small interface.

The loader validates every needed tensor's name, shape and type through
`shape` and `check` before it reads a byte, then `load`s them one at a time
so only one tensor is in flight beside the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from strata.errors import ModelLoadError

log = logging.getLogger(__name__)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1}


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def check(self, name: str) -> None:
        """Raise ModelLoadError if the tensor cannot be loaded (e.g. its type)."""
        ...

    def load(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor: ...

    def identity(self) -> str:
        """sha256 over tensor names, shapes and types."""
        ...

    def tensor_bytes(self) -> int:
        """Bytes of all tensors as stored (what the weights on a device are compared with)."""
        ...


class GGUFSource:
    """Tensors of a GGUF file, dequantized by `strata.gguf` on the target device."""

    def __init__(self, path: str) -> None:
        from strata.gguf import (  # only GGUF loads pay for the reader
            FOREIGN_TYPES,
            SUPPORTED_TYPES,
            GGUFFile,
        )

        self.path = path
        self.file = GGUFFile(path)
        self.supported = SUPPORTED_TYPES
        self.foreign = FOREIGN_TYPES
        self._warned: set[Any] = set()

    def names(self) -> set[str]:
        return set(self.file.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensors[name].shape

    def check(self, name: str) -> None:
        info = self.file.tensors[name]
        if info.ggml_type in self.foreign:
            if info.ggml_type not in self._warned:
                self._warned.add(info.ggml_type)
                log.warning("%s: tensors of type %s are decoded by gguf.quants on the CPU (slow to "
                            "load, no kernel computes with them)", self.path, info.type_name)
        elif info.ggml_type not in self.supported:
            supported = ", ".join(sorted(t.name for t in self.supported | self.foreign))
            raise ModelLoadError(
                self.path,
                f"tensor {name} has quantization type {info.type_name}, which is not supported "
                f"(supported: {supported})",
            )

    def load(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.file.load(name, device, dtype)

    def block_type(self, name: str) -> Any:
        """The tensor's ggml type (a GGMLQuantizationType)."""
        return self.file.tensors[name].ggml_type

    def blocks(self, name: str, device: torch.device) -> torch.Tensor:
        """The tensor's bytes as uint8 [rows, row_bytes] on `device`: ggml keeps each row's blocks
        together, so a row of bytes is a weight row."""
        raw = torch.from_numpy(self.file.raw(name)).to(device)
        return raw.reshape(self.file.tensors[name].shape[0], -1)

    def identity(self) -> str:
        return self.file.identity()

    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.file.tensors.values())


class SafetensorsSource:
    """Tensors of a Hugging Face folder: one model.safetensors or shards with an index.

    safetensors memory-maps each file, so a tensor already in the compute
    dtype on the CPU is used in place without a copy.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(str(index), f"not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            found = "pytorch .bin weights only" if any(folder.glob("*.bin")) else "no weights"
            raise ModelLoadError(
                self.folder, f"no *.safetensors files ({found}); Strata reads safetensors"
            )
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, Any] = {}
        for fname in files:
            fpath = folder / fname
            if not fpath.is_file():
                raise ModelLoadError(str(fpath), "weight file named by the index is missing")
            try:
                handle = safe_open(str(fpath), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(str(fpath), f"not a readable safetensors file ({e})") from None
            self._handles[fname] = handle
            for key in handle.keys():
                self._file_of[key] = handle

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file_of[name].get_slice(name).get_shape())

    def _dtype(self, name: str) -> str:
        return str(self._file_of[name].get_slice(name).get_dtype())

    def check(self, name: str) -> None:
        kind = self._dtype(name)
        if kind not in ("F32", "F16", "BF16", "F64"):
            raise ModelLoadError(
                self.folder, f"tensor {name} has dtype {kind}, which is not supported"
            )

    def load(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self._file_of[name].get_tensor(name).to(device=device, dtype=dtype)

    def tensor_bytes(self) -> int:
        total = 0
        for name in self._file_of:
            sl = self._file_of[name].get_slice(name)
            total += math.prod(sl.get_shape()) * _DTYPE_BYTES.get(str(sl.get_dtype()), 4)
        return total

    def identity(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self._file_of):
            shape = ",".join(str(n) for n in self.shape(name))
            h.update(f"{name}\t{self._dtype(name)}\t{shape}\n".encode())
        return h.hexdigest()
