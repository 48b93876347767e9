"""llama.cpp beside Strata in one run: its own `llama-bench`, or llama-cpp-python.

`llama-bench` (built from llama.cpp's source) is the fair peer: C++ all the
way. llama-cpp-python drives llama.cpp from Python, one call a token, and
loses about half its decode speed to that; it is the fallback when no
llama-bench binary is given. The GPU benchmark's peers (`llama-bench` and
`llama-batched-bench` with every layer on the GPU) are in
`benchmarks/llama_peer.py`.
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
