"""The server's sampling defaults: what every API's requests take for unset fields, and /props says."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from starlette.testclient import TestClient

from strata.cli import build_parser, request_params
from strata.engine.sampling_defaults import SamplingDefaults, defaults_from_args
from strata.models.generation_defaults import ModelSampling
from strata.serve import build_app

USER = [{"role": "user", "content": "hi"}]
TUNED = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# One request per route with no sampling field at all.
BARE = [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hi"}),
        ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 8}), ("/completion", {"prompt": "hi"})]


def _fields(p: Any) -> tuple:
    return tuple(getattr(p, f) for f in FIELDS)


@pytest.fixture
def tuned() -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine()
    with TestClient(build_app(engine, sampling=TUNED)) as client:
        yield client, engine


@pytest.mark.parametrize("path, body", BARE)
def test_every_route_takes_the_servers_defaults(tuned, path: str, body: dict[str, Any]) -> None:
    client, engine = tuned
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert _fields(engine.calls[-1][1]) == (0.6, 0.95, 20, 0.05, 1.1)


def test_request_fields_override_the_defaults(tuned) -> None:
    client, engine = tuned
    client.post("/v1/chat/completions", json={"messages": USER, "temperature": 0.2, "top_k": 0})
    assert _fields(engine.calls[-1][1]) == (0.2, 0.95, 0, 0.05, 1.1)  # top_k 0: off, as asked
    client.post("/v1/messages", json={"model": "m", "messages": USER, "max_tokens": 8, "top_p": 0.5})
    assert _fields(engine.calls[-1][1]) == (0.6, 0.5, 20, 0.05, 1.1)
    client.post("/completion", json={"prompt": "hi", "temperature": 0, "repeat_penalty": 1.0})
    assert engine.calls[-1][1].greedy and engine.calls[-1][1].repetition_penalty == 1.0


def test_props_show_the_defaults(tuned) -> None:
    client, _ = tuned
    params = client.get("/props").json()["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"],
            params["repeat_penalty"]) == (0.6, 0.95, 20, 0.05, 1.1)
    with TestClient(build_app(FakeEngine())) as plain:  # the negative control: Strata's base
        base = plain.get("/props").json()["default_generation_settings"]["params"]
    assert (base["temperature"], base["top_k"], base["repeat_penalty"]) == (1.0, 0, 1.0)


def test_a_cli_prompt_and_a_bare_server_request_are_sampled_alike() -> None:
    """The same model recommendation and flags: `strata generate` and a request with no sampling
    fields to `strata serve` get the same settings."""
    model = ModelSampling(temperature=0.7, top_k=40, source="GGUF metadata")
    flags = ["--min-p", "0.1"]
    cli_args = build_parser().parse_args(["generate", *flags, "hi"])
    serve_args = build_parser().parse_args(["serve", *flags])
    engine = FakeEngine()
    with TestClient(build_app(engine, sampling=defaults_from_args(serve_args, model))) as client:
        client.post("/v1/chat/completions", json={"messages": USER})
    cli = request_params(cli_args, defaults_from_args(cli_args, model))
    assert _fields(engine.calls[-1][1]) == _fields(cli) == (0.7, 1.0, 40, 0.1, 1.0)
