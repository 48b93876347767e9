"""The Anthropic endpoints driven by the official `anthropic` SDK over a real socket."""

from __future__ import annotations

import json

import anthropic
import httpx
from fake_engine import FakeEngine

USER = [{"role": "user", "content": "hi"}]
T0 = {"temperature": 0}  # greedy (this SDK has no sampling arguments of its own)


def _events(http: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """The raw SSE stream as (event name, data) pairs."""
    out: list[tuple[str, dict]] = []
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def test_message_non_streaming(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="m", max_tokens=100, messages=USER, extra_body=T0,
                               system="be kind")
    assert m.type == "message" and m.role == "assistant" and m.model == "fake-model"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == "You said: hi."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = "<|system|>be kind\n<|user|>hi\n<|assistant|>"
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(prompt)
    assert m.usage.output_tokens == len("You said: hi.") + 1


def test_system_blocks_and_content_blocks(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    m = claude.messages.create(
        model="m", max_tokens=100, extra_body=T0,
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
    )
    assert m.content[0].text == "You said: xy."
    sent = engine.tokenizer.template_calls[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "ab"}


def test_stream_event_order_exactly_as_anthropic(http: httpx.Client) -> None:
    events = _events(http, {"model": "m", "max_tokens": 100, "messages": USER, "temperature": 0})
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "You said: hi."
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(text) + 1


def test_sdk_stream_helper(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="m", max_tokens=100, messages=USER, extra_body=T0) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "You said: hi." == final.content[0].text
    assert final.stop_reason == "end_turn"


def test_stop_sequences_and_max_tokens(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="m", max_tokens=100, messages=USER, extra_body=T0,
                               stop_sequences=["zz", "aid"])
    assert m.content[0].text == "You s"
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "aid"
    m = claude.messages.create(model="m", max_tokens=3, messages=USER, extra_body=T0)
    assert m.content[0].text == "You" and m.stop_reason == "max_tokens"
    with claude.messages.stream(model="m", max_tokens=100, messages=USER, extra_body=T0,
                                stop_sequences=[": "]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "You said" and final.stop_sequence == ": "


def test_sampling_parameters_reach_the_engine(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    claude.messages.create(model="m", max_tokens=50, messages=USER, extra_body={"temperature": 0.3, "top_p": 0.8, "top_k": 7})
    p = engine.calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.8, 7, 50)


def test_thinking_param_and_thinking_blocks(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.config.max_context = 4096
    on = {"type": "enabled", "budget_tokens": 1024}
    m = claude.messages.create(model="m", max_tokens=2000, messages=USER, extra_body=T0, thinking=on)
    assert engine.tokenizer.template_calls[-1]["kwargs"] == {"enable_thinking": True}
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Thinking about hi." and m.content[1].text == "You said: hi."
    claude.messages.create(model="m", max_tokens=50, messages=USER, thinking={"type": "disabled"})
    assert engine.tokenizer.template_calls[-1]["kwargs"] == {"enable_thinking": False}
    with claude.messages.stream(model="m", max_tokens=2000, messages=USER, extra_body=T0,
                                thinking={"type": "adaptive"}) as stream:
        final = stream.get_final_message()
    assert engine.tokenizer.template_calls[-1]["kwargs"] == {"enable_thinking": True}
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Thinking about hi."
    assert final.content[1].text == "You said: hi."


def test_thinking_display_omitted(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    hidden = {"type": "adaptive", "display": "omitted"}
    m = claude.messages.create(model="m", max_tokens=200, messages=USER, extra_body=T0, thinking=hidden)
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [("thinking", ""), ("text", None)]
    events = _events(http, {"model": "m", "max_tokens": 200, "messages": USER, "thinking": hidden})
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert "thinking_delta" not in deltas and "text_delta" in deltas
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]


def test_thinking_budget_closes_the_block(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.config.max_context = 4096
    engine.reply = "x" * 1100 + "</think>never reached"
    m = claude.messages.create(model="m", max_tokens=1500, messages=USER, extra_body=T0,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    close = "\n</think>\n\n"
    assert m.content[0].type == "thinking" and m.content[0].thinking == "x" * 1024
    assert len(engine.calls) == 2 and engine.cancels  # the first run was cut at the budget
    first_prompt, _ = engine.calls[0]
    second_prompt, second_params = engine.calls[1]
    assert engine.tokenizer.decode(second_prompt[len(first_prompt):]) == "x" * 1024 + close
    rest = 1500 - 1024 - len(close)
    assert second_params.max_tokens == rest
    # The continuation is all answer; the whole output respects max_tokens.
    assert m.content[1].text == "x" * rest and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 1500


def test_previous_thinking_is_passed_to_the_template(claude: anthropic.Anthropic, engine: FakeEngine) -> None:
    claude.messages.create(model="m", max_tokens=20, messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ])
    assert engine.tokenizer.template_calls[-1]["messages"][1] == {
        "role": "assistant", "content": "b", "reasoning_content": "hmm"}


def test_truncated_message(http: httpx.Client, engine: FakeEngine) -> None:
    engine.truncate_after = 2
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": USER})
    assert r.json()["stop_reason"] == "max_tokens" and r.json()["truncated"] is True
    events = _events(http, {"model": "m", "max_tokens": 50, "messages": USER})
    delta = [d for n, d in events if n == "message_delta"][0]["delta"]
    assert delta["stop_reason"] == "max_tokens" and delta["truncated"] is True


def test_count_tokens(claude: anthropic.Anthropic) -> None:
    r = claude.messages.count_tokens(model="m", messages=USER, system="s")
    assert r.input_tokens == len("<|system|>s\n<|user|>hi\n<|assistant|>")


def test_messages_name_their_message_ends_to_an_engine_that_checkpoints(claude: anthropic.Anthropic,
                                                                         engine: FakeEngine) -> None:
    engine.wants_cut_points = True
    claude.messages.create(model="m", max_tokens=2, system="Be brief.",
                           messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                     {"role": "user", "content": "Bye"}])
    cuts = engine.calls[-1][1].cut_points
    assert cuts[0] == len("<|system|>Be brief.\n") and len(cuts) == 3
