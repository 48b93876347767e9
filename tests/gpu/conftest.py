"""Fixtures of the GPU tests: where the default model's tokenizer comes from."""

from __future__ import annotations

import pytest

from strata.default_model import default_model_path
from strata.errors import ModelLoadError


@pytest.fixture(scope="session")
def gpu_tokenizer(request: pytest.FixtureRequest) -> str:
    """A GGUF with the default model's tokenizer: `--gpu-tokenizer`, else the embedded model.

    The device machine has no embedded model (its package is larger than a call carries), so
    the tokenizer travels as a small file; without either the tests cannot build their models
    and fail saying so.
    """
    path = request.config.getoption("--gpu-tokenizer")
    if path:
        return str(path)
    try:
        return str(default_model_path())
    except ModelLoadError as e:
        pytest.fail(f"no tokenizer for the GPU tests ({e}): pass --gpu-tokenizer GGUF")
