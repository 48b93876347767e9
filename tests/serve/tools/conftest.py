"""The default model's tokenizer, loaded once for the template and grammar tests."""

from __future__ import annotations

import pytest

from strata.default_model import default_model_path
from strata.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smol() -> Tokenizer:
    from strata.gguf.reader import open_reader, read_metadata

    path = default_model_path()
    return Tokenizer.from_gguf_metadata(read_metadata(path, open_reader(path)), str(path))
