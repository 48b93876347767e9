"""Streaming a model's output into text and tool calls, for any family's `Syntax`.

Everything is decided one character at a time, so the pieces never depend on
how the output was cut into deltas. Text that may open a call is held back
until the call is ruled in or out; a call starts (and its name goes out) once
its header up to the arguments' "{" matched a known tool; its arguments then
stream as they arrive (see json_args). Whitespace next to a call is dropped.
Whatever turns out not to be a call is given back as text and read again,
so a broken call cannot hide a good one after it.
"""

from __future__ import annotations

from collections.abc import Set

from strata.serve.tools.ids import IdFactory
from strata.serve.tools.json_args import JsonArgs
from strata.serve.tools.pieces import PieceList
from strata.serve.tools.steps import WHITESPACE, Matcher
from strata.serve.tools.syntax import Shape, Syntax
from strata.serve.tools.types import Piece


class CallStream:
    """Feed output text in order with `feed`; end with `finish`."""

    def __init__(self, syntax: Syntax, tool_names: Set[str], new_id: IdFactory) -> None:
        self._syntax = syntax
        self._tools = frozenset(tool_names)
        self._new_id = new_id
        self._out = PieceList()
        self._state = "text"
        self._calls = 0
        # text state
        self._ws = ""  # whitespace held until we know whether a call follows
        self._partial = ""  # a possible opener's beginning
        self._after_call = False
        self._text_seen = False
        # header / follow state: candidate (shape key or follow target, matcher) pairs
        self._opener = ""
        self._taken = ""
        self._candidates: list[tuple[str | None, Matcher]] = []
        # args / trailer state
        self._shape: Shape | None = None
        self._index = 0
        self._args = JsonArgs()
        self._sent = 0
        self._stage = 0

    def feed(self, text: str) -> list[Piece]:
        for c in text:
            self._push(c)
        return self._out.take()

    def finish(self) -> list[Piece]:
        while self._state != "text":
            self._abandon()
        if self._partial:
            self._emit_text(self._partial)
            self._partial = ""
        elif self._ws and not self._after_call:
            self._out.text(self._ws)
        self._ws = ""
        return self._out.take()

    # -- one character -----------------------------------------------------------

    def _push(self, c: str) -> None:
        state = self._state
        if state == "text":
            self._text_char(c)
        elif state == "header":
            self._header_char(c)
        elif state == "args":
            self._args_char(c)
        elif state == "trailer":
            self._trailer_char(c)
        else:
            self._follow_char(c)

    def _reread(self, text: str) -> None:
        for c in text:
            self._push(c)

    def _text_char(self, c: str) -> None:
        openers = self._syntax.openers
        if self._partial:
            candidate = self._partial + c
            if any(o.startswith(candidate) for o in openers):
                self._partial = candidate
                if candidate in openers:
                    self._open(candidate)
                return
            first, rest = self._partial[0], self._partial[1:] + c
            self._partial = ""
            self._emit_text(first)
            self._reread(rest)
            return
        if self._may_open() and any(o.startswith(c) for o in openers):
            self._partial = c
            if c in openers:
                self._open(c)
            return
        if c in WHITESPACE:
            self._ws += c
            return
        self._emit_text(c)

    def _may_open(self) -> bool:
        return self._syntax.anywhere or not (self._text_seen or self._calls)

    def _emit_text(self, text: str) -> None:
        if not self._after_call:
            self._out.text(self._ws)
        self._ws = ""
        self._out.text(text)
        self._after_call = False
        self._text_seen = True

    def _open(self, opener: str) -> None:
        self._partial = ""
        keys = self._syntax.openers[opener]
        self._begin_header(opener, [(k, Matcher(self._syntax.shapes[k].header)) for k in keys])

    def _begin_header(self, opener: str, candidates: list[tuple[str | None, Matcher]]) -> None:
        self._state = "header"
        self._opener = opener
        self._taken = ""
        self._candidates = candidates

    def _header_char(self, c: str) -> None:
        self._taken += c
        alive: list[tuple[str | None, Matcher]] = []
        for key, matcher in self._candidates:
            result = matcher.push(c)
            if result == "done":
                if key is not None and matcher.name in self._tools:
                    self._commit(key, matcher.name)
                else:
                    self._header_failed()
                return
            if result == "more":
                alive.append((key, matcher))
        self._candidates = alive
        if not alive:
            self._header_failed()

    def _header_failed(self) -> None:
        """Not a call after all: the opener is text, the rest is read again."""
        self._state = "text"
        taken = self._taken
        if self._opener:
            self._emit_text(self._opener)
        self._reread(taken)

    def _commit(self, key: str, name: str) -> None:
        self._ws = ""
        self._shape = self._syntax.shapes[key]
        self._index = self._calls
        self._calls += 1
        self._out.start(self._index, self._new_id(), name)
        self._state = "args"
        self._args = JsonArgs()
        self._sent = 0
        self._args_char("{")

    def _args_char(self, c: str) -> None:
        args = self._args
        if not args.push(c):
            self._close_args(c)
            return
        self._send_safe()
        if args.done:
            self._state, self._stage = "trailer", 0
            self._next_stage()

    def _send_safe(self) -> None:
        args = self._args
        if args.safe > self._sent:
            self._out.args(self._index, "".join(args.chars[self._sent : args.safe]))
            self._sent = args.safe

    def _close_args(self, rejected: str) -> None:
        """Broken or cut-off arguments: close the safe prefix; the rest is text again."""
        args = self._args
        self._send_safe()
        self._out.args(self._index, args.closing)
        self._to_text_after_call("".join(args.chars[args.safe :]) + rejected)

    def _to_text_after_call(self, reread: str) -> None:
        self._state = "text"
        self._after_call = True
        self._ws = ""
        self._reread(reread)

    def _next_stage(self) -> None:
        assert self._shape is not None
        trailer = self._shape.trailer
        if self._stage < len(trailer):
            self._candidates = [(None, Matcher(trailer[self._stage]))]
            return
        if self._shape.follow:
            self._state = "follow"
            self._taken = ""
            self._candidates = [(f.next, Matcher(f.pattern)) for f in self._shape.follow]
            return
        self._to_text_after_call("")

    def _trailer_char(self, c: str) -> None:
        matcher = self._candidates[0][1]
        result = matcher.push(c)
        if result == "fail":
            self._to_text_after_call(matcher.taken + c)
        elif result == "done":
            self._stage += 1
            self._next_stage()

    def _follow_char(self, c: str) -> None:
        self._taken += c
        alive: list[tuple[str | None, Matcher]] = []
        for target, matcher in self._candidates:
            result = matcher.push(c)
            if result == "done":
                self._followed(target)
                return
            if result == "more":
                alive.append((target, matcher))
        if not alive:
            self._to_text_after_call(self._taken)
            return
        self._candidates = alive

    def _followed(self, target: str | None) -> None:
        if target is None:
            self._to_text_after_call("")
            return
        self._after_call = True
        self._begin_header("", [(target, Matcher(self._syntax.shapes[target].header))])

    def _abandon(self) -> None:
        """The output ended inside a call's structure: settle what is pending as text."""
        state = self._state
        if state == "header":
            self._header_failed()
        elif state == "args":
            self._args.end()
            self._send_safe()
            self._out.args(self._index, self._args.closing)
            self._to_text_after_call("".join(self._args.chars[self._args.safe :]))
        elif state == "trailer":
            self._to_text_after_call(self._candidates[0][1].taken)
        else:
            self._to_text_after_call(self._taken)
