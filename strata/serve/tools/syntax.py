"""How a model family writes its calls, declared as data the call stream interprets.

Every family opens a run of calls with some text (a marker, or the call's
own "{"), writes each call as a header naming the tool, the arguments
object, and a trailer, and may chain further calls with a separator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from strata.serve.tools.steps import JsonName, Pattern, Ws, lit


@dataclass(frozen=True)
class Follow:
    """What may come after a call: `pattern`, then a call shaped `next` (None: the run ends)."""

    pattern: Pattern
    next: str | None


@dataclass(frozen=True)
class Shape:
    """One call: `header` runs up to and including the arguments' "{" and names the tool.

    Each trailer stage is matched on its own: a stage that fails gives back
    only its own characters as text, the call itself stands.
    """

    header: Pattern
    trailer: tuple[Pattern, ...] = ()
    follow: tuple[Follow, ...] = ()


@dataclass(frozen=True)
class Syntax:
    """`openers` maps each opening text to the shapes the first call after it may take."""

    openers: Mapping[str, tuple[str, ...]]
    shapes: Mapping[str, Shape]
    anywhere: bool  # False: a run of calls may only open the output


def object_header(arguments_keys: tuple[str, ...]) -> Pattern:
    """`"name": "<tool>", "<arguments key>": {`, the members inside a JSON call object."""
    keys = tuple(f'"{k}"' for k in arguments_keys)
    return (
        Ws(), lit('"name"'), Ws(), lit(":"), Ws(), JsonName(), Ws(), lit(","),
        Ws(), lit(*keys), Ws(), lit(":"), Ws(), lit("{"),
    )


def braced_header(arguments_keys: tuple[str, ...]) -> Pattern:
    """A whole JSON call object's header, from its own "{"."""
    return (Ws(), lit("{")) + object_header(arguments_keys)
