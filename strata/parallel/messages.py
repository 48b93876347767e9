"""Control messages of the stage link: a registry of message dataclasses, JSON encoding, framing.

A message is a `@dataclass(frozen=True)` registered under a wire name with
`@message("step")`; on the wire it is one UTF-8 JSON object, its fields plus
`"type": name`, behind a 4-byte big-endian length. Fields hold JSON values
only (int, float, str, bool, None, lists, dicts with str keys); a tuple is
sent as a list and comes back as a list, so declare list fields as lists.
Decoding is strict (exactly the declared fields) so that two builds that
disagree on a message fail at once instead of misreading each other.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from strata.parallel.handshake import StageLinkError

MAX_MESSAGE = 16 * 2**20
HEADER = struct.Struct(">I")

_BY_NAME: dict[str, type] = {}
_NAME_OF: dict[type, str] = {}

T = TypeVar("T", bound=type)


def message(name: str) -> Callable[[T], T]:
    """Register a frozen dataclass as the message called `name` on the wire."""

    def register(cls: T) -> T:
        params = getattr(cls, "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"{cls.__name__}: a message must be a @dataclass(frozen=True)")
        if any(f.name == "type" for f in dataclasses.fields(cls)):
            raise TypeError(f"{cls.__name__}: a message field may not be called 'type'")
        if name in _BY_NAME:
            raise TypeError(f"{cls.__name__}: message type {name!r} is already "
                            f"{_BY_NAME[name].__name__}")
        _BY_NAME[name] = cls
        _NAME_OF[cls] = name
        return cls

    return register


def _check(value: Any, where: str) -> None:
    """Refuse what JSON would change or cannot hold, naming the field (a tuple is fine)."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise StageLinkError(f"{where}: {value} is not a JSON number")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise StageLinkError(f"{where}: dict key {k!r} is not a str")
            _check(item, f"{where}[{k!r}]")
        return
    raise StageLinkError(f"{where}: a {type(value).__name__} is not a JSON value")


def encode(msg: object) -> bytes:
    """The message as UTF-8 JSON (without the length header)."""
    name = _NAME_OF.get(type(msg))
    if name is None:
        raise StageLinkError(f"{type(msg).__name__} is not a registered message")
    body: dict[str, Any] = {"type": name}
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        value = getattr(msg, f.name)
        _check(value, f"{name}.{f.name}")
        body[f.name] = value
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def decode(data: bytes) -> object:
    """The message `data` holds; anything but exactly a registered message's fields raises."""
    try:
        body = json.loads(data)
    except ValueError as e:
        raise StageLinkError(f"message is not UTF-8 JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise StageLinkError("message is not a JSON object with a string 'type'")
    name = body.pop("type")
    cls = _BY_NAME.get(name)
    if cls is None:
        raise StageLinkError(f"unknown message type {name!r}")
    declared = {f.name for f in dataclasses.fields(cls)}
    if missing := declared - body.keys():
        raise StageLinkError(f"{name} message lacks {', '.join(sorted(missing))}")
    if extra := body.keys() - declared:
        raise StageLinkError(f"{name} message has unknown fields {', '.join(sorted(extra))}")
    try:
        return cls(**body)
    except (TypeError, ValueError) as e:
        raise StageLinkError(f"bad {name} message: {e}") from None


def frame(data: bytes, cap: int) -> bytes:
    """`data` behind its length header; a message over `cap` bytes is refused before sending."""
    if len(data) > cap:
        raise StageLinkError(f"message of {len(data)} bytes is over the cap of {cap} bytes")
    return HEADER.pack(len(data)) + data


def frame_length(header: bytes, cap: int) -> int:
    """The length a received header announces; over `cap` the link refuses to read it."""
    (n,) = HEADER.unpack(header)
    if n > cap:
        raise StageLinkError(f"peer sent a message of {n} bytes, over the cap of {cap} bytes")
    return n
