"""llama.cpp beside Strata on the GPU, for `benchmarks.gpu_bench`: its two tools on the same file
with every layer on the GPU and flash attention on, their output parsed, and the ratios.

`llama-bench` gives pp and tg of one sequence, `llama-batched-bench` many
parallel sequences; `tools.llama_build` builds both for the H200.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from strata.bench.peers import parse_llama_bench


def llama_bench_gpu(binary: str, model: str, prompt_tokens: int = 512, gen_tokens: int = 128,
                    reps: int = 3, timeout: float = 900, extra: list[str] | None = None) -> dict[str, Any]:
    """llama-bench pp`prompt_tokens` and tg`gen_tokens` with all layers on the GPU (-ngl 99, -fa on);
    `extra`: more of its arguments (`--n-cpu-moe N` keeps N layers' experts on the CPU)."""
    cmd = [binary, "-m", model, "-p", str(prompt_tokens), "-n", str(gen_tokens), "-ngl", "99",
           "-fa", "on", "-r", str(reps), "-o", "json", *(extra or [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    return {"tool": "llama-bench", "command": " ".join(cmd), "prompt_tokens": prompt_tokens,
            "gen_tokens": gen_tokens, **parse_llama_bench(done.stdout)}


def parse_batched_bench(output: str) -> list[dict[str, float]]:
    """Rows of llama-batched-bench output (`--output-format jsonl`, or its markdown table).

    Each row: pp, tg, pl (parallel sequences), prompt_tokens_per_s (all
    sequences' prompts together) and decode_tokens_per_s (all sequences'
    generated tokens together).
    """
    rows: list[dict[str, float]] = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            r = json.loads(line)
            rows.append({"pp": int(r["pp"]), "tg": int(r["tg"]), "pl": int(r["pl"]),
                         "prompt_tokens_per_s": float(r["speed_pp"]),
                         "decode_tokens_per_s": float(r["speed_tg"])})
        elif line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 10 and cells[0].isdigit():  # PP TG B N_KV T_PP S_PP T_TG S_TG T S
                rows.append({"pp": int(cells[0]), "tg": int(cells[1]), "pl": int(cells[2]),
                             "prompt_tokens_per_s": float(cells[5]),
                             "decode_tokens_per_s": float(cells[7])})
    if not rows:
        raise ValueError("no llama-batched-bench result rows in its output")
    return rows


def llama_batched_bench_gpu(binary: str, model: str, lanes: list[int], prompt_tokens: int = 512,
                            gen_tokens: int = 128, timeout: float = 900,
                            extra: list[str] | None = None) -> dict[str, Any]:
    """llama-batched-bench: `lanes` parallel sequences, each its own prompt, all on the GPU."""
    ctx = max(lanes) * (prompt_tokens + gen_tokens)
    cmd = [binary, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_tokens), "-ntg", str(gen_tokens),
           "-npl", ",".join(str(n) for n in lanes), "-ngl", "99", "-fa", "on",
           "--output-format", "jsonl", *(extra or [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    return {"tool": "llama-batched-bench", "command": " ".join(cmd),
            "rows": parse_batched_bench(done.stdout)}


def llama_peer(model: str, bench: str | None, batched: str | None, lanes: list[int],
               prompt_tokens: int, gen_tokens: int, extra: list[str] | None = None) -> dict[str, Any]:
    """llama.cpp's llama-bench and llama-batched-bench on `model` (each when given)."""
    out: dict[str, Any] = {}
    if bench:
        out["llama_bench"] = llama_bench_gpu(bench, model, prompt_tokens, gen_tokens, extra=extra)
    if batched:
        out["llama_batched_bench"] = llama_batched_bench_gpu(batched, model, lanes, prompt_tokens,
                                                             gen_tokens, extra=extra)
    return out


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """Strata / llama.cpp for every figure both measured (above 1: Strata is faster)."""
    r: dict[str, float] = {}
    peer = out.get("llama_cpp", {})
    runs = out.get("decode_graphs")
    if not isinstance(runs, list):  # no graphs (an expert cache): the eager decode
        runs = out.get("decode", [])
    strata_decode = {d["lanes"]: d["decode_tokens_per_s"] for d in runs if isinstance(d, dict) and "lanes" in d}
    strata_prompt = {p["prompt_tokens"]: p["prompt_tokens_per_s"] for p in out.get("prompt", [])
                     if isinstance(p, dict) and "prompt_tokens" in p}
    lb = peer.get("llama_bench", {})
    if "decode_tokens_per_s" in lb and 1 in strata_decode:
        r["decode_1_lane_vs_llama_bench_tg"] = strata_decode[1] / lb["decode_tokens_per_s"]
    if "prompt_tokens_per_s" in lb and lb.get("prompt_tokens") in strata_prompt:
        r[f"prompt_{lb['prompt_tokens']}_vs_llama_bench_pp"] = (
            strata_prompt[lb["prompt_tokens"]] / lb["prompt_tokens_per_s"])
    for row in peer.get("llama_batched_bench", {}).get("rows", []):
        if row["pl"] in strata_decode:
            r[f"decode_{row['pl']}_lanes_vs_batched_bench"] = (
                strata_decode[row["pl"]] / row["decode_tokens_per_s"])
    return r
