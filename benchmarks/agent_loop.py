"""An agent's tool loop against `strata serve` (a benchmark, not a test): does each round trip stay quick?

    python -m benchmarks.agent_loop --rounds 20 -- --max-context 8192

starts the server twice with the flags after `--`: once as given and once
with `--no-prefix-reuse` added, and on each runs one conversation the way an
agent does: the request carries the tools and the whole conversation so far,
the model must call a tool (`tool_choice: required`, held to the schema by the
grammar), the tool's result (about `--result-tokens` tokens of text) is
appended, and the next round resends everything. It records, per round, the
prompt's length, the tokens the server reused (`cached_tokens`), the time to
the first streamed chunk of the call and the round's total time, and prints
one JSON object. With the conversation cache the time to first token stays
flat while the prompt grows; without prefix reuse it grows with the prompt.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from benchmarks.soak import _start, _wait_healthy

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project and return its text",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                   "properties": {"path": {"type": "string", "maxLength": 40}}}}}]
LINE = "def step_{i}(state):\n    return state + {i}  # advance the counter by {i}\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tool_output(round_no: int, tokens: int) -> str:
    """A file's text, different each round, about `tokens` tokens long (20 tokens a line)."""
    return "".join(LINE.format(i=round_no * 1000 + k) for k in range(max(1, tokens // 20)))


def run_loop(url: str, rounds: int, result_tokens: int) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    messages: list[Any] = [
        {"role": "system", "content": "You are a coding agent. Read files with the read_file tool."},
        {"role": "user", "content": "Read the project's files one after another and summarise them."}]
    out = []
    for r in range(rounds):
        t0 = time.monotonic()
        first: float | None = None
        stream = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80,
            temperature=0, stream=True, stream_options={"include_usage": True})
        calls: dict[int, dict[str, str]] = {}
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                for d in choice.delta.tool_calls or []:
                    if first is None:
                        first = time.monotonic() - t0
                    call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = d.id or call["id"]
                    if d.function is not None:
                        call["name"] = d.function.name or call["name"]
                        call["arguments"] += d.function.arguments or ""
        total = time.monotonic() - t0
        assert usage is not None and calls, f"round {r}: no tool call came back"
        call = calls[0]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": _tool_output(r, result_tokens)})
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out.append({"round": r, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                    "ttft_s": round(first or total, 4), "total_s": round(total, 4),
                    "arguments_valid": _valid(call["arguments"])})
    return out


def _valid(arguments: str) -> bool:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and isinstance(value.get("path"), str)


def _serve_and_loop(flags: list[str], rounds: int, result_tokens: int, log: Path) -> list[dict[str, Any]]:
    port = _free_port()
    proc = _start(port, flags, log)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        return run_loop(url, rounds, result_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--result-tokens", type=int, default=200, help="tokens of each tool result")
    parser.add_argument("--runs", default="prefix_reuse,no_prefix_reuse",
                        help="which servers to run: prefix_reuse, no_prefix_reuse or both")
    args = parser.parse_args(own)
    logs = Path(tempfile.mkdtemp(prefix="agent-loop-"))
    runs = {}
    chosen = set(args.runs.split(","))
    for name, extra in (("prefix_reuse", []), ("no_prefix_reuse", ["--no-prefix-reuse"])):
        if name not in chosen:
            continue
        rounds = _serve_and_loop([*flags, *extra], args.rounds, args.result_tokens, logs / f"{name}.log")
        last = rounds[len(rounds) // 2:]
        runs[name] = {"rounds": rounds,
                      "ttft_first_s": rounds[0]["ttft_s"],
                      "ttft_median_second_half_s": sorted(r["ttft_s"] for r in last)[len(last) // 2],
                      "final_prompt_tokens": rounds[-1]["prompt_tokens"],
                      "all_arguments_valid": all(r["arguments_valid"] for r in rounds)}
    print(json.dumps({"flags": flags, "rounds": args.rounds, "result_tokens": args.result_tokens,
                      "runs": runs, "logs": str(logs)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
