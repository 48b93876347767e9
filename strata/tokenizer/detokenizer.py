"""Turning a stream of token ids into a stream of text.

Decoding one token at a time goes wrong twice: a character split across byte
tokens (an emoji, CJK) comes out as U+FFFD halves, and SentencePiece decoders
drop the leading space of whatever they decode first. So each step decodes a
short window of recent ids twice, with and without the newest tokens, and
emits only the difference, holding it back while it ends in an incomplete
character. The window restarts after every emission, so the cost per token
does not grow with the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context, enough for the decoder to place spaces.
PROMPT_CONTEXT = 6
# Ids before the window are dropped once this many have piled up.
_COMPACT_AFTER = 64


class IncrementalDetokenizer:
    """push(id) -> newly final text; flush() -> whatever is still held back.

    With `prompt_ids`, the output continues the prompt's text (a SentencePiece
    token "▁Hi" after the prompt gives " Hi"); without, it starts the text, so
    everything pushed concatenates to tokenizer.decode(ids). Special tokens
    produce no text, except the tool-call markers (`Tokenizer.text_special_ids`),
    which the server must see to find the calls.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self._start = 0  # window start: text before it has been emitted
        self._read = len(self._ids)  # ids before this are covered by emitted text
        self._kept = getattr(tokenizer, "text_special_ids", frozenset())

    def push(self, token_id: int) -> str:
        """Text that became final with this token ("" while a character is incomplete)."""
        if token_id in self._kept:  # the text so far, then the marker; the window restarts after it
            head = self.flush()
            self._ids.append(token_id)
            self._advance()
            return head + self._tokenizer.token_text(token_id)
        self._ids.append(token_id)
        done = self._decode(self._start, self._read)
        text = self._decode(self._start, len(self._ids))
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""
        self._advance()
        return text[len(done) :]

    def flush(self) -> str:
        """Everything not yet emitted, even an incomplete character (as U+FFFD)."""
        done = self._decode(self._start, self._read)
        text = self._decode(self._start, len(self._ids))
        self._advance()
        return text[len(done) :]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True)

    def _advance(self) -> None:
        self._start, self._read = self._read, len(self._ids)
        if self._start > _COMPACT_AFTER:
            del self._ids[: self._start]
            self._read -= self._start
            self._start = 0
