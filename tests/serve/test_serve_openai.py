"""The OpenAI endpoints driven by the official `openai` SDK over a real socket."""

from __future__ import annotations

import json

import httpx
import openai
from fake_engine import FakeEngine

USER = [{"role": "user", "content": "hi"}]


def test_chat_non_streaming_answer_and_usage(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="anything", messages=USER, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "You said: hi."
    assert choice.finish_reason == "stop"
    assert r.model == "fake-model"
    assert r.object == "chat.completion"
    prompt = "<|user|>hi\n<|assistant|>"
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len("You said: hi.") + 1  # the text plus EOS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_equals_non_stream_and_reports_usage(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model="m", messages=USER, temperature=0)
    chunks = list(oai.chat.completions.create(
        model="m", messages=USER, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The second identical prompt is served from the engine's cached prefix.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(http: httpx.Client) -> None:
    body = {"model": "m", "messages": USER, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in p for p in payloads)
    assert all(p["choices"] for p in payloads)


def test_roles_text_parts_and_developer(oai: openai.OpenAI, engine: FakeEngine) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "three"},
    ]
    r = oai.chat.completions.create(model="m", messages=messages, temperature=0)
    assert r.choices[0].message.content == "You said: three."
    sent = engine.tokenizer.template_calls[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "system", "user", "assistant", "user"]
    assert sent[2]["content"] == "one two"


def test_max_tokens_and_max_completion_tokens(oai: openai.OpenAI, engine: FakeEngine) -> None:
    r = oai.chat.completions.create(model="m", messages=USER, temperature=0, max_tokens=4)
    assert r.choices[0].message.content == "You "
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    r = oai.chat.completions.create(model="m", messages=USER, temperature=0, max_completion_tokens=2)
    assert r.choices[0].message.content == "Yo"
    assert engine.calls[-1][1].max_tokens == 2


def test_default_max_tokens_fills_the_context(oai: openai.OpenAI, engine: FakeEngine) -> None:
    oai.chat.completions.create(model="m", messages=USER, temperature=0)
    prompt_ids, params = engine.calls[-1]
    assert params.max_tokens == engine.config.max_context - len(prompt_ids)


def test_stop_strings_end_before_the_stop(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="m", messages=USER, temperature=0, stop=": h")
    assert r.choices[0].message.content == "You said"
    assert r.choices[0].finish_reason == "stop"
    chunks = oai.chat.completions.create(model="m", messages=USER, temperature=0, stop=["zz", "aid"],
                                         stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "You s"


def test_sampling_parameters_reach_the_engine(oai: openai.OpenAI, engine: FakeEngine) -> None:
    oai.chat.completions.create(
        model="m", messages=USER, temperature=0.7, top_p=0.9, seed=5, presence_penalty=0.5,
        frequency_penalty=-0.5, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    p = engine.calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 5)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logprobs is None


def test_default_temperature_is_the_apis_one(oai: openai.OpenAI, engine: FakeEngine) -> None:
    oai.chat.completions.create(model="m", messages=USER)
    assert engine.calls[-1][1].temperature == 1.0


def test_seeds_repeat_and_differ(oai: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        r = oai.chat.completions.create(model="m", messages=USER, temperature=1.0, seed=seed)
        return r.choices[0].message.content or ""

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_chat_logprobs(oai: openai.OpenAI, engine: FakeEngine) -> None:
    r = oai.chat.completions.create(model="m", messages=USER, temperature=0, max_tokens=3,
                                    logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["Y", "o", "u"]
    assert all(t.logprob == -0.25 and len(t.top_logprobs) == 2 for t in content)
    assert content[0].bytes == [ord("Y")]
    assert content[0].top_logprobs[1].token == "?"
    assert engine.calls[-1][1].logprobs == 2
    chunks = oai.chat.completions.create(model="m", messages=USER, temperature=0, max_tokens=3,
                                         logprobs=True, stream=True)
    streamed = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == ["Y", "o", "u"]


def test_truncated_lane_is_reported(oai: openai.OpenAI, engine: FakeEngine, http: httpx.Client) -> None:
    engine.truncate_after = 3
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["truncated"] is True
    assert choice["message"]["content"] == "You"
    chunks = list(oai.chat.completions.create(model="m", messages=USER, temperature=0, stream=True))
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.model_extra.get("truncated") is True


def test_reasoning_content_is_split_out(oai: openai.OpenAI, engine: FakeEngine) -> None:
    r = oai.chat.completions.create(model="m", messages=USER, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert engine.tokenizer.template_calls[-1]["kwargs"] == {"enable_thinking": True}
    msg = r.choices[0].message
    assert msg.content == "You said: hi."
    assert msg.model_extra["reasoning_content"] == "Thinking about hi."
    chunks = list(oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "MARKS THINKING"}], temperature=0, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == "I mark my own thoughts."
    assert content == "You said: MARKS THINKING."


def test_completions_plain_and_streaming(oai: openai.OpenAI, engine: FakeEngine) -> None:
    r = oai.completions.create(model="m", prompt="Once upon", temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == "You said: Once u"  # the API's default max_tokens is 16
    assert r.choices[0].finish_reason == "length"
    assert engine.calls[-1][0][0] == 1  # plain prompts get the model's BOS
    r = oai.completions.create(model="m", prompt="Once", temperature=0, max_tokens=50, stop=["."])
    assert r.choices[0].text == "You said: Once" and r.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model="m", prompt="Once", temperature=0, max_tokens=50, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "You said: Once."
    assert chunks[-1].usage.prompt_tokens == len("Once") + 1


def test_completions_token_prompt_and_logprobs(oai: openai.OpenAI, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("hey")
    r = oai.completions.create(model="m", prompt=ids, temperature=0, max_tokens=3, logprobs=1)
    assert engine.calls[-1][0] == ids
    lp = r.choices[0].logprobs
    assert lp.tokens == ["Y", "o", "u"] and lp.token_logprobs == [-0.25] * 3
    assert lp.text_offset == [0, 1, 2] and lp.top_logprobs[0] == {"Y": -0.25}


def test_models_list_and_retrieve(oai: openai.OpenAI) -> None:
    models = oai.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert oai.models.retrieve("fake-model").id == "fake-model"


def test_chat_names_its_message_ends_to_an_engine_that_checkpoints(oai: openai.OpenAI, engine: FakeEngine) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    oai.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    assert engine.calls[-1][1].cut_points == []  # a dense model's engine asks for none
    engine.wants_cut_points = True
    oai.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    ends = ["<|system|>Be brief.\n", "<|user|>Hi\n", "<|assistant|>Hello\n"]
    assert engine.calls[-1][1].cut_points == [len("".join(ends[:k])) for k in (1, 2, 3)]
