"""llama.cpp as the GPU benchmark's peer (benchmarks/llama_peer.py, tools/llama_build.py): parsing
its tools' output, the ratios, the build.

Pure Python (no GPU, no Triton): runs everywhere. The sample outputs in
data/ were captured from this llama.cpp version's CPU build on the default
model. `STRATA_LLAMA_BENCH` / `STRATA_LLAMA_BATCHED_BENCH` naming built
binaries also runs them (tiny sizes) on the default model.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from benchmarks.llama_peer import (
    llama_batched_bench_gpu,
    llama_bench_gpu,
    parse_batched_bench,
    ratios,
)
from strata.bench.peers import parse_llama_bench
from tools.llama_build import CMAKE_OPTIONS, TARGETS, build_command, make_bundle

DATA = Path(__file__).parent / "data"


def test_llama_bench_json_gives_pp_and_tg() -> None:
    got = parse_llama_bench((DATA / "llama_bench.json").read_text())
    assert got["prompt_tokens_per_s"] == pytest.approx(141.514833)
    assert got["decode_tokens_per_s"] > 0 and got["decode_tokens_per_s"] != got["prompt_tokens_per_s"]


@pytest.mark.parametrize("name", ["batched_bench.jsonl", "batched_bench.md"])
def test_batched_bench_rows_from_jsonl_and_markdown(name: str) -> None:
    text = (DATA / name).read_text()
    rows = parse_batched_bench("llama_batched_bench: n_kv_max = 512 | noise\n" + text)
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(16, 4, 1), (16, 4, 2)]
    assert all(r["decode_tokens_per_s"] > 0 and r["prompt_tokens_per_s"] > 0 for r in rows)
    if name.endswith(".md"):
        assert rows[1]["decode_tokens_per_s"] == pytest.approx(74.86)
        assert rows[0]["prompt_tokens_per_s"] == pytest.approx(140.71)


def test_batched_bench_without_rows_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_batched_bench("main: error: failed to load model\n")


def test_ratios_pair_each_strata_figure_with_its_peer() -> None:
    out = {
        "decode_graphs": [{"lanes": 1, "decode_tokens_per_s": 200.0},
                          {"lanes": 16, "decode_tokens_per_s": 2400.0},
                          {"lanes": 64, "decode_tokens_per_s": 6000.0}],
        "prompt": [{"prompt_tokens": 512, "prompt_tokens_per_s": 30000.0},
                   {"prompt_tokens": 8192, "prompt_tokens_per_s": 25000.0}],
        "llama_cpp": {
            "llama_bench": {"prompt_tokens": 512, "prompt_tokens_per_s": 25000.0,
                            "decode_tokens_per_s": 250.0},
            "llama_batched_bench": {"rows": [
                {"pp": 512, "tg": 128, "pl": 16, "decode_tokens_per_s": 2000.0,
                 "prompt_tokens_per_s": 27000.0},
                {"pp": 512, "tg": 128, "pl": 64, "decode_tokens_per_s": 6000.0,
                 "prompt_tokens_per_s": 28000.0}]},
        },
    }
    r = ratios(out)
    assert r == {"decode_1_lane_vs_llama_bench_tg": pytest.approx(0.8),
                 "prompt_512_vs_llama_bench_pp": pytest.approx(1.2),
                 "decode_16_lanes_vs_batched_bench": pytest.approx(1.2),
                 "decode_64_lanes_vs_batched_bench": pytest.approx(1.0)}
    assert ratios({"decode_graphs": [{"error": "x"}]}) == {}


def test_build_command_configures_one_architecture_and_two_targets() -> None:
    cmd = build_command(".lcpp/llama-src.tar.gz", ".lcpp", jobs=16)
    assert "-DCMAKE_CUDA_ARCHITECTURES=90 " in cmd and "-DGGML_CUDA=ON" in cmd
    assert "-DLLAMA_CURL=OFF" in cmd and "-j 16" in cmd
    assert cmd.rstrip().endswith("--target llama-bench llama-batched-bench; fi")
    assert CMAKE_OPTIONS["GGML_CUDA_FA_ALL_QUANTS"] == "OFF" and TARGETS == ("llama-bench",
                                                                             "llama-batched-bench")


VENDORED = os.environ.get("STRATA_LLAMA_SRC", "")


@pytest.mark.skipif(not VENDORED, reason="STRATA_LLAMA_SRC names no vendored llama.cpp tree")
def test_bundle_holds_the_two_tools_and_the_cuda_backend_only(tmp_path: Path) -> None:
    out = tmp_path / "src.tar.gz"
    assert make_bundle(Path(VENDORED), out) < 20e6
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        tools = tar.extractfile("llama.cpp/tools/CMakeLists.txt").read().decode()  # type: ignore[union-attr]
    assert "llama.cpp/tools/llama-bench/llama-bench.cpp" in names
    assert "llama.cpp/tools/batched-bench/batched-bench.cpp" in names
    assert "llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt" in names
    assert not any("/ggml-vulkan/" in n or "/tools/server/" in n for n in names)
    assert "add_subdirectory(llama-bench)" in tools and "server" not in tools


def _default_model() -> str:
    from strata.default_model import default_model_path

    return str(default_model_path())


@pytest.mark.skipif(not os.environ.get("STRATA_LLAMA_BENCH"), reason="no llama-bench binary named")
def test_llama_bench_runs_on_the_default_model() -> None:
    got = llama_bench_gpu(os.environ["STRATA_LLAMA_BENCH"], _default_model(), 16, 4, reps=1)
    assert got["prompt_tokens_per_s"] > 0 and got["decode_tokens_per_s"] > 0
    assert "-ngl 99" in got["command"]


@pytest.mark.skipif(not os.environ.get("STRATA_LLAMA_BATCHED_BENCH"),
                    reason="no llama-batched-bench binary named")
def test_llama_batched_bench_runs_on_the_default_model() -> None:
    got = llama_batched_bench_gpu(os.environ["STRATA_LLAMA_BATCHED_BENCH"], _default_model(), [1, 2],
                                  16, 4)
    assert [r["pl"] for r in got["rows"]] == [1, 2]
