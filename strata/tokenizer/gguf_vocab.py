"""Building a `tokenizers` backend from GGUF metadata.

A GGUF file carries no tokenizer.json, only llama.cpp's fields: the tokens,
their types, merges (byte-level BPE) or scores (SentencePiece). These build
the equivalent `tokenizers.Tokenizer`, so that the BPE work itself runs in
the `tokenizers` library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as Backend

from strata.errors import ModelLoadError
from strata.tokenizer import byte_level
from strata.tokenizer.pretokenizers import byte_level_cut

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # SentencePiece's visible space


@dataclass
class GgufVocab:
    """A backend plus what the metadata says about it."""

    backend: Backend
    kind: str  # "byte_level" or "sentencepiece"
    tokens: list[str]
    special_ids: dict[str, int]  # "bos", "eos", "unk", "pad", "eot", "eom" -> id
    add_bos: bool
    add_eos: bool


def build_gguf_vocab(metadata: dict[str, Any], source: str) -> GgufVocab:
    """The tokenizer a GGUF's metadata describes; ModelLoadError when it cannot be built."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = _strings(metadata.get("tokenizer.ggml.tokens"))
    if not tokens:
        raise ModelLoadError(source, "the GGUF has no tokenizer.ggml.tokens")
    types = _ints(metadata.get("tokenizer.ggml.token_type")) or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(source, "tokenizer.ggml.token_type and tokens differ in length")
    special_ids = _special_ids(metadata, len(tokens), source)

    if model == "gpt2":
        backend = _byte_level_backend(metadata, tokens, types, source)
        kind = "byte_level"
        add_bos_default = False
    elif model == "llama":
        backend = _sentencepiece_backend(metadata, tokens, types, special_ids)
        kind = "sentencepiece"
        add_bos_default = True
    else:
        raise ModelLoadError(
            source, f"tokenizer model {model!r} is not supported (supported: gpt2, llama)"
        )

    _add_whole_tokens(backend, tokens, types, special_ids)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _bos_eos_processor(tokens, special_ids, add_bos, add_eos)
    return GgufVocab(backend, kind, tokens, special_ids, add_bos, add_eos)


def _strings(value: Any) -> list[str]:
    if value is None:
        return []
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in value]


def _ints(value: Any) -> list[int]:
    return [] if value is None else [int(v) for v in value]


_SPECIAL_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
    "eot": "eot_token_id",
    "eom": "eom_token_id",
}


def _special_ids(metadata: dict[str, Any], n_tokens: int, source: str) -> dict[str, int]:
    ids = {}
    for name, key in _SPECIAL_KEYS.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        value = int(value)
        if value == -1:  # llama.cpp writes -1 for "none"
            continue
        if not 0 <= value < n_tokens:
            raise ModelLoadError(
                source, f"tokenizer.ggml.{key} = {value} is outside the {n_tokens}-token vocabulary"
            )
        ids[name] = value
    return ids


def _vocab(keys: Sequence[str]) -> dict[str, int]:
    """token -> id, keeping the first id when a vocabulary repeats a token."""
    vocab: dict[str, int] = {}
    for i, key in enumerate(keys):
        vocab.setdefault(key, i)
    return vocab


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]] | None:
    raw = metadata.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = []
    for merge in _strings(raw):
        left, sep, right = merge.partition(" ")
        if sep and left and right:
            merges.append((left, right))
    return merges


def _byte_level_backend(
    metadata: dict[str, Any], tokens: list[str], types: list[int], source: str
) -> Backend:
    # Normal tokens stored as raw text are respelled in the byte alphabet; control
    # and user-defined tokens keep their text, because they are matched whole.
    keys = [
        t if ty in (CONTROL, USER_DEFINED) or byte_level.is_spelled(t) else byte_level.spell(t)
        for t, ty in zip(tokens, types)
    ]
    merges = _merges(metadata)
    if merges is None:
        raise ModelLoadError(source, "a gpt2 tokenizer needs tokenizer.ggml.merges")
    cut = byte_level_cut(metadata.get("tokenizer.ggml.pre"), source)
    backend = Backend(
        models.BPE(vocab=_vocab(keys), merges=merges, ignore_merges=cut.ignore_merges)
    )
    backend.normalizer = cut.normalizer
    backend.pre_tokenizer = cut.pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    metadata: dict[str, Any],
    tokens: list[str],
    types: list[int],
    special_ids: dict[str, int],
) -> Backend:
    vocab = _vocab(tokens)
    merges = _merges(metadata)
    if merges is None:
        raw = metadata.get("tokenizer.ggml.scores")
        # Without scores, earlier tokens win, as in vocabularies ordered by merge.
        scores = (
            [float(s) for s in raw] if raw is not None else [-float(i) for i in range(len(tokens))]
        )
        merges = merges_from_scores(tokens, types, scores, vocab)
    unk = tokens[special_ids["unk"]] if "unk" in special_ids else None
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=BYTE in types,
        )
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A space prefix on every stretch of text between whole tokens, as llama.cpp
    # does (SentencePiece itself adds it at the start of the text, and also keeps
    # it before text that starts with a space); the decoder takes the first off.
    to_marks = normalizers.Replace(" ", SPACE_MARK)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE_MARK), to_marks])
        if add_space_prefix
        else to_marks
    )
    backend.pre_tokenizer = None
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "merge the best-scoring pair" rule.

    Every way to cut a token into two tokens of the vocabulary becomes a merge
    ranked by the whole token's score, so BPE joins pairs in the same order
    SentencePiece does.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, token in enumerate(tokens):
        if types[i] in (CONTROL, UNKNOWN, BYTE) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], -len(left), i, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_whole_tokens(
    backend: Backend, tokens: list[str], types: list[int], special_ids: dict[str, int]
) -> None:
    """Control, unknown and named special tokens as special tokens, user-defined ones as
    plain added tokens: both are matched whole in text, never cut by BPE."""
    named = {special_ids[k] for k in ("bos", "eos", "unk", "pad", "eot", "eom") if k in special_ids}
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in range(len(tokens))
        if types[i] in (CONTROL, UNKNOWN) or i in named
    ]
    plain = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in range(len(tokens))
        if types[i] == USER_DEFINED and i not in named
    ]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _bos_eos_processor(
    tokens: list[str], special_ids: dict[str, int], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """What encode(add_special_tokens=True) puts around the text."""
    single, specials = ["$A:0"], []
    if add_bos and "bos" in special_ids:
        bos = tokens[special_ids["bos"]]
        single.insert(0, f"{bos}:0")
        specials.append((bos, special_ids["bos"]))
    if add_eos and "eos" in special_ids:
        eos = tokens[special_ids["eos"]]
        single.append(f"{eos}:0")
        specials.append((eos, special_ids["eos"]))
    return processors.TemplateProcessing(single=single, special_tokens=specials)
