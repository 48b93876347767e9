"""The chat template fixtures (see templates/README.md for where each comes from)."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")
