"""Small patterns for the fixed text around a call: markers, keys, the tool's name.

A pattern is a tuple of steps matched one character at a time, so a stream
can tell as soon as a character rules a call out. A pattern must end with a
step that consumes (a literal), so "done" always means "done with this character".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Union

WHITESPACE = " \t\n\r"
MAX_NAME = 256  # longer is no tool name; the bound keeps re-reading a failed header cheap
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class Lit:
    """Exactly one of `options` (which must not be prefixes of one another)."""

    options: tuple[str, ...]


@dataclass(frozen=True)
class Ws:
    """Any run of whitespace, also none."""


@dataclass(frozen=True)
class Opt:
    """`text`, or nothing when the next character does not start it."""

    text: str


@dataclass(frozen=True)
class JsonName:
    """A JSON string: the tool's name."""


@dataclass(frozen=True)
class BareName:
    """A tool's name written without quotes, ended by the first other character."""


Step = Union[Lit, Ws, Opt, JsonName, BareName]
Pattern = tuple[Step, ...]
Result = Literal["more", "done", "fail"]


def lit(*options: str) -> Lit:
    return Lit(tuple(options))


class Matcher:
    """One pattern matched against characters as they come; `name` is what it captured."""

    def __init__(self, pattern: Pattern) -> None:
        if not pattern or not isinstance(pattern[-1], Lit):
            raise ValueError("a pattern must end with a literal")
        self.pattern = pattern
        self.taken = ""
        self.name: str | None = None
        self._step = 0
        self._part = ""
        self._escaped = False

    def push(self, c: str) -> Result:
        result = self._push(c)
        if result != "fail":
            self.taken += c
        return result

    def _push(self, c: str) -> Result:
        while True:
            step = self.pattern[self._step]
            verdict = self._match(step, c)
            if verdict == "next":  # the step ended before `c`: offer `c` to the next one
                self._advance()
                continue
            if verdict == "ended":
                self._advance()
                return "done" if self._step == len(self.pattern) else "more"
            return verdict

    def _advance(self) -> None:
        self._step += 1
        self._part = ""
        self._escaped = False

    def _match(self, step: Step, c: str) -> str:
        if isinstance(step, Ws):
            return "more" if c in WHITESPACE else "next"
        if isinstance(step, Opt):
            if not self._part and not step.text.startswith(c):
                return "next"
            return self._literal((step.text,), c)
        if isinstance(step, Lit):
            return self._literal(step.options, c)
        if isinstance(step, BareName):
            if c in _NAME_CHARS and len(self._part) < MAX_NAME:
                self._part += c
                return "more"
            if not self._part:
                return "fail"
            self.name = self._part
            return "next"
        return self._json_name(c)

    def _literal(self, options: tuple[str, ...], c: str) -> str:
        part = self._part + c
        if not any(o.startswith(part) for o in options):
            return "fail"
        self._part = part
        return "ended" if part in options else "more"

    def _json_name(self, c: str) -> str:
        if not self._part:
            if c != '"':
                return "fail"
            self._part = c
            return "more"
        if ord(c) < 0x20 or len(self._part) > MAX_NAME:
            return "fail"
        self._part += c
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            try:
                self.name = json.loads(self._part)
            except ValueError:
                return "fail"
            return "ended"
        return "more"
