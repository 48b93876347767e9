"""llama-server's and vLLM's flag spellings, and bad values refused while parsing.

Parse only: no model loads. Each alias must land on the same EngineConfig (or
serve setting) as Strata's own spelling, and each bad value must end argparse
with exit 2 and one line naming what would be right, not a traceback after a load.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import strata
from strata.cli import build_parser, main
from strata.engine.config import CACHE_TYPE_PAIRS, EngineConfig, check_gpu_layers, config_from_args
from strata.errors import BadRequest


def config_of(*argv: str, command: str = "serve") -> EngineConfig:
    return config_from_args(build_parser().parse_args([command, *argv]))


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one error line argparse printed for `strata ARGV`, after checking the exit."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(list(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("alias, own", [
    (["--ctx-size", "8192"], ["--max-context", "8192"]),
    (["-c", "8192"], ["--max-context", "8192"]),
    (["--max-model-len", "8192"], ["--max-context", "8192"]),
    (["-np", "4"], ["--parallel", "4"]),
    (["--max-num-seqs", "4"], ["--parallel", "4"]),
    (["-t", "3"], ["--threads", "3"]),
    (["-s", "7"], ["--seed", "7"]),
    (["--slot-save-path", "/tmp/s"], ["--session-dir", "/tmp/s"]),
    (["-ctk", "f16", "-ctv", "f16"], ["--kv", "fp16"]),
    (["-ctk", "f16"], ["--kv", "fp16"]),  # llama-server's default for the half not given
    (["--cache-type-k", "bf16", "--cache-type-v", "bf16"], ["--kv", "bf16"]),
    (["-ctk", "f32", "-ctv", "f32"], ["--kv", "fp32"]),
    (["-ctk", "q8_0", "-ctv", "q8_0"], ["--kv", "int8"]),
    (["-ctk", "q4_0", "-ctv", "q4_0"], ["--kv", "q4_0"]),
    (["-ctk", "q8_0", "-ctv", "q4_0"], ["--kv", "k8v4"]),
    (["-ctk", "q8_0", "-ctv", "q4_0", "--kv", "k8v4"], ["--kv", "k8v4"]),  # agreeing is fine
    (["-ngl", "0"], ["--device", "cpu"]),
    (["--jinja"], []),
])
@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench"])
def test_alias_is_strata_own_flag(alias: list[str], own: list[str], command: str) -> None:
    extra = ["prompt"] if command == "generate" else []
    got, want = config_of(*alias, *extra, command=command), config_of(*own, *extra, command=command)
    assert replace(got, gpu_layers=None) == want  # -ngl 0 also stays on record as gpu_layers=0


def test_every_pair_named_maps_to_its_format() -> None:
    for (k, v), kv in CACHE_TYPE_PAIRS.items():
        assert config_of("-ctk", k, "-ctv", v).kv == kv


def test_all_gpu_layers_keep_the_device_as_asked() -> None:
    for value in ("99", "all", "-1"):
        config = config_of("-ngl", value)
        assert config.device == "auto" and config.gpu_layers == (-1 if value != "99" else 99)
        check_gpu_layers(config, 30)  # every layer on the device: accepted


def test_part_of_the_layers_on_the_gpu_is_refused_in_one_line() -> None:
    with pytest.raises(BadRequest, match=r"-ngl 12: the model has 30 layers"):
        check_gpu_layers(config_of("-ngl", "12"), 30)


@pytest.mark.parametrize("argv, words", [
    (["--kv", "q8_0"], ["--kv", "int8, q4_0, k8v4", "-ctk q8_0 -ctv q8_0"]),
    (["--kv", "nonsense"], ["--kv", "auto, fp32, fp16"]),
    (["-ctk", "q5_0"], ["-ctk", "'q8_0'", "'q4_0'"]),
    (["-ctv", "iq4_nl"], ["-ctv", "'f16'"]),
    (["-ctk", "q8_0"], ["q8_0", "f16", "q8_0/q4_0 (--kv k8v4)", "q8_0/q8_0 (--kv int8)"]),
    (["-ctk", "q4_0", "-ctv", "q8_0"], ["pairs that exist", "f16/f16 (--kv fp16)"]),
    (["-ctk", "q8_0", "-ctv", "q4_0", "--kv", "fp16"], ["contradicts", "k8v4"]),
    (["--device", "gpu"], ["--device", "auto, cpu, cuda, cuda:N"]),
    (["--dtype", "half"], ["--dtype", "'bfloat16'"]),
    (["--weights", "q4"], ["--weights", "'int4'"]),
    (["--pipeline", "maybe"], ["--pipeline", "'auto'"]),
    (["--experts-on", "disk"], ["--experts-on", "'host'"]),
    (["--expert-policy", "fifo"], ["--expert-policy", "'lru'"]),
    (["--expert-cache", "lots"], ["--expert-cache", "auto"]),
    (["--expert-uploads", "some"], ["--expert-uploads", "must be a count"]),
    (["--threads", "many"], ["--threads"]),
    (["-ngl", "most"], ["-ngl", "all"]),
    (["-ngl", "0", "--device", "cuda"], ["-ngl 0", "cuda"]),
    (["-ngl", "99", "--device", "cpu"], ["-ngl 99", "cpu"]),
    (["--gpus", "cpu,gpu1"], ["--gpus", "gpu1"]),
    (["--chat-template", "chatml2"], ["--chat-template", "chatml2", "one of the names", "llama3", "mistral-v7"]),
    (["--log-level", "loud"], ["--log-level", "'debug'"]),
    (["--spec", "lots"], ["--spec", "auto, off or a count"]),
    (["--spec-min-p", "1.5"], ["--spec-min-p", "from 0 to 1"]),
    (["--suffix-draft", "2"], ["--suffix-draft", "0, 1"]),
    (["--mtp"], ["--mtp", "give --spec N"]),
    (["--mtp", "--spec", "4", "--kv-resident", "64"], ["--mtp with --kv-resident"]),
    (["--mtp", "--spec", "4", "--gpus", "cpu,cpu"], ["--mtp with a layer split"]),
])
def test_bad_value_fails_while_parsing_in_one_line(capsys, argv: list[str], words: list[str]) -> None:
    line = usage_error(capsys, "serve", *argv)
    assert line.startswith("strata serve: error:"), line
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("argv, spec", [([], 0), (["--spec", "auto"], 8), (["--spec", "off"], 0),
                                        (["--spec", "6"], 6)])
def test_spec_values(argv: list[str], spec: int) -> None:
    assert config_of(*argv).spec == spec


def test_mtp_is_off_unless_asked() -> None:
    assert not config_of("--spec", "4").mtp and config_of("--spec", "4", "--mtp").mtp


def test_prompt_graphs_are_off_unless_asked() -> None:
    assert not config_of().prompt_graphs and config_of("--prompt-graphs").prompt_graphs


def test_bad_value_is_refused_by_main_before_any_load(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--kv", "q8_0", "hello"])
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_chat_template_file_is_read_at_parse_time(tmp_path) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "chatml.jinja"
    path.write_text(template)
    assert config_of("--chat-template", str(path)).chat_template == template
    assert config_of("--chat-template-file", str(path)).chat_template == template
    assert config_of("--chat-template", template).chat_template == template  # vLLM's inline form
    assert config_of().chat_template is None


def test_chat_template_by_name_is_llama_servers(tmp_path, monkeypatch) -> None:
    from strata.tokenizer.named_templates import named_template

    monkeypatch.chdir(tmp_path)
    assert config_of("--chat-template", "chatml").chat_template == named_template("chatml")
    assert config_of("--chat-template", "llama3").chat_template == named_template("llama3")
    (tmp_path / "chatml").write_text("{{ messages[0]['content'] }}")  # a file of that name wins
    assert config_of("--chat-template", "chatml").chat_template == "{{ messages[0]['content'] }}"


def test_chat_template_that_does_not_compile_fails_while_parsing(tmp_path, capsys) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}unclosed")
    assert "does not compile" in usage_error(capsys, "serve", "--chat-template", str(path))


def test_chat_template_replaces_the_models_own(tiny_loaded, tmp_path) -> None:
    from strata.engine.engine import Engine

    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    config = config_from_args(build_parser().parse_args(
        ["generate", "--device", "cpu", "--max-context", "64", "--chat-template", str(path), "x"]))
    engine = Engine(config, loaded=tiny_loaded)
    try:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert text == "[user] hi\n"
        assert tiny_loaded.tokenizer.chat_template != engine.tokenizer.chat_template  # not shared
    finally:
        engine.close()


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"]])
def test_version_prints_strata_version_and_exits_0(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"strata {strata.__version__}"


@pytest.mark.parametrize("flag", ["--alias", "-a", "--served-model-name"])
def test_alias_names_the_served_model(flag: str) -> None:
    args = build_parser().parse_args(["serve", flag, "my-model"])
    assert args.served_model_name == "my-model"
    assert build_parser().parse_args(["serve"]).served_model_name is None
