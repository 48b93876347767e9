"""A small SentencePiece-style ("llama") vocabulary written as a GGUF file.

Trained in milliseconds with `tokenizers`, then laid out the way llama
GGUF files are: <unk> <s> </s>, 256 byte tokens, control and user-defined
tokens, then the learned pieces with scores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from strata.gguf.reader import open_reader, read_metadata
from tests.gguf_writer import add_fields, finish

SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "Tokenizers split text into pieces; the pieces become ids.",
    "Numbers like 42 and 1999 appear in text too.",
    "def main():\n    return 0\n",
    "Café naïve résumé, the end.",
]
SPM_CONTROL = ["<|user|>", "<|assistant|>"]
SPM_USER_DEFINED = ["<think>"]
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class SpmVocab:
    """A llama-type vocabulary as GGUF fields, and the GGUF file written from them."""

    metadata: dict[str, Any]
    path: Path

    @property
    def tokens(self) -> list[str]:
        return self.metadata["tokenizer.ggml.tokens"]

    @property
    def scores(self) -> list[float]:
        return self.metadata["tokenizer.ggml.scores"]

    @property
    def types(self) -> list[int]:
        return self.metadata["tokenizer.ggml.token_type"]


def _train_pieces() -> tuple[list[str], dict[str, int]]:
    """Pieces learned by BPE over ▁-marked words, and the merge rank that made each."""
    trainer_model = Backend(models.BPE(unk_token="<unk>"))
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always"
    )
    trainer = trainers.BpeTrainer(vocab_size=220, special_tokens=["<unk>"], show_progress=False)
    trainer_model.train_from_iterator(SPM_CORPUS * 4, trainer)
    model = json.loads(trainer_model.to_str())["model"]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t != "<unk>"]
    ranks = {"".join(m): i for i, m in enumerate(model["merges"])}
    return pieces, ranks


def build_spm_vocab(folder: Path) -> SpmVocab:
    """<unk> <s> </s>, 256 byte tokens, control and user-defined tokens, then learned pieces.

    A piece's score is minus the rank of the merge that made it (single characters
    score lowest), which is how SentencePiece BPE models rank their pieces.
    """
    pieces, ranks = _train_pieces()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += SPM_CONTROL + SPM_USER_DEFINED
    types += [3] * len(SPM_CONTROL) + [4] * len(SPM_USER_DEFINED)
    scores = [0.0] * len(tokens)
    tokens += pieces
    types += [1] * len(pieces)
    scores += [-float(ranks[p]) if p in ranks else -1e6 for p in pieces]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": SPM_TEMPLATE,
    }
    path = folder / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")  # metadata only: enough for any tokenizer loader
    add_fields(writer, fields)
    finish(writer)
    metadata = read_metadata(path, open_reader(path))
    return SpmVocab(metadata, path)
