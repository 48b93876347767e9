"""llama-server's routes and fields: /completion, /tokenize, /detokenize, /apply-template, /props, /version,
the OpenAI routes without /v1, and `timings` everywhere llama-server sends it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from fake_engine import BOS, EOS, OFFSET, FakeEngine
from starlette.testclient import TestClient

from strata.errors import KvPoolFull
from strata.serve import build_app

TIMINGS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n"}
GREEDY = {"temperature": 0}


def ids(text: str) -> list[int]:
    return [ord(c) + OFFSET for c in text]


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/completion", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", "/completion", json={**GREEDY, **body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[6:]) for line in lines]


def test_completion_answer_fields(http: httpx.Client, engine: FakeEngine) -> None:
    out = complete(http, prompt="hi", return_tokens=True)
    assert out["content"] == "You said: hi."
    assert out["stop"] is True and out["stop_type"] == "eos" and out["stopping_word"] == ""
    assert out["tokens_predicted"] == len("You said: hi.") + 1  # the text plus EOS
    assert out["tokens_evaluated"] == 3  # BOS, h, i
    assert out["tokens"] == ids("You said: hi.") + [EOS]
    assert out["truncated"] is False and out["model"] == "fake-model" and out["id_slot"] == 0  # the lane used
    assert out["prompt"] == "<s>hi"
    t = out["timings"]
    assert set(t) == TIMINGS
    assert t["predicted_n"] == out["tokens_predicted"] and t["prompt_n"] + t["cache_n"] == 3
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] >= 0
    assert out["generation_settings"]["temperature"] == 0 and out["generation_settings"]["n_predict"] == -1
    assert engine.calls[-1][0] == [BOS] + ids("hi")
    assert complete(http, prompt="hi")["tokens"] == []  # ids only when asked for


def test_n_predict_limit_and_whole_context(http: httpx.Client, engine: FakeEngine) -> None:
    out = complete(http, prompt="hi", n_predict=4)
    assert out["content"] == "You " and out["stop_type"] == "limit" and out["tokens_predicted"] == 4
    assert engine.calls[-1][1].max_tokens == 4
    complete(http, prompt="hi", n_predict=-1)
    assert engine.calls[-1][1].max_tokens == 256 - 3  # until the context is full
    complete(http, prompt="hi", n_predict=100_000)  # past the context: stops when it is full
    assert engine.calls[-1][1].max_tokens == 256 - 3


def test_stop_word_and_sampling_fields(http: httpx.Client, engine: FakeEngine) -> None:
    out = complete(http, prompt="hi", stop=["said"])
    assert out["content"] == "You " and out["stop_type"] == "word" and out["stopping_word"] == "said"
    complete(http, prompt="hi", temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repeat_penalty=1.1,
             repeat_last_n=-1, seed=42, ignore_eos=True, cache_prompt=False, id_slot=-1, n_keep=4, mirostat=0)
    p = engine.calls[-1][1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed, p.ignore_eos) == (
        0.7, 5, 0.9, 0.1, 1.1, 42, True)
    complete(http, prompt="hi", seed=-1, temperature=-1)  # llama.cpp: random seed, greedy
    assert engine.calls[-1][1].seed is None and engine.calls[-1][1].greedy


def test_token_id_and_mixed_prompts(http: httpx.Client, engine: FakeEngine) -> None:
    whole = complete(http, prompt="hi")["content"]
    assert complete(http, prompt=[BOS, *ids("hi")])["content"] == whole
    assert engine.calls[-1][0] == [BOS] + ids("hi")
    complete(http, prompt=["h", *ids("i")])  # a string first: BOS added
    assert engine.calls[-1][0] == [BOS] + ids("hi")
    complete(http, prompt=[*ids("h"), "i"])  # ids first: taken as they are
    assert engine.calls[-1][0] == ids("hi")
    complete(http, prompt=["hi"])
    assert engine.calls[-1][0] == [BOS] + ids("hi")


def test_stream_lines_end_with_stop_true(http: httpx.Client) -> None:
    whole = complete(http, prompt="hi", stop=["hi."])
    chunks = stream(http, prompt="hi", stop=["hi."], return_tokens=True)
    *parts, last = chunks
    assert parts and all(c["stop"] is False for c in parts)
    assert "".join(c["content"] for c in parts) == whole["content"] == "You said: "
    assert [t for c in parts for t in c["tokens"]] == ids("You said: hi.")  # the stop string's too
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "word"
    assert last["stopping_word"] == "hi." and set(last["timings"]) == TIMINGS
    assert last["tokens_predicted"] == whole["tokens_predicted"]
    eos = stream(http, prompt="hi", return_tokens=True)
    assert eos[-1]["stop_type"] == "eos" and "".join(c["content"] for c in eos) == "You said: hi."
    assert [t for c in eos for t in c["tokens"]] == ids("You said: hi.") + [EOS]
    limit = stream(http, prompt="hi", n_predict=3)
    assert limit[-1]["stop_type"] == "limit" and "".join(c["content"] for c in limit) == "You"


def test_refusals_and_failures(http: httpx.Client, engine: FakeEngine) -> None:
    engine.refuse = KvPoolFull("KV pool full", retry_after=3)
    r = http.post("/completion", json={"prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "3" and r.json()["error"]["code"] == "kv_pool_full"
    engine.refuse = None
    engine.fail_after = 3
    with http.stream("POST", "/completion", json={"prompt": "hi", "stream": True, **GREEDY}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and "error" in json.loads(lines[-1][6:])  # the headers were out already
    assert not any(json.loads(line[6:]).get("stop") for line in lines)


def test_n_probs(http: httpx.Client) -> None:
    out = complete(http, prompt="hi", n_probs=2, n_predict=3)
    probs = out["completion_probabilities"]
    assert [p["token"] for p in probs] == ["Y", "o", "u"]
    first = probs[0]
    assert first["id"] == ord("Y") + OFFSET and first["bytes"] == [ord("Y")] and first["logprob"] == -0.25
    assert [t["token"] for t in first["top_logprobs"]] == ["Y", "?"]
    assert set(first["top_logprobs"][1]) == {"id", "token", "bytes", "logprob"}
    chunks = stream(http, prompt="hi", n_probs=1, n_predict=3)
    streamed = [p for c in chunks for p in c.get("completion_probabilities", [])]
    assert [p["token"] for p in streamed] == ["Y", "o", "u"]
    assert all(len(p["top_logprobs"]) == 1 for p in streamed)
    assert "completion_probabilities" not in complete(http, prompt="hi")


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "id_slot": 2}, "id_slot"),  # the fake engine has lanes 0 and 1
    ({"prompt": "hi", "id_slot": -2}, "id_slot"),
    ({"prompt": "hi", "n_predict": -2}, "n_predict"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n_probs": 99}, "n_probs"),
    ({"prompt": "hi", "stop": "x"}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ({"prompt": "hi", "samplers": ["mirostat"]}, "samplers"),
    ({"prompt": "hi", "samplers": "kq"}, "samplers"),
    ({"prompt": "hi", "samplers": 3}, "samplers"),
    ({"prompt": "hi", "mirostat": 2}, "mirostat"),
    ({"prompt": "hi", "grammar": "root ::= \"a\""}, "grammar"),
    ({"prompt": "hi", "post_sampling_probs": True}, "post_sampling_probs"),
    ({"prompt": "hi", "repeat_penalty": 1.2, "repeat_last_n": 64}, "repeat_last_n"),
    ({"prompt": "x" * 300}, "prompt"),  # longer than the context
])
def test_bad_completion_fields_are_4xx_naming_them(http: httpx.Client, body: dict[str, Any], field: str) -> None:
    r = http.post("/completion", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_openai_routes_without_v1(server: Any, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=20)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert chat.choices[0].message.content == "You said: hi."
    assert set(chat.model_extra["timings"]) == TIMINGS
    assert chat.model_extra["timings"]["predicted_n"] == chat.usage.completion_tokens
    text = client.completions.create(model="m", prompt="hi", max_tokens=4, **GREEDY)
    assert text.choices[0].text == "You " and text.model_extra["timings"]["predicted_n"] == 4
    assert [m.id for m in client.models.list()] == ["fake-model"]
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, **GREEDY))
    timed = [c for c in chunks if c.model_extra.get("timings")]
    assert len(timed) == 1 and timed[0] is chunks[-1] and chunks[-1].choices[0].finish_reason == "stop"
    assert timed[0].model_extra["timings"]["predicted_n"] == chat.usage.completion_tokens
    cmpl = list(client.completions.create(model="m", prompt="hi", max_tokens=4, stream=True, **GREEDY))
    assert cmpl[-1].model_extra["timings"]["predicted_n"] == 4
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **GREEDY})
    assert set(r.json()["timings"]) == TIMINGS  # the /v1 routes carry them too


def test_tokenize_and_detokenize(http: httpx.Client) -> None:
    assert http.post("/tokenize", json={"content": "hi"}).json() == {"tokens": ids("hi")}
    assert http.post("/tokenize", json={"content": "hi", "add_special": True}).json() == {"tokens": [BOS] + ids("hi")}
    pieces = http.post("/tokenize", json={"content": "h€", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": ord("h") + OFFSET, "piece": "h"}, {"id": ord("€") + OFFSET, "piece": [0xE2]}]
    assert http.post("/detokenize", json={"tokens": ids("hi")}).json() == {"content": "hi"}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"content": ""}
    for path, body, field in [("/tokenize", {}, "content"), ("/tokenize", {"content": 3}, "content"),
                              ("/tokenize", {"content": "a", "parse_special": False}, "parse_special"),
                              ("/tokenize", {"content": "a", "extra": 1}, "extra"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
                              ("/detokenize", {"tokens": 5}, "tokens")]:
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)


def test_props_and_version(http: httpx.Client) -> None:
    props = http.get("/props").json()
    assert props["total_slots"] == 2 and props["chat_template"] == "fake"
    assert props["model_alias"] == "fake-model" and props["build_info"].startswith("strata ")
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 256 and settings["params"]["n_predict"] == -1
    assert {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "stop"} <= set(settings["params"])
    version = http.get("/version").json()
    assert version["version"] and version["build_info"] == props["build_info"]


def test_llama_routes_ask_for_the_key() -> None:
    app = build_app(FakeEngine(), api_key="k")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(app) as c:
        for method, path, payload in [("POST", "/completion", {"prompt": "hi", "n_predict": 2}),
                                      ("POST", "/chat/completions", body),
                                      ("POST", "/completions", {"prompt": "hi", "max_tokens": 2}),
                                      ("GET", "/models", None), ("GET", "/props", None),
                                      ("POST", "/tokenize", {"content": "hi"}),
                                      ("POST", "/detokenize", {"tokens": [11]}), ("GET", "/version", None),
                                      ("POST", "/apply-template", {"messages": body["messages"]})]:
            assert c.request(method, path, json=payload).status_code == 401, path
            ok = c.request(method, path, json=payload, headers={"authorization": "Bearer k"})
            assert ok.status_code == 200, (path, ok.text)


def test_apply_template_gives_the_prompt_the_chat_route_would_read(http: httpx.Client, engine: FakeEngine) -> None:
    """llama-server's {messages} -> {prompt}: template applied, generation prompt added."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = http.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"}
    chat = http.post("/chat/completions", json={"messages": messages, **GREEDY})
    assert engine.calls[-1][0] == ids(r.json()["prompt"])  # the very prompt a chat request is shown
    assert chat.status_code == 200
    assert http.post("/apply-template", json={"messages": messages, "add_generation_prompt": False}).json() == {
        "prompt": "<|system|>Be brief.\n<|user|>hi\n"}
    thinking = http.post("/apply-template", json={"messages": messages,
                                                   "chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.json()["prompt"].endswith("<|assistant|><think>")
    n_calls = len(engine.calls)
    for body, param in (({}, "messages"), ({"messages": []}, "messages"),
                        ({"messages": [{"role": "user", "content": "BREAK THE TEMPLATE"}]}, "messages"),
                        ({"messages": messages, "bogus": 1}, "bogus")):
        bad = http.post("/apply-template", json=body)
        assert bad.status_code == 400, (body, bad.text)
        assert bad.json()["error"]["param"] == param, bad.text
    assert len(engine.calls) == n_calls  # nothing generated
