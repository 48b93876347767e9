"""Checkpoints of a recurrent model's state on a replayed chat workload, as JSON.

Two chats of four turns share a system prompt; then the last answer of chat
A is regenerated and its second user message edited. Every request is timed
to its first token twice: with checkpoints (`--ctx-checkpoints`,
`--prompt-cache-min-step`, `--prompt-cache 4` to park the chat that gives
its lane up) and with nothing reused (every prompt from token 0). Requests
name their message ends as cut points, as the server does
(`serve/cut_points.py`). The model is a Qwen3-Next-shaped one with random weights (transformers
builds it; a byte tokenizer), so the figures are the engine's, not a
checkpoint's.

    python -m benchmarks.hybrid_replay [--system 2048] [--hidden 512] [--layers 8] [--device cpu]
        [--gguf] [--llama-server PATH]

With --llama-server the model is written as a GGUF (as llama.cpp's converter
writes qwen3next), both engines load that file, and llama-server replays the
same requests through its /completion route (streamed, `cache_prompt`),
with `--ctx-checkpoints 8` against `--ctx-checkpoints 0` and no prompt cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.llama_server import LlamaServer
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.request import merge_events
from strata.engine.types import SamplingParams
from tests.models.gguf_export import write_gguf
from tests.models.tiny_models import save_byte_tokenizer

ANSWER = 16


def write_model(folder: Path, hidden: int, layers: int, tokenizer: str | None = None, experts: int = 16) -> str:
    """A random Qwen3-Next of `layers` layers (every fourth full attention) in `folder`: the HF
    folder with a byte tokenizer, or with `tokenizer` (a GGUF's) a GGUF file carrying it, as
    llama.cpp's converter writes qwen3next. Returns what to load."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    vocab, bos, eos = 256, None, None
    if tokenizer is not None:
        from gguf import GGUFReader

        fields = GGUFReader(tokenizer).fields
        vocab = len(fields["tokenizer.ggml.tokens"].data)
        bos, eos = (int(fields[f"tokenizer.ggml.{k}_token_id"].contents()) for k in ("bos", "eos"))
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=2, head_dim=64, intermediate_size=3 * hidden, linear_num_key_heads=hidden // 128,
        linear_num_value_heads=hidden // 64, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden, max_position_embeddings=32768, bos_token_id=bos,
        eos_token_id=eos, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                       for i in range(layers)])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if tokenizer is not None:
        return str(write_gguf(model, folder / "model.gguf", "qwen3next", types={}, tokenizer_from=tokenizer))
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return str(folder)


def workload(system: int, message: int, seed: int = 1) -> list[tuple[str, list[int] | None, str | None]]:
    """(name, new user message, chat) in order; a message of None is a regenerate of the chat's
    last prompt, the chat "A-edit" rewrites A's second message."""
    g = torch.Generator().manual_seed(seed)

    def msg() -> list[int]:
        return torch.randint(3, 255, (message,), generator=g).tolist()

    steps: list[tuple[str, list[int] | None, str | None]] = []
    for turn in range(4):
        for chat in ("A", "B"):
            steps.append((f"{chat}{turn + 1}", msg(), chat))
    steps.append(("A-regenerate", None, "A"))
    steps.append(("A-edit", msg(), "A-edit"))
    return steps


Send = Callable[[list[int], list[int]], tuple[float, int, list[int]]]  # (ttft s, cached, answer)


def engine_sender(eng: Engine) -> Send:
    """Requests to an engine in this process, timed to their first token."""

    def send(prompt: list[int], cuts: list[int]) -> tuple[float, int, list[int]]:
        params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True, cut_points=list(cuts))
        started = time.perf_counter()
        ttft, events = None, []
        for ev in eng.generate(prompt, params):
            if ttft is None and ev.token_ids:
                ttft = time.perf_counter() - started
            events.append(ev)
        done = merge_events(events)
        return ttft or 0.0, done.cached_tokens, done.token_ids

    return send


def replay(send: Send, system: list[int], steps: list[tuple[str, list[int] | None, str | None]],
           ) -> list[dict[str, Any]]:
    """Time every request of the workload to its first token; answers extend their chats. A
    warm-up request first (ids the workload never uses), so no request pays for first-use costs."""
    send([2] * 64, [])
    chats: dict[str, list[int]] = {"A": list(system), "B": list(system)}
    ends: dict[str, list[int]] = {"A": [len(system)], "B": [len(system)]}  # each message's end
    last: dict[str, list[int]] = {}
    first_turn_a: list[int] = []  # A's first message and answer: what the edit keeps
    rows = []
    for name, message, chat in steps:
        if message is None:  # the same prompt again
            prompt = last[chat]  # type: ignore[index]
            cuts = ends[chat][:-1]  # type: ignore[index]
        elif chat == "A-edit":  # A's second message replaced
            prompt = list(system) + first_turn_a + message
            cuts = ends["A"][:3]
        else:
            prompt = chats[chat] + message  # type: ignore[index]
            cuts = ends[chat]  # type: ignore[index]
        ttft, cached, answer = send(prompt, cuts)
        if chat in chats and message is not None:
            if chat == "A" and not first_turn_a:
                first_turn_a = message + answer
            chats[chat] = prompt + answer  # type: ignore[index]
            ends[chat] += [len(prompt), len(chats[chat])]  # type: ignore[index]
            last[chat] = prompt  # type: ignore[index]
        rows.append({"request": name, "prompt_tokens": len(prompt), "cached_tokens": cached,
                     "ttft_s": round(ttft, 4), "answer": answer})
    return rows


def profile_turn(eng: Engine, rows: list[dict[str, Any]], top: int = 40) -> list[str]:
    """torch.profiler's table of a later turn of a fresh chat (its first turn read unprofiled):
    where a step's host time goes. The profiler runs on the engine's thread, which runs the steps."""
    from torch.profiler import ProfilerActivity, profile

    send = engine_sender(eng)
    g = torch.Generator().manual_seed(77)
    prompt = torch.randint(3, 255, (rows[0]["prompt_tokens"],), generator=g).tolist()
    _, _, answer = send(prompt, [])
    turn = prompt + answer + torch.randint(3, 255, (64,), generator=g).tolist()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    eng.call(prof.__enter__).result()
    send(turn, [len(prompt), len(prompt) + len(answer)])
    eng.call(lambda: prof.__exit__(None, None, None)).result()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top).splitlines()


def decode_speeds(eng: Engine, tokens: int) -> dict[str, Any]:
    """One lane's decode tokens/s after a prompt of up to 512 tokens: every step eager, and
    through the runner's decode graphs where it has them (Qwen3-Next's on CUDA)."""
    from benchmarks.engine_runs import decode_run, eager_steps

    prompt = min(512, eng.config.max_context - tokens - 16)
    out: dict[str, Any] = {"prompt_tokens": prompt, "tokens": tokens}
    for salt, label in ((5, "graphs"), (9, "eager")):
        if label == "graphs" and eng.runner.graphs is None:
            continue
        with contextlib.nullcontext() if label == "graphs" else eager_steps(eng.runner):
            decode_run(eng, 1, prompt, 8, salt)  # compiles (and captures)
            run = decode_run(eng, 1, prompt, tokens, salt + 1)
        out[label + "_tokens_per_s"] = round(run["decode_tokens_per_s"], 1)
    return out


def long_reads(send: Send, n: int, cut_every: int, reps: int = 3) -> list[float]:
    """Seconds to the first token of `reps` fresh `n`-token prompts, named cut points every
    `cut_every` tokens (a long chat's message ends); nothing is reused between them."""
    out = []
    for r in range(reps):
        prompt = torch.randint(3, 255, (n,), generator=torch.Generator().manual_seed(100 + r)).tolist()
        ttft, _, _ = send(prompt, list(range(cut_every, n, cut_every)))
        out.append(round(ttft, 4))
    return out


def compare(zero: list[dict[str, Any]], cp: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request: the run with reuse against the one without, and the summary ratios."""
    rows = []
    for z, c in zip(zero, cp):
        rows.append({"request": z["request"], "prompt_tokens": z["prompt_tokens"],
                     "cached_tokens": c["cached_tokens"], "ttft_from_zero_s": z["ttft_s"],
                     "ttft_checkpoints_s": c["ttft_s"], "ratio": round(c["ttft_s"] / z["ttft_s"], 4),
                     "same_answer": z["answer"] == c["answer"]})
    later = [r["ratio"] for r in rows if r["request"] not in ("A1", "B1")]
    return {"requests": rows, "first_read_ratio": rows[0]["ratio"], "later_turns_max_ratio": max(later)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", type=int, default=2048, help="system prompt tokens")
    p.add_argument("--message", type=int, default=64, help="tokens per user message")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (bfloat16 takes FLA's kernels on CUDA)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--min-step", type=int, default=512, help="--prompt-cache-min-step of the run with checkpoints")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--passes", type=int, default=1,
                   help="replay the workload so many times with other tokens of the same lengths and time the "
                        "last (on a GPU the first sight of a length compiles kernels)")
    p.add_argument("--long", type=int, default=0, metavar="N",
                   help="also read fresh N-token prompts with checkpoints on and off (the reading cost)")
    p.add_argument("--long-cut", type=int, default=1024, help="named cut points every so many tokens of them")
    p.add_argument("--profile", action="store_true", help="add torch.profiler's table of one later turn")
    p.add_argument("--prompt-graphs", action="store_true",
                   help="both engines replay short one-lane prompt steps from CUDA graphs (--prompt-graphs)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also time N decode tokens of one lane after a 512-token prompt, stepping "
                        "eagerly and (on CUDA) through the decode graphs")
    p.add_argument("--gguf", action="store_true", help="load the model as a GGUF (written from the HF model)")
    p.add_argument("--tokenizer", default=".bench/tokenizer.gguf",
                   help="the GGUF whose tokenizer a written GGUF carries (`python -m tools.synth OUT "
                        "--tokenizer-only` writes the default model's)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="also replay through this llama-server on the same GGUF (--ctx-checkpoints 8 "
                        "against 0); its TTFT ratios beside Strata's")
    args = p.parse_args(argv)
    passes = [(torch.randint(3, 255, (args.system,), generator=torch.Generator().manual_seed(2 + 10 * k)).tolist(),
               workload(args.system, args.message, 1 + 10 * k)) for k in range(args.passes)]
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf or args.llama_server is not None
        model = write_model(Path(tmp), args.hidden, args.layers, args.tokenizer if gguf else None, args.experts)
        max_context = max(args.system + 8 * (args.message + ANSWER), args.long) + 64
        runs = {}
        for label, flags in (("from_zero", dict(prefix_reuse=False, ctx_checkpoints=0)),
                             ("checkpoints", dict(prompt_cache_min_step=args.min_step, prompt_cache=4))):
            cfg = EngineConfig(model=model, device=args.device, dtype=args.dtype, weights="dense", parallel=2,
                               max_context=max_context, prefill_chunk=args.prefill_chunk,
                               prompt_graphs=args.prompt_graphs, **flags)
            with Engine(cfg) as eng:
                for system, steps in passes:  # the same lengths, other tokens: the last pass is timed
                    runs[label] = replay(engine_sender(eng), system, steps)
                runs[label + "_checkpoints"] = eng.stats()["checkpoints"]
                graphs = getattr(eng.runner, "prompt_graphs", None)  # a layer split's runner has none
                runs[label + "_prompt_graphs"] = [] if graphs is None else graphs.captured()
                if args.long:
                    runs[label + "_long"] = long_reads(engine_sender(eng), args.long, args.long_cut)
                if args.profile and label == "checkpoints":
                    runs["profile"] = profile_turn(eng, runs[label])
                if args.decode and label == "checkpoints":
                    runs["decode"] = decode_speeds(eng, args.decode)
        out: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "hidden": args.hidden, "layers": args.layers,
                               "system_tokens": args.system, "min_step": args.min_step, "model": Path(model).name,
                               "strata": compare(runs["from_zero"], runs["checkpoints"]),
                               "checkpoints": runs["checkpoints_checkpoints"],
                               "prompt_graph_sizes": {k: runs[k + "_prompt_graphs"] for k in ("from_zero", "checkpoints")}}
        if args.profile:
            out["profile"] = runs["profile"]
        if args.decode:
            out["decode"] = runs["decode"]
        if args.long:
            zero, cp = runs["from_zero_long"], runs["checkpoints_long"]
            out["long_prompt"] = {"tokens": args.long, "cut_every": args.long_cut, "from_zero_s": zero,
                                  "checkpoints_s": cp, "overhead": round(min(cp) / min(zero) - 1, 4)}
        if args.llama_server:
            llama = {}
            for label, extra, cache in (("from_zero", ["--ctx-checkpoints", "0"], False),
                                        ("checkpoints", ["--ctx-checkpoints", "8"], True)):
                with LlamaServer(args.llama_server, model, max_context, extra) as server:
                    for system, steps in passes:
                        llama[label] = replay(server.sender(ANSWER, cache), system, steps)
                    llama["command"] = server.command
            out["llama_cpp"] = {"command": llama["command"], **compare(llama["from_zero"], llama["checkpoints"])}
            out["answers_equal_llama"] = sum(a["answer"] == b["answer"] for a, b in
                                             zip(runs["from_zero"], llama["from_zero"])) / len(llama["from_zero"])
            out["strata_vs_llama_ttft"] = {
                r["request"]: round(q["ttft_checkpoints_s"] / r["ttft_checkpoints_s"], 3)
                for r, q in zip(out["strata"]["requests"], out["llama_cpp"]["requests"])}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
