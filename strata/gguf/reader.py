"""Opening GGUF files with `gguf.GGUFReader`, turning every failure into one clear line.

GGUFReader parses the header through many tiny slices of a `numpy.memmap`;
each slice pays memmap's subclass bookkeeping, which made opening the default
model take over 3 s. `_PlainViewReader` slices a plain ndarray view of the
same mapping instead (about 3x faster) and notices reads past the end of the
file, so a truncated file is reported as truncated rather than as a numpy
reshape error.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from strata.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


class _ShortRead(Exception):
    """A read of `needed` bytes at `offset` ran past the end of a `size`-byte file."""

    def __init__(self, offset: int, needed: int, size: int, in_tensor_data: bool) -> None:
        super().__init__(offset, needed, size)
        self.offset = offset
        self.needed = needed
        self.size = size
        self.in_tensor_data = in_tensor_data


@lru_cache(maxsize=None)
def _typed(dtype: Any, order: str) -> np.dtype[Any]:
    """A dtype with the file's byte order, built once instead of once per read."""
    return np.dtype(dtype).newbyteorder(order)


class _PlainViewReader(GGUFReader):
    """GGUFReader whose reads go through a plain ndarray view and are bounds-checked."""

    _plain: np.ndarray | None = None

    def _get(
        self,
        offset: int,
        dtype: Any,
        count: int = 1,
        override_order: Any = None,
    ) -> np.ndarray:
        plain = self._plain
        if plain is None:
            # Views keep the memmap alive through their `base` chain.
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        typed = _typed(dtype, self.byte_order if override_order is None else override_order)
        end = offset + typed.itemsize * count
        if end > plain.shape[0]:
            in_data = getattr(self, "data_offset", None) is not None and offset >= self.data_offset
            raise _ShortRead(offset, end - offset, plain.shape[0], in_data)
        return plain[offset:end].view(typed)


def open_reader(path: Path) -> GGUFReader:
    """Parse the header and tensor table of `path`, or raise ModelLoadError."""
    where = str(path)
    if not path.exists():
        raise ModelLoadError(where, "file not found")
    if not path.is_file():
        raise ModelLoadError(where, "not a regular file")
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelLoadError(where, f"cannot read: {e.strerror or e}") from None
    if head != GGUF_MAGIC:
        shown = head if head else "an empty file"
        raise ModelLoadError(where, f"not a GGUF file (starts with {shown!r}, expected b'GGUF')")
    try:
        # Copy-on-write, so torch can wrap the bytes without a read-only warning
        # and nothing written through a tensor can ever reach the file.
        return _PlainViewReader(path, mode="c")
    except _ShortRead as e:
        end = e.offset + e.needed
        if e.in_tensor_data:
            problem = (
                f"file is truncated: tensor data runs to byte {end:,} "
                f"but the file has {e.size:,}"
            )
        else:
            problem = (
                f"header runs past the end of the file (to byte {end:,} of {e.size:,}): "
                "truncated or corrupt"
            )
        raise ModelLoadError(where, problem) from None
    except OSError as e:
        raise ModelLoadError(where, f"cannot read: {e.strerror or e}") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, MemoryError) as e:
        raise ModelLoadError(where, f"corrupt GGUF header: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _decode(part: np.ndarray) -> str:
    # Invalid UTF-8 in one vocabulary entry should not make a whole model unusable.
    return part.tobytes().decode("utf-8", errors="replace")


def field_value(reader: GGUFReader, key: str) -> Any:
    """One metadata value as plain Python: str, int, float, bool or a list of those."""
    field = reader.fields[key]
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return _decode(field.parts[-1])
    if kind != GGUFValueType.ARRAY:
        return field.parts[-1][0].item()
    item_kind = field.types[-1] if len(field.types) > 1 else None
    if item_kind == GGUFValueType.STRING:
        return [_decode(field.parts[i]) for i in field.data]
    if not field.data:
        return []
    if item_kind == GGUFValueType.ARRAY:
        # The reader flattens nested arrays; keep what it offers.
        return field.contents()
    return np.concatenate([field.parts[i] for i in field.data]).tolist()


def read_metadata(path: Path, reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of the file (the reader's own GGUF.* entries left out)."""
    out: dict[str, Any] = {}
    for key in reader.fields:
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field_value(reader, key)
        except (ValueError, IndexError, TypeError) as e:
            problem = f"corrupt metadata value {key!r}: {_one_line(e)}"
            raise ModelLoadError(str(path), problem) from None
    return out
