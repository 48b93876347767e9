"""Sampling defaults: Strata's base, the model's recommendation, flags, then the request; one
resolution for `strata generate`, `strata chat` and `strata serve`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.cli import build_parser, request_params
from strata.engine.sampling_defaults import SamplingDefaults, defaults_from_args, resolve_defaults
from strata.engine.types import SamplingParams
from strata.models.generation_defaults import ModelSampling

MODEL = ModelSampling(temperature=0.6, top_p=0.95, top_k=20, source="generation_config.json")
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _fields(p: SamplingParams) -> tuple:
    return tuple(getattr(p, f) for f in FIELDS)


def test_base_is_the_apis_defaults_and_the_model_goes_over_it() -> None:
    base = resolve_defaults(ModelSampling())
    assert base == SamplingDefaults() and (base.temperature, base.top_p, base.top_k) == (1.0, 1.0, 0)
    d = resolve_defaults(MODEL)
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.6, 0.95, 20, 0.0)
    assert dict(d.origins) == {"temperature": "model", "top_p": "model", "top_k": "model"}


def test_flags_override_the_model_and_requests_override_both() -> None:
    d = resolve_defaults(MODEL, {"temperature": 0.2, "min_p": 0.05, "top_p": None})
    assert (d.temperature, d.top_p, d.min_p) == (0.2, 0.95, 0.05)  # None: the flag was not given
    assert dict(d.origins)["temperature"] == "--temp" and dict(d.origins)["top_p"] == "model"
    p = d.params(max_tokens=8, temperature=0.9, top_k=-1, seed=3, stop=None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == (0.9, 0.95, 0, 0.05, 3, [])
    untouched = d.params(max_tokens=8)
    assert (untouched.temperature, untouched.top_k) == (0.2, 20)  # the negative control
    assert "temperature 0.2 (--temp)" in d.describe() and "top_k 20 (model)" in d.describe()


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_the_cli_and_the_server_resolve_alike() -> None:
    flags = ["--model", "m.gguf", "--temp", "0.3", "--top-k", "5"]
    cli = _args("generate", *flags, "hello")
    serve = _args("serve", *flags)
    assert defaults_from_args(cli, MODEL) == defaults_from_args(serve, MODEL)
    from_cli = request_params(cli, defaults_from_args(cli, MODEL))
    from_server = defaults_from_args(serve, MODEL).params(max_tokens=from_cli.max_tokens)  # no request fields
    assert _fields(from_cli) == _fields(from_server) == (0.3, 0.95, 5, 0.0, 1.0, 0.0, 0.0)
    chat = _args("chat", "--model", "m.gguf", "--temp", "0.4")
    assert _fields(request_params(chat, defaults_from_args(chat, MODEL)))[:3] == (0.4, 0.95, 20)


def test_generation_config_vllm_ignores_the_model_and_a_folder_replaces_it(tmp_path: Path) -> None:
    assert defaults_from_args(_args("serve", "--generation-config", "vllm"), MODEL) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.1, "top_k": 3}))
    other = defaults_from_args(_args("serve", "--generation-config", str(tmp_path)), MODEL)
    assert (other.temperature, other.top_k, other.top_p) == (0.1, 3, 1.0)
    assert defaults_from_args(_args("serve"), MODEL).temperature == 0.6  # auto, the default


@pytest.mark.parametrize("argv, words", [
    (["--temp", "-1"], "at least 0"),
    (["--temp", "warm"], "a number"),
    (["--top-p", "1.5"], "from 0 to 1"),
    (["--top-k", "-3"], "0: off"),
    (["--min-p", "nan"], "a number"),
    (["--repeat-penalty", "0"], "above 0"),
    (["--presence-penalty", "3"], "from -2 to 2"),
    (["--generation-config", "nowhere"], "choose from auto, vllm or a folder"),
])
def test_bad_sampling_flags_end_parsing_in_one_line(argv: list[str], words: str, capsys) -> None:
    for command in (["serve"], ["generate", "x"]):
        with pytest.raises(SystemExit) as e:
            _args(*command, *argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert words in err[-1] and argv[0] in err[-1]
