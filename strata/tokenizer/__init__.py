"""Tokenizers from GGUF metadata or Hugging Face folders, chat templates, streaming text."""

from strata.tokenizer.chat_template import render_chat_template
from strata.tokenizer.detokenizer import IncrementalDetokenizer
from strata.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "render_chat_template"]
