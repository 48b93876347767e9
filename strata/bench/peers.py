"""llama.cpp beside Strata in one run: its own `llama-bench`, or llama-cpp-python.

`llama-bench` (built from llama.cpp's source) is the fair peer: C++ all the
way. llama-cpp-python drives llama.cpp from Python, one call a token, and
loses about half its decode speed to that; it is the fallback when no
llama-bench binary is given. On the GPU (`benchmarks.gpu_bench`) the peers
are `llama-bench` (pp and tg, one sequence) and `llama-batched-bench` (many
parallel sequences), both with every layer on the GPU and flash attention on.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any


def parse_llama_bench(output: str) -> dict[str, float]:
    """Prompt and decode tokens/s from `llama-bench -o json` output."""
    rows = json.loads(output)
    out: dict[str, float] = {}
    for r in rows:
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            out["prompt_tokens_per_s"] = float(r["avg_ts"])
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["decode_tokens_per_s"] = float(r["avg_ts"])
    if len(out) != 2:
        raise ValueError("llama-bench output has no pp and tg rows")
    return out


def run_llama_bench(binary: str, model: str, prompt_tokens: int, gen_tokens: int,
                    threads: int | None) -> dict[str, Any]:
    """Run llama-bench on `model` (pp `prompt_tokens`, tg `gen_tokens`, 2 repetitions)."""
    cmd = [binary, "-m", model, "-p", str(prompt_tokens), "-n", str(gen_tokens),
           "-t", str(threads or os.cpu_count() or 1), "-r", "2", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    return {"tool": "llama-bench", **parse_llama_bench(done.stdout)}


def run_llama_cpp_python(path: str, prompt_tokens: int, gen_tokens: int, threads: int | None,
                         prompt: list[int], warm: list[int]) -> dict[str, Any] | None:
    """The same two figures through llama-cpp-python, if it is installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=prompt_tokens + gen_tokens + 16, n_batch=512,
                n_threads=threads or os.cpu_count(), verbose=False)
    llm.eval(warm)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        llm.eval([llm.sample(temp=0.0)])
    decode_s = time.perf_counter() - t0
    return {"tool": "llama-cpp-python", "prompt_tokens_per_s": prompt_tokens / prompt_s,
            "decode_tokens_per_s": gen_tokens / decode_s}


def llama_bench_gpu(binary: str, model: str, prompt_tokens: int = 512, gen_tokens: int = 128,
                    reps: int = 3, timeout: float = 900) -> dict[str, Any]:
    """llama-bench pp`prompt_tokens` and tg`gen_tokens` with all layers on the GPU (-ngl 99, -fa on)."""
    cmd = [binary, "-m", model, "-p", str(prompt_tokens), "-n", str(gen_tokens), "-ngl", "99",
           "-fa", "on", "-r", str(reps), "-o", "json"]
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
                            gen_tokens: int = 128, timeout: float = 900) -> dict[str, Any]:
    """llama-batched-bench: `lanes` parallel sequences, each its own prompt, all on the GPU."""
    ctx = max(lanes) * (prompt_tokens + gen_tokens)
    cmd = [binary, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_tokens), "-ntg", str(gen_tokens),
           "-npl", ",".join(str(n) for n in lanes), "-ngl", "99", "-fa", "on",
           "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    return {"tool": "llama-batched-bench", "command": " ".join(cmd),
            "rows": parse_batched_bench(done.stdout)}
