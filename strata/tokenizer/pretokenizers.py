"""How byte-level BPE vocabularies cut text before merging, by `tokenizer.ggml.pre`.

A vocabulary's merges were learned on text cut by one particular regex; using
another one gives different ids on some inputs. GGUF files name the cut in
`tokenizer.ggml.pre`, with llama.cpp's names; these are the same cuts as the
models' own tokenizer.json files.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers.normalizers import Normalizer
from tokenizers.pre_tokenizers import PreTokenizer

from strata.errors import ModelLoadError

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ByteLevelCut:
    """Everything a `pre` name decides: the cut, a normalizer, and BPE's ignore_merges."""

    pre_tokenizer: PreTokenizer
    normalizer: Normalizer | None = None
    ignore_merges: bool = False


def _gpt2() -> ByteLevelCut:
    return ByteLevelCut(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))


def _digits_then_gpt2() -> ByteLevelCut:
    # Every digit on its own first, then GPT-2's regex (StarCoder, SmolLM).
    return ByteLevelCut(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    )


def _split(regex: str, nfc: bool = False, ignore_merges: bool = False) -> ByteLevelCut:
    cut = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return ByteLevelCut(cut, normalizers.NFC() if nfc else None, ignore_merges)


_CUTS = {
    **dict.fromkeys(["default", "gpt2", "mpt", "olmo", "jais", "gpt-2"], _gpt2),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva", "minerva-7b"],
        _digits_then_gpt2,
    ),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe", "pixtral"],
        lambda: _split(LLAMA3_SPLIT, ignore_merges=True),
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"],
        lambda: _split(QWEN2_SPLIT, nfc=True),
    ),
    "tekken": lambda: _split(TEKKEN_SPLIT),
    **dict.fromkeys(["gpt-4o", "llama4"], lambda: _split(GPT4O_SPLIT)),
}

def byte_level_cut(pre: str | None, source: str) -> ByteLevelCut:
    """The cut for `tokenizer.ggml.pre`. A name not known here is refused: another split (GPT-2's,
    say) would tokenize the model's text into pieces it was not trained on, silently."""
    name = pre or "default"
    make = _CUTS.get(name)
    if make is None:
        raise ModelLoadError(source, f"tokenizer.ggml.pre {name!r} names a pre-tokenizer split Strata does "
                                     f"not implement (known: {', '.join(sorted(_CUTS))})")
    return make()
