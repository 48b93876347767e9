"""A call's arguments object read a character at a time, so it can stream before it ends.

Only a prefix that can still be closed into valid JSON is ever released
(`safe`), together with the text that closes it (`closing`): a call cut off
by the end of the output, or broken by a syntax error, still gets arguments
that parse, and what came after the safe prefix goes back to being text.
Held back until they are whole: keys, numbers, literals, escapes and commas.
"""

from __future__ import annotations

import re

_WS = " \t\n\r"
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d*)?|(?:0|[1-9]\d*)\.)?")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"


class JsonArgs:
    """One JSON object; `push` says whether a character keeps it valid."""

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.safe = 0
        self.closing = ""
        self.done = False
        self._closers: list[str] = []
        self._state = "top"
        self._in_key = False
        self._token = ""  # the number or literal being read
        self._hex_left = 0

    def push(self, c: str) -> bool:
        """Take one character; False (and nothing taken) when it breaks the JSON."""
        if self.done or not self._step(c):
            return False
        self.chars.append(c)
        if self.done:
            self.safe, self.closing = len(self.chars), ""
        else:
            self._mark_safe()
        return True

    def end(self) -> None:
        """The text ended: a number that is whole by now counts."""
        if self._state == "number" and _NUMBER.fullmatch(self._token):
            self._value_done()
            self._mark_safe()

    def safe_text(self) -> str:
        return "".join(self.chars[: self.safe])

    # -- the state machine -------------------------------------------------------

    def _step(self, c: str) -> bool:
        state = self._state
        if state == "top":
            return c == "{" and self._open("}")
        if state == "string":
            return self._string_char(c)
        if state == "escape":
            if c not in _ESCAPES:
                return False
            self._state, self._hex_left = ("hex", 4) if c == "u" else ("string", 0)
            return True
        if state == "hex":
            if c not in _HEX:
                return False
            self._hex_left -= 1
            if not self._hex_left:
                self._state = "string"
            return True
        if state == "number":
            return self._number_char(c)
        if state == "literal":
            return self._literal_char(c)
        if c in _WS:
            return True
        if state == "colon":
            if c == ":":
                self._state = "obj_value"
            return c == ":"
        if state in ("key_or_end", "key"):
            if c == '"':
                self._state, self._in_key = "string", True
                return True
            return state == "key_or_end" and self._close(c)
        if state == "after":
            if c == ",":
                self._state = "key" if self._closers[-1] == "}" else "arr_value"
                return True
            return self._close(c)
        if state == "value_or_end" and c == "]":
            return self._close(c)
        return self._value_start(c)

    def _value_start(self, c: str) -> bool:
        if c == '"':
            self._state, self._in_key = "string", False
            return True
        if c == "{":
            return self._open("}")
        if c == "[":
            return self._open("]")
        if c == "-" or c.isdigit() and c.isascii():
            self._state, self._token = "number", c
            return True
        if c in _LITERALS:
            self._state, self._token = "literal", c
            return True
        return False

    def _string_char(self, c: str) -> bool:
        if c == '"':
            if self._in_key:
                self._state = "colon"
            else:
                self._value_done()
            return True
        if c == "\\":
            self._state = "escape"
            return True
        return ord(c) >= 0x20

    def _number_char(self, c: str) -> bool:
        if c in "0123456789+-.eE" and _NUMBER_PREFIX.fullmatch(self._token + c):
            self._token += c
            return True
        if not _NUMBER.fullmatch(self._token):
            return False
        self._value_done()
        self._mark_safe()  # the number ends here, whatever `c` turns out to be
        return self._step(c)

    def _literal_char(self, c: str) -> bool:
        word = _LITERALS[self._token[0]]
        if not word.startswith(self._token + c):
            return False
        self._token += c
        if self._token == word:
            self._value_done()
        return True

    def _open(self, closer: str) -> bool:
        self._closers.append(closer)
        self._state = "key_or_end" if closer == "}" else "value_or_end"
        return True

    def _close(self, c: str) -> bool:
        if c != self._closers[-1]:
            return False
        self._closers.pop()
        self._value_done()
        return True

    def _value_done(self) -> None:
        if self._closers:
            self._state = "after"
        else:
            self._state, self.done = "done", True

    def _mark_safe(self) -> None:
        """Move `safe` up when the text so far can be closed."""
        closers = "".join(reversed(self._closers))
        state = self._state
        if state in ("key_or_end", "value_or_end", "after"):
            closing = closers
        elif state == "obj_value":
            closing = "null" + closers
        elif state == "string" and not self._in_key:
            closing = '"' + closers
        else:
            return
        self.safe, self.closing = len(self.chars), closing
