"""Every benchmark's output: JSON on stdout, and the same text in a file when asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: Any, out: str | None, indent: int = 2) -> None:
    text = json.dumps(result, indent=indent)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
