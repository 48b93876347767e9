"""A SentencePiece-style ("llama") GGUF vocabulary: scores, byte fallback, space prefix.

Two oracles. transformers' GGUF loader, on text where it and llama.cpp agree.
And a direct implementation of SentencePiece's BPE rule (repeatedly join the
adjacent pair whose join scores best, leftmost on ties; unknown characters as
<0xNN> bytes), with llama.cpp's placement of the space prefix: at the start
and after every special or user-defined token. transformers differs there: it
adds no prefix after a special token and none before text that already starts
with a space.
"""

from __future__ import annotations

from typing import Any

import pytest

from strata.tokenizer import IncrementalDetokenizer, Tokenizer

from tiny_spm import SPM_CONTROL, SPM_USER_DEFINED, SpmVocab

AGREED = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "two  spaces and trailing ",
    "emoji 😀 and 中文 fall back to bytes",
    "Café naïve résumé",
    "tab\there\nnewline\n\n",
    "Numbers like 42 and 1999",
    "x",
    "",
]
PREFIX_CASES = [
    " leading space",
    "   three",
    "<s>Hello",
    "Hello<|user|>world",
    "a <think> b",
    "<|user|> hi</s>",
    "<|user|>Hello there<|assistant|>",
]


def reference_encode(vocab: SpmVocab, text: str, add_bos: bool) -> list[int]:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    whole = sorted(
        (t for t, ty in zip(vocab.tokens, vocab.types) if ty in (2, 3, 4)), key=len, reverse=True
    )
    out = [ids["<s>"]] if add_bos else []
    prev_whole = True
    pos, start = 0, 0
    fragments: list[tuple[str, bool]] = []
    while pos < len(text):
        hit = next((t for t in whole if text.startswith(t, pos)), None)
        if hit is None:
            pos += 1
            continue
        if start < pos:
            fragments.append((text[start:pos], False))
        fragments.append((hit, True))
        pos = start = pos + len(hit)
    if start < len(text):
        fragments.append((text[start:], False))

    for fragment, is_whole in fragments:
        if is_whole:
            out.append(ids[fragment])
            prev_whole = True
            continue
        symbols = list((" " if prev_whole else "") + fragment.replace(" ", "\u2581"))
        symbols = [s.replace(" ", "\u2581") for s in symbols]
        while True:
            best, best_score = None, None
            for i in range(len(symbols) - 1):
                joined = symbols[i] + symbols[i + 1]
                j = ids.get(joined)
                if j is not None and vocab.types[j] == 1:
                    if best_score is None or vocab.scores[j] > best_score:
                        best, best_score = i, vocab.scores[j]
            if best is None:
                break
            symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
        for s in symbols:
            if s in ids:
                out.append(ids[s])
            else:
                out.extend(ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
        prev_whole = False
    return out


@pytest.mark.parametrize("text", AGREED)
def test_encode_matches_transformers(spm: Tokenizer, hf_spm: Any, text: str) -> None:
    assert spm.encode(text) == hf_spm.encode(text, add_special_tokens=False)
    assert spm.encode(text, add_special_tokens=True) == hf_spm.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", AGREED + PREFIX_CASES)
def test_encode_matches_sentencepiece_rule(spm: Tokenizer, spm_vocab: SpmVocab, text: str) -> None:
    assert spm.encode(text) == reference_encode(spm_vocab, text, add_bos=False)
    with_bos = spm.encode(text, add_special_tokens=True)
    assert with_bos == reference_encode(spm_vocab, text, add_bos=True)


@pytest.mark.parametrize("text", AGREED + PREFIX_CASES)
def test_decode_matches_transformers(spm: Tokenizer, hf_spm: Any, text: str) -> None:
    ids = spm.encode(text, add_special_tokens=True)
    assert spm.decode(ids) == hf_spm.decode(ids, skip_special_tokens=True)
    raw = spm.decode(ids, skip_special_tokens=False)
    assert raw == hf_spm.decode(ids, skip_special_tokens=False)


def test_plain_text_round_trips(spm: Tokenizer) -> None:
    for text in ["Hello world", "emoji 😀 and 中文", "two  spaces", "Café\nnaïve "]:
        assert spm.decode(spm.encode(text, add_special_tokens=True)) == text


def test_byte_fallback_and_pieces(spm: Tokenizer, spm_vocab: SpmVocab) -> None:
    ids = spm.encode("😀")
    pieces = [spm_vocab.tokens[i] for i in ids]
    assert pieces[0] == "\u2581" and pieces[1:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert [spm.token_bytes(i) for i in ids[1:]] == [bytes([b]) for b in "😀".encode()]
    hello = spm.encode("Hello world")
    assert "".join(spm.token_text(i) for i in hello) == " Hello world"


def test_special_tokens_and_flags(spm: Tokenizer, hf_spm: Any) -> None:
    assert (spm.bos_token, spm.bos_token_id) == ("<s>", 1)
    assert (spm.eos_token, spm.eos_token_id) == ("</s>", 2)
    assert spm.add_bos_token
    assert spm.stop_token_ids == {2}
    user = spm.encode(SPM_CONTROL[0])
    think = spm.encode(SPM_USER_DEFINED[0], add_special_tokens=False)
    assert len(user) == 1 and spm.is_special(user[0])
    assert think[-1] == spm.backend.token_to_id("<think>") and not spm.is_special(think[-1])
    messages = [{"role": "user", "content": "Hello"}]
    assert spm.apply_chat_template(messages) == hf_spm.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_no_space_prefix(spm_vocab: SpmVocab) -> None:
    tok = Tokenizer.from_gguf_metadata(
        {**spm_vocab.metadata, "tokenizer.ggml.add_space_prefix": False}, "spm"
    )
    ids = tok.encode("Hello world")
    assert spm_vocab.tokens[ids[0]] != "\u2581Hello"
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(tok.encode(" x")) == " x"


def test_streaming_keeps_spaces_and_whole_characters(spm: Tokenizer) -> None:
    text = "Hello world 😀 中文 the end"
    ids = spm.encode(text, add_special_tokens=True)
    detok = IncrementalDetokenizer(spm)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == spm.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(p.startswith(" ") for p in pieces)

    prompt = spm.encode("Say:", add_special_tokens=True)
    full = spm.encode("Say: world", add_special_tokens=True)
    assert full[: len(prompt)] == prompt
    detok = IncrementalDetokenizer(spm, prompt_ids=prompt)
    pieces = [detok.push(i) for i in full[len(prompt) :]] + [detok.flush()]
    assert pieces[0].startswith(" ")
    assert "".join(pieces) == " world"
