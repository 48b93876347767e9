"""The tokenizer the engine and the server use, whatever file it came from.

One class over a `tokenizers` backend: GGUF metadata and Hugging Face folders
only differ in how the backend and the special tokens are found.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from strata.errors import BadRequest
from strata.tokenizer import byte_level
from strata.tokenizer.chat_template import render_chat_template
from strata.tokenizer.folder import read_folder
from strata.tokenizer.gguf_vocab import build_gguf_vocab

# Tokens that end an assistant turn in common chat formats; they stop generation
# when the vocabulary has them as added tokens.
# Special tokens that are part of an answer's text: the tool-call markers the server parses
# (Mistral's, Llama 3.1's, Hermes'). Every other special token decodes to nothing.
TEXT_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<tool_call>", "</tool_call>")

END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Text <-> ids, special tokens, stop ids and the chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        source: str,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str] | None = None,
        extra_stop_ids: Iterable[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        """`special_tokens` maps bos_token/eos_token/unk_token/pad_token to their text."""
        self.backend = backend
        self.source = source
        self._added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in self._added.items() if t.special)
        self._piece_kind = _piece_kind(backend)
        self.vocab_size = vocab_size if vocab_size is not None else _id_span(backend)

        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        extra = list(extra_stop_ids)
        if self.eos_token_id is None and extra:
            self.eos_token_id = extra[0]
            self.eos_token = backend.id_to_token(extra[0])

        stops = set(extra)
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        for text in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None and token_id in self._added:
                stops.add(token_id)
        self.stop_token_ids: set[int] = stops
        self.text_special_ids = frozenset(
            i for i in (backend.token_to_id(t) for t in TEXT_MARKERS) if i is not None and i in self._special_ids)

        self.chat_templates = dict(chat_templates or {})
        self.chat_template: str | None = self.chat_templates.get("default")
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(probe) and probe[0] == self.bos_token_id

    def use_chat_template(self, template: str) -> None:
        """Render every chat with `template` (--chat-template): the model's own, its tool_use
        variant included, no longer apply."""
        self.chat_templates = {"default": template}
        self.chat_template = template

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """From a GGUF's metadata (key -> plain Python value); `source` names the file in errors."""
        vocab = build_gguf_vocab(dict(metadata), source)
        names = {"bos": "bos_token", "eos": "eos_token", "unk": "unk_token", "pad": "pad_token"}
        special = {
            names[k]: vocab.tokens[i] for k, i in vocab.special_ids.items() if k in names
        }
        templates: dict[str, str] = {}
        if isinstance(metadata.get("tokenizer.chat_template"), str):
            templates["default"] = metadata["tokenizer.chat_template"]
        prefix = "tokenizer.chat_template."
        for key, value in metadata.items():
            if key.startswith(prefix) and isinstance(value, str):
                templates[key[len(prefix) :]] = value
        extra = [vocab.special_ids[k] for k in ("eot", "eom") if k in vocab.special_ids]
        return cls(
            vocab.backend,
            source=source,
            special_tokens=special,
            chat_templates=templates,
            extra_stop_ids=extra,
            vocab_size=len(vocab.tokens),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face folder (tokenizer.json and its companions)."""
        folder = read_folder(Path(path))
        return cls(
            folder.backend,
            source=str(path),
            special_tokens=folder.special_tokens,
            chat_templates=folder.chat_templates,
            extra_stop_ids=folder.generation_eos_ids,
        )

    # -- text and ids -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; special tokens written in it are matched whole.

        add_special_tokens adds BOS (and EOS) as the model asks; rendered chat
        templates already contain them, so they are encoded without.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary decode to nothing."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether decode(skip_special_tokens=True) leaves this id out."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (a byte token may be half a character)."""
        added = self._added.get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._piece_kind == "byte_level":
            return byte_level.unspell(piece)
        if self._piece_kind == "sentencepiece":
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs: its own spaces kept, broken bytes as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- chat ---------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers' apply_chat_template(tokenize=False).

        Encode the result with add_special_tokens=False: the template writes BOS itself.
        """
        template = self.chat_templates.get("tool_use") if tools else None
        template = template or self.chat_template
        if template is None:
            raise BadRequest(f"{self.source} has no chat template; send a plain prompt", "messages")
        # add_bos_token: a named template (`named_templates.py`) writes BOS where the model adds it
        variables = {"add_bos_token": self.add_bos_token, **self.special_tokens, **template_kwargs}
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **variables,
        )

    def _id_of(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _piece_kind(backend: Backend) -> str:
    """How a single token maps to bytes, read off the backend's decoder."""
    if backend.decoder is None:
        return "other"
    state = json.loads(backend.decoder.__getstate__())
    text = json.dumps(state)
    if '"ByteLevel"' in text:
        return "byte_level"
    if '"ByteFallback"' in text or '"Metaspace"' in text:
        return "sentencepiece"
    return "other"


def _id_span(backend: Backend) -> int:
    """One past the largest id, which is what the model's vocabulary rows must cover."""
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0
