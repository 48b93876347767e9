"""llama-server's template names (`--chat-template chatml`, ...): each of Strata's Jinja
versions gives the text llama.cpp's own `llama_chat_apply_template` gave for the same messages
(recorded in data/llama_named_templates.json by `tools/llama_templates.py` from libllama.so of
llama-cpp-python 0.3.36's vendored llama.cpp), and BOS where the model's tokenizer adds one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.tokenizer.chat_template import render_chat_template
from strata.tokenizer.named_templates import NAMED, named_template

RECORD = json.loads((Path(__file__).parent / "data" / "llama_named_templates.json").read_text(encoding="utf-8"))
CONVERSATIONS = RECORD["conversations"]


def _render(name: str, conv: dict, add_bos_token: bool = False) -> str:
    template = named_template(name)
    assert template is not None
    return render_chat_template(template, conv["messages"], add_generation_prompt=conv["add_generation_prompt"],
                                bos_token="<s>", eos_token="</s>", add_bos_token=add_bos_token)


def test_every_name_was_recorded() -> None:
    assert sorted(RECORD["texts"]) == sorted(NAMED)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_the_text_is_llama_cpps(name: str) -> None:
    for conv, want in zip(CONVERSATIONS, RECORD["texts"][name]):
        assert _render(name, conv) == want, conv["messages"]


def test_a_wrong_text_is_seen() -> None:
    """The negative control: the same comparison tells two names' texts apart."""
    conv = CONVERSATIONS[0]
    assert _render("chatml", conv) != RECORD["texts"]["phi4"][0]
    assert _render("mistral-v3", CONVERSATIONS[1]) != RECORD["texts"]["mistral-v3-tekken"][1]


def test_bos_where_the_tokenizer_adds_it() -> None:
    conv = CONVERSATIONS[2]
    assert _render("llama3", conv, add_bos_token=True) == "<s>" + RECORD["texts"]["llama3"][2]
    assert _render("chatml", conv, add_bos_token=False) == RECORD["texts"]["chatml"][2]


def test_unknown_names_are_none() -> None:
    assert named_template("no-such-template") is None


def test_the_tokenizer_writes_bos_as_the_model_adds_it(smol_metadata) -> None:
    """Through a model's tokenizer: BOS in front where its metadata says it adds one (as
    llama-server's tokenization of the text would), none where it does not."""
    from strata.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Hello"}]
    want = RECORD["texts"]["chatml"][2]
    for add_bos in (False, True):
        tok = Tokenizer.from_gguf_metadata({**smol_metadata, "tokenizer.ggml.add_bos_token": add_bos}, "m")
        tok.use_chat_template(named_template("chatml"))
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert text == (tok.bos_token if add_bos else "") + want
