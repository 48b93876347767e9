"""Separating a model's marked thinking (`<think>...</think>`) from its answer.

Works on streamed text: a tag may arrive split across deltas, so a possible
tag prefix is held back until it is ruled in or out. Only a `<think>` at the
very start of the output (after whitespace) opens reasoning; a tag later in
the answer is ordinary text. Templates that open the thinking block in the
prompt itself (the prompt ends with `<think>`) start inside it.
"""

from __future__ import annotations

from typing import Literal

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

Piece = tuple[Literal["reasoning", "content"], str]


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when the rendered prompt leaves the model inside a thinking block."""
    return prompt_text.rstrip().endswith(OPEN_TAG)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """Feed text deltas in order; get back (kind, text) pieces ready to send."""

    def __init__(self, starts_inside: bool = False) -> None:
        self.state: Literal["start", "thinking", "after", "content"] = (
            "thinking" if starts_inside else "start"
        )
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """Still possibly thinking: counts toward a thinking budget."""
        return self.state in ("start", "thinking")

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self.state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(OPEN_TAG):
                    self._buf = stripped[len(OPEN_TAG):]
                    self.state = "thinking"
                    continue
                if OPEN_TAG.startswith(stripped):
                    return out  # empty or a prefix of the tag: wait for more
                self.state = "content"
                continue
            if self.state == "thinking":
                end = self._buf.find(CLOSE_TAG)
                if end >= 0:
                    if end:
                        out.append(("reasoning", self._buf[:end]))
                    self._buf = self._buf[end + len(CLOSE_TAG):]
                    self.state = "after"
                    continue
                keep = _partial_suffix(self._buf, CLOSE_TAG)
                ready = self._buf[: len(self._buf) - keep]
                if ready:
                    out.append(("reasoning", ready))
                self._buf = self._buf[len(ready):]
                return out
            if self.state == "after":
                # The blank lines between </think> and the answer belong to neither.
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    return out
                self._buf = stripped
                self.state = "content"
                continue
            if self._buf:
                out.append(("content", self._buf))
                self._buf = ""
            return out

    def flush(self) -> list[Piece]:
        """At the end of generation: release whatever was held back."""
        text, self._buf = self._buf, ""
        if not text or self.state == "after":
            return []
        return [("reasoning" if self.state == "thinking" else "content", text)]
