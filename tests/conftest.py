"""Shared fixtures: the embedded default model and a tiny random model with its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from strata.default_model import default_model_path

# The long fuzz run: `pytest tests/serve/test_serve_fuzz.py --hypothesis-profile=fuzz-long`
# (docs/RELIABILITY.md). Registered here so the option finds it before collection.
settings.register_profile("fuzz-long", max_examples=20_000, deadline=None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-tokenizer", default=None, metavar="GGUF",
                     help="GPU tests: a GGUF holding the default model's tokenizer, where the embedded "
                          "model is not installed (`python -m tools.synth OUT --tokenizer-only` writes one)")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Path:
    """A 2-layer random llama in Hugging Face format, with the default model's tokenizer.

    The real tokenizer (49,152 tokens) keeps text and chat templates realistic;
    the random weights keep every forward cheap.
    """
    from transformers import AutoTokenizer

    from tests.tiny_llama import write_tiny_llama

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(out)
    return write_tiny_llama(out, len(tok), tok.bos_token_id, tok.eos_token_id)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path):
    """The tiny model loaded once (dense bfloat16 on the CPU), shared by engine tests."""
    from strata.models import load_model

    return load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", progress=False)
