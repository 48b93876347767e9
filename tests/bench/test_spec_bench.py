"""`python -m benchmarks.spec_bench` on the tiny model: its runs carry the figures, speculation
keeps every answer, the regenerate's drafts hold, and bad flags stop at parse time."""

from __future__ import annotations

import json

import pytest

from benchmarks.spec_bench import (
    Models,
    Run,
    parser,
    resolve,
    runs_of,
    strata_runs,
    versus_llama,
    workload_runs,
)
from benchmarks.spec_replay import Record, Reply, compare, llama_figures
from benchmarks.spec_verify import regenerate, verify_costs
from benchmarks.spec_workloads import agent_conversations, open_conversations
from strata.engine.config import AUTO_SPEC, EngineConfig
from strata.engine.engine import Engine

A = str(AUTO_SPEC)
SMALL = ["--specs", f"off,{A},auto", "--multi-lane-specs", f"off,{A},auto", "--multi-lane-workloads", "agent,open",
         "--lanes", "1,2", "--max-tokens", "12", "--file-tokens", "80",
         "--conversations", "2", "--open", "2", "--sampled-specs", f"off,{A}", "--max-context", "512"]
FIGURES = {"tokens_per_s", "lane_decode_tokens_per_s", "generated_tokens", "wall_s", "speedup",
           "decode_speedup", "speculation", "steps"}


def test_every_run_has_its_figures_and_every_spec_run_the_same_answers(tiny_loaded) -> None:
    args = resolve(parser().parse_args(SMALL))
    rows = json.loads(json.dumps(strata_runs(Models(tiny_loaded, "tiny"), args)))  # what the script prints
    measured = [r for r in rows if "same_as" not in r]
    keys = {(r["workload"], r["temperature"], r["lanes"], r["spec"]) for r in measured}
    assert keys == {(w, 0.0, n, s) for w in ("agent", "open") for n in (1, 2) for s in ("off", A)} | {
        ("agent", 0.7, 1, "off"), ("agent", 0.7, 1, A)}
    for r in measured:
        assert FIGURES <= r.keys() and r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
        if r["spec"] == "off":
            assert r["speculation"] is None and r["speedup"] == 1.0 and r["proposers"] == ""
        else:
            assert r["identical"] is True and r["first_difference"] == {} and r["proposers"] == "suffix"
            assert {"acceptance_rate", "mean_accepted_length"} <= r["speculation"].keys()
    assert all(r["identical_to_first_lane_count"] for r in measured if r["lanes"] == 2 and r["spec"] == "off")
    assert [r["same_as"] for r in rows if "same_as" in r] == [A] * 4  # auto is AUTO_SPEC: run once, named


def test_a_draft_model_drafts_alone_and_after_the_suffix_proposer(tiny_loaded) -> None:
    """The tiny model drafting for itself: its greedy drafts hold, and the answers stay."""
    args = resolve(parser().parse_args([*SMALL, "--proposers", "draft_model,suffix+draft_model",
                                        "--spec-model", "tiny"]))
    rows = workload_runs(Models(tiny_loaded, "tiny", draft=tiny_loaded), args, "open", open_conversations(2),
                         1, [("4", 4)], 0.0)
    assert [r["proposers"] for r in rows] == ["", "draft_model", "suffix+draft_model"]
    for r in rows[1:]:
        assert r["identical"] is True
        assert r["speculation"]["draft_model_accepted_tokens"] > 0
        assert r["steps"] < rows[0]["steps"]


def test_the_regenerate_drafts_from_the_first_round_and_changes_nothing(tiny_loaded) -> None:
    convs = open_conversations(2)
    cfg = EngineConfig(device="cpu", parallel=2, max_context=512)
    with Engine(cfg, loaded=tiny_loaded) as engine:
        plain = regenerate(engine, convs, 2, 24)
    with Engine(EngineConfig(device="cpu", parallel=2, max_context=512, spec=4), loaded=tiny_loaded) as engine:
        drafted = regenerate(engine, convs, 2, 24)
    assert drafted["outputs"] == plain["outputs"] and drafted["same_as_first_round"]
    spec = drafted["speculation"]
    assert spec["accepted_tokens"] > 0 and spec["acceptance_rate"] > 0.5  # random weights copy nothing else
    assert plain["speculation"]["drafted_tokens"] == 0


def test_verify_cost_rows_cover_every_draft_count_and_lane_count(tiny_loaded) -> None:
    with Engine(EngineConfig(device="cpu", parallel=2, max_context=256), loaded=tiny_loaded) as engine:
        rows = verify_costs(engine, [1, 2], [0, 1, 3], position=32, reps=2)
    assert [(r["lanes"], r["drafts"], r["rows"]) for r in rows] == [
        (1, 0, 1), (1, 1, 2), (1, 3, 4), (2, 0, 2), (2, 1, 4), (2, 3, 8)]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in rows)  # no graphs on the CPU
    assert [r["eager_vs_one_row"] for r in rows if r["drafts"] == 0] == [1.0, 1.0]
    assert [r["speedup_if_all_accepted"] for r in rows if r["drafts"] == 0] == [1.0, 1.0]


def test_compare_finds_the_first_differing_token() -> None:
    same = compare({"a/0": [1, 2, 3]}, {"a/0": [1, 2, 3], "b/0": [4]})
    assert same == {"identical": True, "compared": 1, "first_difference": {}}
    other = compare({"a/0": [1, 2, 9], "b/0": [4]}, {"a/0": [1, 2, 3], "b/0": [4, 5]})
    assert not other["identical"] and other["first_difference"] == {"a/0": 2, "b/0": 1}
    assert not compare({}, {"a/0": [1]})["identical"]  # nothing compared proves nothing


def test_agent_files_are_about_the_size_asked_and_deterministic() -> None:
    count = lambda text: len(text.split())  # noqa: E731 - any counter: words here
    convs = agent_conversations(6, count, 200)
    assert len({c.name for c in convs}) == 6
    assert convs == agent_conversations(6, count, 200)
    for c in convs:
        assert 100 <= count(c.turns[0]) <= 260, c.name  # the file plus the instruction
        assert len(c.turns) == 1 or "repeat" in c.turns[1].lower()


def test_llama_figures_sum_its_timings() -> None:
    def rec(n: int, ms: float, drafted: int, accepted: int) -> Record:
        timings = {"predicted_n": n, "predicted_ms": ms, "draft_n": drafted, "draft_n_accepted": accepted,
                   "cache_n": 3}
        return Record("c", 0, 10, Reply([1] * n, 0.0, 0.1, 1.0, timings))

    figures = llama_figures([rec(100, 1000.0, 40, 30), rec(50, 1000.0, 10, 0)])
    assert figures == {"predicted_per_second": 75.0, "drafted_tokens": 50, "accepted_tokens": 30,
                       "acceptance_rate": 0.6, "cached_prompt_tokens": 6}


def test_versus_llama_takes_each_side_without_and_at_its_fastest() -> None:
    strata = [{"workload": "agent", "lanes": 1, "temperature": 0.0, "spec": s, "drafts": n, "tokens_per_s": t}
              for s, n, t in (("off", 0, 50.0), ("4", 4, 150.0))]
    llama = [{"workload": "agent", "lanes": 1, "spec_type": s, "tokens_per_s": t}
             for s, t in (("none", 100.0), ("ngram-mod", 120.0))]
    assert versus_llama(strata, llama) == [{"workload": "agent", "lanes": 1, "without_speculation": 0.5,
                                            "fastest": 1.25, "fastest_strata": "4",
                                            "fastest_llama": "ngram-mod"}]


def test_runs_go_off_first_each_count_once_with_each_proposer_set() -> None:
    runs, same = runs_of([("2", 2), ("auto", AUTO_SPEC), (str(AUTO_SPEC), AUTO_SPEC)], ["suffix", "draft_model"])
    assert runs == [Run("off", 0), Run("2", 2, "suffix"), Run("2", 2, "draft_model"),
                    Run("auto", AUTO_SPEC, "suffix"), Run("auto", AUTO_SPEC, "draft_model")]
    assert same == {str(AUTO_SPEC): "auto"}


@pytest.mark.parametrize("flags,named", [(["--specs", "off,fast"], "auto, off"),
                                         (["--llama-spec", "none,eagle"], "ngram-simple"),
                                         (["--lanes", "1,zero"], "positive counts"),
                                         (["--multi-lane-workloads", "chat"], "agent, open"),
                                         (["--proposers", "mtp"], "suffix, draft_model")])
def test_bad_flags_stop_at_parse_time_naming_the_choices(flags, named, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parser().parse_args(flags)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_a_draft_model_and_its_proposer_go_together(capsys) -> None:
    for flags in (["--proposers", "draft_model"], ["--spec-model", "d.gguf"]):
        with pytest.raises(SystemExit):
            resolve(parser().parse_args(flags))
        assert "--spec-model and a draft_model" in capsys.readouterr().err


def test_quick_fills_only_what_was_not_given() -> None:
    args = resolve(parser().parse_args(["--quick", "--max-tokens", "33"]))
    assert args.max_tokens == 33 and args.lanes == [1, 4] and [s for s, _ in args.specs] == ["off", "auto"]
    full = resolve(parser().parse_args([]))
    assert full.lanes == [1, 16] and full.max_tokens == 256
