"""Streaming detokenization: whole characters only, same text as decoding everything at once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from strata.tokenizer import IncrementalDetokenizer, Tokenizer

STREAMS = [
    "Hello world, this is plain text.",
    "emoji 👋🏽 🎉🚀 👨‍👩‍👧‍👦 ❤️ and CJK 日本語のテキスト 中文字符 한국어",
    "code:\n    x = [1, 2, 3]  # ok\n\n",
    "🎉",
]


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", STREAMS)
def test_pieces_join_to_decode_without_broken_characters(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    pieces = _stream(IncrementalDetokenizer(smol), ids)
    assert "".join(pieces) == smol.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incomplete_character_is_held_back(smol: Tokenizer) -> None:
    ids = smol.encode("a🎉")
    assert len(ids) >= 3  # "a" and the emoji's bytes over several tokens
    detok = IncrementalDetokenizer(smol)
    out = [detok.push(i) for i in ids]
    assert out[0] == "a"
    assert out[1:-1] == [""] * (len(ids) - 2)
    assert out[-1] == "🎉"


def test_flush_gives_what_was_held(smol: Tokenizer) -> None:
    ids = smol.encode("🎉")
    detok = IncrementalDetokenizer(smol)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == smol.decode(ids[:1])  # the broken half, now that the stream ended
    assert detok.flush() == ""


def test_special_tokens_give_no_text(smol: Tokenizer) -> None:
    ids = smol.encode("Hi<|im_end|> there<|im_start|>")
    pieces = _stream(IncrementalDetokenizer(smol), ids)
    assert "".join(pieces) == "Hi there"


def test_prompt_context(smol: Tokenizer) -> None:
    prompt = smol.encode("<|im_start|>assistant\n")
    reply = smol.encode("Sure, 👋 here")
    pieces = _stream(IncrementalDetokenizer(smol, prompt_ids=prompt), reply)
    assert "".join(pieces) == "Sure, 👋 here"


class _CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow(smol: Tokenizer) -> None:
    text = "The quick brown fox 🦊 jumps over the lazy dog 中文. " * 40
    ids = smol.encode(text)
    counting = _CountingTokenizer(smol)
    detok = IncrementalDetokenizer(counting, prompt_ids=list(range(100)))  # type: ignore[arg-type]
    pieces = _stream(detok, ids)
    assert "".join(pieces) == smol.decode(ids)
    assert len(ids) > 400
    assert max(counting.sizes) <= 8
    assert len(counting.sizes) <= 2 * len(ids) + 2


def test_tool_call_markers_stay_in_the_text_other_special_tokens_do_not(smol: Tokenizer) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(smol.backend.to_str())
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("<|secret|>", special=True)])
    tok = Tokenizer(backend, source="test", special_tokens={"eos_token": "<|im_end|>"})
    marker, secret = backend.token_to_id("[TOOL_CALLS]"), backend.token_to_id("<|secret|>")
    assert tok.text_special_ids == {marker}
    ids = tok.encode("Sure.") + [marker] + tok.encode('[{"name": "f"}]') + [secret] + tok.encode(" end")
    text = "".join(_stream(IncrementalDetokenizer(tok), ids))
    assert text == 'Sure.[TOOL_CALLS][{"name": "f"}] end'
