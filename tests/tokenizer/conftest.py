"""Tokenizers under test and their transformers oracles, built once per session.

Loading the default model's tokenizer through transformers takes seconds, so
every test module shares one instance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strata.default_model import default_model_path
from strata.gguf.reader import open_reader, read_metadata
from strata.tokenizer import Tokenizer
from tiny_spm import SpmVocab, build_spm_vocab


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smol_metadata(smol_path: Path) -> dict[str, Any]:
    """The default model's metadata as the engine's GGUF reader hands it over."""
    return read_metadata(smol_path, open_reader(smol_path))


@pytest.fixture(scope="session")
def smol(smol_metadata: dict[str, Any], smol_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_metadata, str(smol_path))


@pytest.fixture(scope="session")
def hf_smol(smol_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)


@pytest.fixture(scope="session")
def spm_vocab(tmp_path_factory: pytest.TempPathFactory) -> SpmVocab:
    return build_spm_vocab(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def spm(spm_vocab: SpmVocab) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_vocab.metadata, str(spm_vocab.path))


@pytest.fixture(scope="session")
def hf_spm(spm_vocab: SpmVocab) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(spm_vocab.path.parent), gguf_file=spm_vocab.path.name)
