"""Session files: a conversation's tokens and K/V saved to disk and read back.

Layout (all integers little-endian):

    magic   8 bytes  b"STRATAKV"
    version u32      FORMAT_VERSION
    hlen    u32      length of the header JSON
    header  hlen     UTF-8 JSON: model identity, KV format, token count, every
                     layer's runs (name, dtype, cell shape), the saved states
                     (version 2: their runs and positions), payload length and
                     sha256, byte order
    hcrc    u32      crc32 of the header JSON
    payload          token ids (int32), then each layer's runs in header order,
                     the first n_tokens cells of each, raw bytes; then (version
                     2) each saved state's runs in header order, raw bytes

Saved states are a recurrent model's per-conversation state (`kv/state.py`)
at a few positions: its checkpoints and the state at n_tokens. Version 1
files (no states) still load.

A load checks everything (magic, version, header, identity, format, lengths,
checksum) before it returns anything, so a bad file never reaches the pool;
`peek_session` reads only the header so the engine can reserve pool chunks
before it writes a byte. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from strata.errors import BadRequest, SessionFileError
from strata.kv.formats import Storage

MAGIC = b"STRATAKV"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_HEADER = 16 << 20  # a header is a few KB; anything larger is corruption
_PREFIX = struct.Struct("<8sII")
_CRC = struct.Struct("<I")
TOKEN_DTYPE = torch.int32

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}


@dataclass(frozen=True)
class RunInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]  # per cell

    def nbytes(self, n_cells: int) -> int:
        return n_cells * math.prod(self.shape) * _element_size(self.dtype)


@dataclass(frozen=True)
class SessionHeader:
    """What a session file holds, known before its payload is read."""

    version: int
    model_identity: str
    kv_format: str
    n_tokens: int
    layers: tuple[tuple[RunInfo, ...], ...]
    payload_len: int
    payload_sha256: str
    state_runs: tuple[RunInfo, ...] = ()  # per saved state: "layer.name" -> dtype, shape
    state_positions: tuple[int, ...] = ()  # ascending, each at most n_tokens

    @property
    def n_layers(self) -> int:
        return len(self.layers)


SavedState = tuple[int, dict[str, torch.Tensor]]  # (position, "layer.name" -> state tensor)


@dataclass
class SessionData:
    """What a session file holds: token ids, per-layer K/V runs, saved states."""

    tokens: torch.Tensor
    layers: list[Storage]
    states: list[SavedState]


def layout_of(storages: list[Storage]) -> tuple[tuple[RunInfo, ...], ...]:
    """The per-layer run layout (name, dtype, cell shape) of a pool's storage, as a header states it."""
    return tuple(
        tuple(RunInfo(name, _DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape[1:])) for name, t in st.items())
        for st in storages
    )


def check_layout(header: SessionHeader, layout: tuple[tuple[RunInfo, ...], ...], where: str) -> None:
    """Refuse a file whose layers, runs, dtypes or cell shapes differ from the running pool's.

    The checksum proves the file is what was written, not that this engine
    wrote it: a file of another layer count or cell layout would otherwise be
    copied into the pool (or fail half-way, after the lane gave way).
    """
    if header.n_layers != len(layout):
        raise SessionFileError(where, f"has {header.n_layers} layers; this model has {len(layout)}")
    for i, (got, want) in enumerate(zip(header.layers, layout)):
        if [r.name for r in got] != [r.name for r in want]:
            raise SessionFileError(where, f"layer {i} holds runs {[r.name for r in got]}; this engine's "
                                          f"cells are {[r.name for r in want]}")
        for g, w in zip(got, want):
            if g.dtype != w.dtype:
                raise SessionFileError(where, f"layer {i} run {g.name!r} is {g.dtype}; this engine "
                                              f"stores {w.dtype}")
            if g.shape != w.shape:
                raise SessionFileError(where, f"layer {i} run {g.name!r} has cells of shape {list(g.shape)}; "
                                              f"this engine's are {list(w.shape)}")


def check_tokens(tokens: torch.Tensor, vocab_size: int, where: str) -> None:
    """Every token id must be one the model knows (an id past the vocabulary breaks the embedding)."""
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise SessionFileError(where, f"token id {int(bad)} is outside the vocabulary (0..{vocab_size - 1})")


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


def _payload_len(n_tokens: int, layers: tuple[tuple[RunInfo, ...], ...],
                 state_runs: tuple[RunInfo, ...] = (), n_states: int = 0) -> int:
    kv = n_tokens * 4 + sum(r.nbytes(n_tokens) for runs in layers for r in runs)
    return kv + n_states * sum(r.nbytes(1) for r in state_runs)


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy where possible."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def resolve_session_path(session_dir: str | os.PathLike[str], name: str) -> Path:
    """The file `name` inside `session_dir`; any name that could leave the folder is refused."""
    bad = (
        not isinstance(name, str) or not name.strip() or name in (".", "..")
        or any(c in name for c in ("/", "\\", "\x00", os.sep))
        or os.path.isabs(name) or len(name.encode("utf-8", "surrogatepass")) > 255
    )
    if bad:
        raise BadRequest(f"invalid session filename {name!r}: use a plain file name",
                         param="filename")
    root = Path(session_dir).resolve()
    path = root / name  # not resolved: the file is opened without following a link
    if path.resolve().parent != root:
        raise BadRequest(f"session filename {name!r} resolves outside the session folder",
                         param="filename")
    return path


def _state_runs(states: list[SavedState], n_tokens: int, where: str) -> tuple[tuple[RunInfo, ...], list[memoryview]]:
    """The runs every saved state holds (the first one's, in its order) and their raw bytes."""
    if not states:
        return (), []
    names = list(states[0][1])
    runs = []
    for name in names:
        t = states[0][1][name]
        if t.dtype not in _DTYPE_NAMES:
            raise SessionFileError(where, f"state {name!r}: cannot save {t.dtype}")
        runs.append(RunInfo(name, _DTYPE_NAMES[t.dtype], tuple(t.shape)))
    chunks = []
    last = 0
    for pos, named in states:
        if not last < pos <= n_tokens:
            raise SessionFileError(where, f"saved state at position {pos}: positions must ascend and "
                                          f"lie in 1..{n_tokens}")
        last = pos
        if list(named) != names:
            raise SessionFileError(where, f"saved state at {pos} holds {list(named)}, not {names}")
        for r in runs:
            t = named[r.name]
            if _DTYPE_NAMES.get(t.dtype) != r.dtype or tuple(t.shape) != r.shape:
                raise SessionFileError(where, f"saved state {r.name!r} at {pos} differs in type or shape")
            chunks.append(_raw(t.to("cpu")))
    return tuple(runs), chunks


def save_session(
    path: str | os.PathLike[str],
    tokens: list[int] | torch.Tensor,
    kv_layers: list[Storage],
    *,
    model_identity: str,
    kv_format: str,
    states: list[SavedState] = (),  # type: ignore[assignment]
) -> int:
    """Write a session file atomically; returns its size in bytes.

    Each run tensor has a leading cell dimension of at least len(tokens); the
    first len(tokens) cells are saved. Every saved state names the same runs.
    """
    where = str(path)
    toks = torch.as_tensor(tokens, dtype=TOKEN_DTYPE, device="cpu").reshape(-1).contiguous()
    n = len(toks)
    layers: list[list[tuple[RunInfo, torch.Tensor]]] = []
    for i, storage in enumerate(kv_layers):
        runs = []
        for name, t in storage.items():
            if t.dtype not in _DTYPE_NAMES:
                raise SessionFileError(where, f"layer {i} run {name!r}: cannot save {t.dtype}")
            if t.dim() < 1 or len(t) < n:
                raise SessionFileError(where, f"layer {i} run {name!r} has fewer than {n} cells")
            cells = t[:n].to("cpu").contiguous()
            runs.append((RunInfo(name, _DTYPE_NAMES[t.dtype], tuple(t.shape[1:])), cells))
        layers.append(runs)
    infos = tuple(tuple(r for r, _ in runs) for runs in layers)
    state_runs, state_chunks = _state_runs(list(states), n, where)
    chunks = [_raw(toks)] + [_raw(t) for runs in layers for _, t in runs] + state_chunks
    digest = hashlib.sha256()
    for c in chunks:
        digest.update(c)
    header = {
        "model_identity": model_identity, "kv_format": kv_format, "n_tokens": n,
        "layers": [[{"name": r.name, "dtype": r.dtype, "shape": list(r.shape)} for r in runs]
                   for runs in infos],
        "payload_len": _payload_len(n, infos, state_runs, len(states)),
        "payload_sha256": digest.hexdigest(), "byteorder": sys.byteorder,
        "states": {"runs": [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape)} for r in state_runs],
                   "positions": [pos for pos, _ in states]},
    }
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    target = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)))
            f.write(blob)
            f.write(_CRC.pack(zlib.crc32(blob)))
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise SessionFileError(where, f"cannot write: {e.strerror or e}") from None
    return _PREFIX.size + len(blob) + _CRC.size + header["payload_len"]


def _read_exact(f: BinaryIO, n: int, where: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise SessionFileError(where, f"file is truncated (in the {what})")
    return data


def _parse_header(blob: bytes, where: str) -> dict[str, Any]:
    try:
        h = json.loads(blob.decode("utf-8"))
        layers = tuple(
            tuple(RunInfo(str(r["name"]), str(r["dtype"]), tuple(int(s) for s in r["shape"]))
                  for r in runs)
            for runs in h["layers"]
        )
        out = {
            "model_identity": str(h["model_identity"]), "kv_format": str(h["kv_format"]),
            "n_tokens": int(h["n_tokens"]), "layers": layers,
            "payload_len": int(h["payload_len"]), "payload_sha256": str(h["payload_sha256"]),
            "byteorder": str(h["byteorder"]),
        }
        st = h.get("states") or {"runs": [], "positions": []}
        out["state_runs"] = tuple(RunInfo(str(r["name"]), str(r["dtype"]), tuple(int(x) for x in r["shape"]))
                                  for r in st["runs"])
        out["state_positions"] = tuple(int(x) for x in st["positions"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise SessionFileError(where, f"header is malformed ({type(e).__name__}: {e})") from None
    for runs in layers:
        if len({r.name for r in runs}) != len(runs):
            raise SessionFileError(where, "header names a run twice in one layer")
        for r in runs:
            if r.dtype not in _DTYPES or any(s < 0 for s in r.shape):
                raise SessionFileError(where, f"header names an unknown run layout {r}")
    for r in out["state_runs"]:
        if r.dtype not in _DTYPES or any(x < 0 for x in r.shape):
            raise SessionFileError(where, f"header names an unknown state layout {r}")
    pos = out["state_positions"]
    if any(not a < b for a, b in zip((0,) + pos, pos)) or (pos and pos[-1] > out["n_tokens"]):
        raise SessionFileError(where, f"header's saved-state positions {list(pos)} are not ascending "
                                      f"within the {out['n_tokens']} tokens")
    if bool(pos) != bool(out["state_runs"]):
        raise SessionFileError(where, "header's saved states name no runs, or runs without positions")
    return out


def _read_header(
    f: BinaryIO, where: str, model_identity: str | None, kv_format: str | None
) -> SessionHeader:
    magic, version, hlen = _PREFIX.unpack(_read_exact(f, _PREFIX.size, where, "file header"))
    if magic != MAGIC:
        raise SessionFileError(where, "not a Strata session file (bad magic bytes)")
    if version not in READABLE_VERSIONS:
        raise SessionFileError(
            where, f"session file format version {version}; this Strata reads versions "
                   f"{', '.join(map(str, READABLE_VERSIONS))}")
    if hlen > MAX_HEADER:
        raise SessionFileError(where, f"header length {hlen} is implausible (file corrupted)")
    blob = _read_exact(f, hlen, where, "header")
    (crc,) = _CRC.unpack(_read_exact(f, _CRC.size, where, "header checksum"))
    if zlib.crc32(blob) != crc:
        raise SessionFileError(where, "header checksum mismatch (file corrupted)")
    h = _parse_header(blob, where)
    if h["byteorder"] != sys.byteorder:
        raise SessionFileError(where, f"saved on a {h['byteorder']}-endian machine")
    if model_identity is not None and h["model_identity"] != model_identity:
        raise SessionFileError(
            where, f"saved by another model (identity {h['model_identity']}, "
                   f"this model {model_identity})")
    if kv_format is not None and h["kv_format"] != kv_format:
        raise SessionFileError(
            where, f"saved with --kv {h['kv_format']}, this engine uses --kv {kv_format}")
    if version == 1 and h["state_runs"]:
        raise SessionFileError(where, "a version 1 file cannot hold saved states (file corrupted)")
    expected = _payload_len(h["n_tokens"], h["layers"], h["state_runs"], len(h["state_positions"]))
    if h["n_tokens"] < 0 or h["payload_len"] != expected:
        raise SessionFileError(where, "header lengths disagree (file corrupted)")
    have = os.fstat(f.fileno()).st_size - f.tell()
    if have < h["payload_len"]:
        raise SessionFileError(
            where, f"file is truncated: payload has {have} of {h['payload_len']} bytes")
    if have > h["payload_len"]:
        extra_bytes = have - h["payload_len"]
        raise SessionFileError(where, f"{extra_bytes} unexpected bytes after the payload")
    h.pop("byteorder")
    return SessionHeader(version=version, **h)


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a regular file only: no link is followed, and a FIFO or device never blocks the caller.

    O_NONBLOCK makes opening a FIFO return at once (a plain open would wait for
    a writer, with the engine thread); fstat then refuses anything but a
    regular file before a byte is read.
    """
    where = str(path)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SessionFileError(where, "is a symbolic link; session files must be regular files") from None
        raise SessionFileError(where, f"cannot open: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SessionFileError(where, "is not a regular file (a FIFO, device or folder); refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def peek_session(
    path: str | os.PathLike[str], *, model_identity: str | None = None, kv_format: str | None = None
) -> SessionHeader:
    """The header of a session file (validated, and checked against the model and
    format when given) without reading the payload: enough to reserve pool chunks."""
    with _open(path) as f:
        return _read_header(f, str(path), model_identity, kv_format)


def load_session(
    path: str | os.PathLike[str], *, model_identity: str, kv_format: str,
    accept: Callable[[SessionHeader], None] | None = None,
) -> tuple[torch.Tensor, list[Storage]]:
    """(token ids int32 [n], per layer run name -> CPU tensor [n, *cell shape]): `read_session`
    for callers that keep no states."""
    data = read_session(path, model_identity=model_identity, kv_format=kv_format, accept=accept)
    return data.tokens, data.layers


def read_session(
    path: str | os.PathLike[str], *, model_identity: str, kv_format: str,
    accept: Callable[[SessionHeader], None] | None = None,
) -> SessionData:
    """Token ids, per-layer runs and saved states of a session file.

    Raises SessionFileError naming the file for anything wrong; nothing is
    returned until the payload checksum has been verified. `accept` sees the
    header of the file as opened (so it cannot change between a check and the
    read) and raises to refuse it before the payload is read.
    """
    where = str(path)
    with _open(path) as f:
        h = _read_header(f, where, model_identity, kv_format)
        if accept is not None:
            accept(h)
        n = h.n_tokens
        tokens = torch.empty(n, dtype=TOKEN_DTYPE)
        layers: list[Storage] = [
            {r.name: torch.empty((n, *r.shape), dtype=_DTYPES[r.dtype]) for r in runs}
            for runs in h.layers
        ]
        states: list[SavedState] = [
            (pos, {r.name: torch.empty(r.shape, dtype=_DTYPES[r.dtype]) for r in h.state_runs})
            for pos in h.state_positions
        ]
        digest = hashlib.sha256()
        every = [tokens] + [t for s in layers for t in s.values()] + [t for _, st in states for t in st.values()]
        for t in every:
            buf = _raw(t)
            if f.readinto(buf) != len(buf):
                raise SessionFileError(where, "file is truncated (in the payload)")
            digest.update(buf)
    if digest.hexdigest() != h.payload_sha256:
        raise SessionFileError(where, "payload checksum mismatch (file corrupted)")
    return SessionData(tokens, layers, states)
