"""Tokenizers from Hugging Face folders: tokenizer.json and its companion files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from strata.errors import ModelLoadError
from strata.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! It's 2024.",
    "def f(x):\n    return x  # done\n",
    "<|im_start|>user\nhi 👋 中文<|im_end|>\n",
    "   spaces   and\ttabs\n\n",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def smol_folder(hf_smol: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smol-folder")
    hf_smol.save_pretrained(out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_folder_matches_gguf_and_transformers(
    smol_folder: Path, smol: Tokenizer, hf_smol: Any
) -> None:
    tok = Tokenizer.from_folder(smol_folder)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == smol.encode(text) == hf_smol.encode(text, add_special_tokens=False)
        with_bos = tok.encode(text, add_special_tokens=True)
        assert with_bos == hf_smol.encode(text, add_special_tokens=True)
        assert tok.decode(ids) == smol.decode(ids)
        assert [tok.token_text(i) for i in ids] == [smol.token_text(i) for i in ids]
    assert (tok.bos_token_id, tok.eos_token_id) == (smol.bos_token_id, smol.eos_token_id)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.vocab_size == smol.vocab_size
    assert tok.chat_template == smol.chat_template
    assert tok.stop_token_ids == smol.stop_token_ids
    assert tok.apply_chat_template(MESSAGES) == hf_smol.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )


def test_config_variants(smol_folder: Path, tmp_path: Path) -> None:
    """Special tokens as AddedToken dicts, the template inside the config or in
    chat_template.json, and extra end ids from generation_config.json."""
    folder = _copy(smol_folder, tmp_path / "variant")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|im_start|>", "special": True}
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    config["chat_template"] = [
        {"name": "default", "template": template},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 7]}))

    tok = Tokenizer.from_folder(folder)
    assert (tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (1, "<|endoftext|>", 0)
    assert tok.stop_token_ids == {0, 2, 7}
    assert tok.chat_template == template
    assert tok.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == "T1"

    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert Tokenizer.from_folder(folder).chat_template == "J"
    (folder / "chat_template.jinja").write_text("K")
    assert Tokenizer.from_folder(folder).chat_template == "K"


def test_eos_only_in_generation_config(smol_folder: Path, tmp_path: Path) -> None:
    folder = _copy(smol_folder, tmp_path / "no-eos")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = Tokenizer.from_folder(folder)
    assert (tok.eos_token_id, tok.eos_token) == (2, "<|im_end|>")


def test_spm_folder_matches_transformers(hf_spm: Any, spm: Tokenizer, tmp_path: Path) -> None:
    hf_spm.save_pretrained(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    for text in ["Hello world", "emoji 😀 here", "two  spaces"]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf_spm.encode(text, add_special_tokens=True)
        assert ids == spm.encode(text, add_special_tokens=True)
        assert tok.decode(ids) == text
        assert [tok.token_bytes(i) for i in ids] == [spm.token_bytes(i) for i in ids]
    assert tok.add_bos_token and tok.bos_token == "<s>"


def test_bad_folders(tmp_path: Path, smol_folder: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json: cannot be read"):
        Tokenizer.from_folder(tmp_path)
    broken = _copy(smol_folder, tmp_path / "broken-config")
    (broken / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json: is not valid JSON"):
        Tokenizer.from_folder(broken)
