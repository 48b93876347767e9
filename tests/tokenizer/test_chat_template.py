"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from strata.errors import BadRequest
from strata.tokenizer import Tokenizer, render_chat_template
from strata.tokenizer.chat_template import compile_template

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? <b>bold</b> & 'quotes'"},
]
NO_SYSTEM = MULTI_TURN[1:]

# Exercises what real templates use: whitespace control against trim/lstrip_blocks,
# namespace, loop controls, tojson (unescaped, with indent), raise_exception,
# tools, template keyword arguments, bos/eos variables and None-valued fields.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0, last_user='') -%}
{% if tools %}
<tools>
{% for tool in tools %}
{{ tool | tojson(indent=2) }}
{% endfor %}
</tools>
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'user' %}{% set ns.last_user = message['content'] %}{% endif %}
<|{{ message['role'] }}|>
    {%- if message.reasoning_content is defined %}
<think>{{ message.reasoning_content }}</think>
    {%- endif %}
{{ message['content'] | trim }}
    {%- if message.tool_calls is defined %} calls={{ message.tool_calls | tojson }}{% endif %}
{{ eos_token }}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
{% endfor %}
turns={{ ns.turns }} last={{ ns.last_user | tojson }} meta={{ {'k': 'é<&>'} | tojson }}
{% if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <now>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("messages", [MULTI_TURN, NO_SYSTEM], ids=["system", "no-system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_model_template_matches_transformers(
    smol: Tokenizer, hf_smol: Any, messages: list[dict], add_generation_prompt: bool
) -> None:
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    assert smol.encode(ours) == hf_smol.encode(theirs, add_special_tokens=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "enable_thinking": False},
        {"tools": TOOLS},
    ],
)
def test_rich_template_matches_transformers(smol: Tokenizer, hf_smol: Any, kwargs: dict) -> None:
    messages = [
        *MULTI_TURN,
        {"role": "tool", "content": "skipped"},
        {
            "role": "assistant",
            "content": "  Rome  ",
            "reasoning_content": "Italy's capital",
            "tool_calls": [{"name": "f", "arguments": {"x": "<1>"}}],
        },
        {"role": "user", "content": "STOP"},
        {"role": "assistant", "content": "never shown"},
        {"role": "user", "content": None, "name": None},
    ]
    theirs = hf_smol.apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, tokenize=False, **kwargs
    )
    ours = render_chat_template(
        RICH_TEMPLATE, messages, bos_token=smol.bos_token, eos_token=smol.eos_token,
        unk_token="<|endoftext|>", pad_token="<|im_end|>", **kwargs,
    )
    assert ours == theirs
    assert "é<&>" in ours and "never shown" not in ours


def test_template_kwargs_reach_the_template(smol: Tokenizer) -> None:
    template = "{{ greeting }} {{ bos_token }}{% if add_generation_prompt %}!{% endif %}"
    tok = _with_template(smol, template)
    assert tok.apply_chat_template([], greeting="hi") == "hi <|im_start|>!"
    plain = tok.apply_chat_template([], add_generation_prompt=False, greeting="yo")
    assert plain == "yo <|im_start|>"
    assert tok.apply_chat_template([], greeting="x", bos_token="B") == "x B!"


def test_raise_exception_becomes_bad_request() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    )
    with pytest.raises(BadRequest) as err:
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    assert str(err.value) == "Conversation must start with user"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"


def test_template_errors_become_bad_request() -> None:
    with pytest.raises(BadRequest, match="does not compile"):
        render_chat_template("{% for %}", [])
    with pytest.raises(BadRequest):
        render_chat_template("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "a"}])
    with pytest.raises(BadRequest):  # the sandbox refuses attribute tricks
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(BadRequest):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])
    with pytest.raises(BadRequest):  # immutable: templates cannot modify the messages
        render_chat_template("{{ messages.append(1) }}", [])


def test_strftime_now_and_dict() -> None:
    out = render_chat_template("{{ strftime_now('%Y') }} {{ dict(a=1)['a'] }}", [])
    assert out == f"{datetime.now().year} 1"


def test_missing_template_is_a_bad_request(smol: Tokenizer) -> None:
    with pytest.raises(BadRequest, match="no chat template"):
        _with_template(smol, None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_tool_use_template_is_chosen_with_tools(smol: Tokenizer) -> None:
    tok = _with_template(smol, "plain")
    tok.chat_templates["tool_use"] = "tools={{ tools | length }}"
    assert tok.apply_chat_template([]) == "plain"
    assert tok.apply_chat_template([], tools=TOOLS) == "tools=1"


def test_templates_are_compiled_once() -> None:
    assert compile_template("{{ 1 }}") is compile_template("{{ 1 }}")


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    """A copy of `tok` with another default template (the shared fixture stays untouched)."""
    copy = Tokenizer(
        tok.backend,
        source=tok.source,
        special_tokens=tok.special_tokens,
        chat_templates={"default": template} if template is not None else {},
        vocab_size=tok.vocab_size,
    )
    return copy


GENERATION_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_the_generation_tag_renders_its_body_as_transformers_does(hf_smol: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    ours = render_chat_template(GENERATION_TEMPLATE, messages, add_generation_prompt=True)
    theirs = hf_smol.apply_chat_template(messages, chat_template=GENERATION_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    assert ours == theirs == "<|user|>Hi<|end|><|assistant|>Hello<|end|><|user|>Bye<|end|><|assistant|>"
    with pytest.raises(BadRequest, match="does not compile"):  # the block must be closed
        compile_template("{% generation %}{{ x }}")
