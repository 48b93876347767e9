"""Real `strata serve` processes on the real engine: a tiny random GGUF and the default model.

Few tests, each doing several things, because every server costs a model
load. The three servers start together at the beginning so their loads
overlap; each test waits only for the one it uses.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from serve_process import GREEDY, ServeProcess
from tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Iterator[dict[str, ServeProcess]]:
    tmp = tmp_path_factory.mktemp("serve-real")
    tiny = str(write_tiny_gguf(default_gguf, tmp / "tiny.gguf"))
    procs = {
        "tiny": ServeProcess("tiny", ["--model", tiny, "--parallel", "2", "--max-context", "512"], tmp),
        # 3 chunks of 64 cells for 4 lanes: the 4th admission finds the pool full, lanes stop growing at 64.
        "small_pool": ServeProcess("small_pool", ["--model", tiny, "--parallel", "4", "--max-context", "512",
                                                  "--kv-pool-tokens", "192", "--kv-chunk", "64"], tmp),
        "smol": ServeProcess("smol", ["--parallel", "2", "--max-context", "1024"], tmp),
    }
    yield procs
    for proc in procs.values():  # all at once: their shutdowns overlap
        proc.terminate()
    for name, proc in procs.items():
        log = proc.stop()
        assert proc.proc.returncode == 0, f"{name} did not shut down cleanly:\n{log[-3000:]}"
        assert "engine closed" in log, log[-3000:]


def _chat(client: openai.OpenAI, content: str, max_tokens: int, **kw) -> openai.types.chat.ChatCompletion:  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, **{**GREEDY, **kw})


def test_tiny_model_through_the_sdks(servers: dict[str, ServeProcess]) -> None:
    srv = servers["tiny"].wait_ready()
    client = srv.oai()
    whole = _chat(client, "hello there", 8)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # the same prompt again: the lane's cached conversation is reused
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    # a second turn re-reads only what the lane does not already hold
    turn2 = client.chat.completions.create(model="tiny", max_tokens=4, **GREEDY, messages=[
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": whole.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ])
    assert turn2.usage.prompt_tokens > whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert turn2.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
    counted = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello there"}])
    assert counted.input_tokens == whole.usage.prompt_tokens
    with claude.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hello there"}],
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == whole.choices[0].message.content and final.stop_reason == "max_tokens"
    lp = _chat(client, "hello there", 4, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(lp) == 4 and all(len(t.top_logprobs) == 2 for t in lp)
    assert all(t.top_logprobs[0].token == t.token and t.logprob <= 0 for t in lp)  # greedy picks the top one
    seeded = [_chat(client, "hello", 6, seed=11, temperature=1.0).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_more_streams_than_lanes_each_equals_the_request_alone(servers: dict[str, ServeProcess]) -> None:
    srv = servers["tiny"].wait_ready()
    prompts = [f"Tell me about topic number {i}" for i in range(5)]

    def streamed(prompt: str) -> str:
        chunks = srv.oai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=10, stream=True, **GREEDY)
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(streamed, prompts))
    alone = [_chat(srv.oai(), p, 10).choices[0].message.content for p in prompts]
    assert together == alone
    m = srv.metrics()
    assert m["strata_engine_lanes_busy"] == 0 and m["strata_engine_queue_length"] == 0
    assert m["strata_requests_in_flight"] == 1  # only this /metrics request


def test_client_disconnect_frees_the_lane(servers: dict[str, ServeProcess]) -> None:
    srv = servers["tiny"].wait_ready()
    before = srv.metrics()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "stream": True, **GREEDY}
    with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
    deadline = time.monotonic() + 20
    while srv.metrics()["strata_engine_lanes_busy"] != 0:
        assert time.monotonic() < deadline, "the lane was not freed"
        time.sleep(0.05)
    after = srv.metrics()
    assert after["strata_client_disconnects_total"] == before.get("strata_client_disconnects_total", 0) + 1
    assert after["strata_generated_tokens_total"] - before["strata_generated_tokens_total"] < 400


def test_small_pool_refuses_with_retry_after_and_truncates(servers: dict[str, ServeProcess]) -> None:
    srv = servers["small_pool"].wait_ready()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, **GREEDY}

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(post, range(6)))
    refused = [r for r in answers if r.status_code == 503]
    served = [r for r in answers if r.status_code == 200]
    assert len(refused) + len(served) == 6 and refused and served
    for r in refused:
        assert r.json()["error"]["code"] == "kv_pool_full" and int(r.headers["retry-after"]) >= 1
    choices = [r.json()["choices"][0] for r in served]
    assert any(c.get("truncated") is True and c["finish_reason"] == "length" for c in choices)
    assert httpx.get(f"{srv.url}/health").status_code == 200
    m = srv.metrics()
    assert m["strata_engine_lanes_busy"] == 0
    assert m["strata_engine_refusals_total"] == len(refused) and m["strata_engine_truncations_total"] >= 1


def test_default_model_knows_paris(servers: dict[str, ServeProcess]) -> None:
    srv = servers["smol"].wait_ready()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=300)
    with claude.messages.stream(model="smol", max_tokens=10, messages=question, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
    assert "Paris" in text
    whole = srv.oai().chat.completions.create(model="smol", messages=question, max_tokens=10, **GREEDY)
    assert whole.choices[0].message.content == text
    bare = httpx.post(f"{srv.url}/chat/completions", timeout=300,
                      json={"messages": question, "max_tokens": 10, **GREEDY}).json()  # llama-server's path
    assert bare["choices"][0]["message"]["content"] == text and bare["timings"]["predicted_n"] > 0


def test_llama_server_routes_on_the_real_engine(servers: dict[str, ServeProcess]) -> None:
    """/completion answers what /v1/completions does, from text or ids, whole or streamed."""
    srv = servers["tiny"].wait_ready()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        prompt = "Once upon a time"
        oai = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, **GREEDY}).json()
        whole = c.post("/completion", json={"prompt": prompt, "n_predict": 8, "return_tokens": True,
                                            "n_probs": 2, **GREEDY}).json()
        assert whole["content"] == oai["choices"][0]["text"] and whole["stop_type"] == "limit"
        assert whole["tokens_predicted"] == 8 and len(whole["tokens"]) == 8
        assert whole["timings"]["predicted_n"] == 8 and oai["timings"]["predicted_n"] == 8
        probs = whole["completion_probabilities"]
        assert [p["id"] for p in probs] == whole["tokens"]  # greedy: the chosen token is the top one
        assert all(p["top_logprobs"][0]["id"] == p["id"] and len(p["top_logprobs"]) == 2 for p in probs)
        tokens = c.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
        assert whole["tokens_evaluated"] == len(tokens)
        by_ids = c.post("/completion", json={"prompt": tokens, "n_predict": 8, **GREEDY}).json()
        assert by_ids["content"] == whole["content"]
        assert by_ids["timings"]["cache_n"] > 0  # the same prompt again: its K/V is reused
        assert c.post("/detokenize", json={"tokens": whole["tokens"]}).json()["content"] == whole["content"]
        with c.stream("POST", "/completion", json={"prompt": prompt, "n_predict": 8, "stream": True,
                                                    **GREEDY}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert "".join(ch["content"] for ch in chunks) == whole["content"]
        assert chunks[-1]["stop"] is True and not any(ch["stop"] for ch in chunks[:-1])
        props = c.get("/props").json()
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512
        assert props["model_path"].endswith("tiny.gguf")
