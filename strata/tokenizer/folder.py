"""Reading a Hugging Face model folder's tokenizer files.

The folder spreads one tokenizer over several files: tokenizer.json (the
`tokenizers` pipeline, including whether BOS is added), tokenizer_config.json
(special token strings, the chat template), chat_template.jinja or
chat_template.json (newer homes of the template), special_tokens_map.json
(older home of the special tokens) and generation_config.json (the ids that
end generation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from strata.errors import ModelLoadError

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass
class FolderTokenizer:
    """What a folder says, before it becomes a `Tokenizer`."""

    backend: Backend
    special_tokens: dict[str, str]  # "bos_token" -> "<s>", ...
    chat_templates: dict[str, str]
    generation_eos_ids: list[int] = field(default_factory=list)


def read_folder(path: Path) -> FolderTokenizer:
    """The tokenizer files of `path`; ModelLoadError when tokenizer.json is missing or bad."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(str(path), "no tokenizer.json in the model folder")
    try:
        backend = Backend.from_file(str(tokenizer_file))
    except Exception as exc:  # the library reports JSON and schema problems alike
        raise ModelLoadError(str(tokenizer_file), f"cannot be read: {exc}") from None

    config = _json(path / "tokenizer_config.json")
    legacy_map = _json(path / "special_tokens_map.json")
    special = {}
    for name in SPECIAL_NAMES:
        value = _token_string(config.get(name)) or _token_string(legacy_map.get(name))
        if value is not None:
            special[name] = value

    generation = _json(path / "generation_config.json")
    eos_ids = generation.get("eos_token_id")
    if isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    eos_ids = [int(i) for i in eos_ids] if isinstance(eos_ids, list) else []
    return FolderTokenizer(backend, special, _chat_templates(path, config), eos_ids)


def _json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(str(file), f"is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(str(file), "should hold a JSON object")
    return data


def _token_string(value: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates ("default" serves requests without tools); files win over the config."""
    templates: dict[str, str] = {}
    in_config = config.get("chat_template")
    if isinstance(in_config, str):
        templates["default"] = in_config
    elif isinstance(in_config, list):
        for entry in in_config:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]

    legacy = _json(path / "chat_template.json").get("chat_template")
    if isinstance(legacy, str):
        templates["default"] = legacy
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    return templates
