"""The `strata` command: generate, chat, serve, stage, bench. A thin user of the engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from strata.engine.config import (
    EngineArgumentParser,
    add_engine_arguments,
    config_from_args,
    version_text,
)
from strata.engine.sampling_defaults import (
    SamplingDefaults,
    add_sampling_default_arguments,
    defaults_from_args,
)
from strata.engine.types import SamplingParams
from strata.errors import BadRequest, StrataError


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """generate's and chat's sampling flags: the defaults' flags `strata serve` takes too, and
    this request's own."""
    g = parser.add_argument_group("sampling (left out: the model's recommendation, as the server does)")
    g.add_argument("--max-tokens", "-n", type=int, default=SamplingParams().max_tokens)
    add_sampling_default_arguments(g)
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def request_params(args: argparse.Namespace, defaults: SamplingDefaults) -> SamplingParams:
    """The CLI's request: its flags are already in `defaults` (`defaults_from_args`), as a
    server's are, so a prompt is sampled as `strata serve` with the same flags samples it."""
    return defaults.params(max_tokens=args.max_tokens, seed=args.sample_seed, stop=list(args.stop))


def engine_defaults(args: argparse.Namespace, engine: Any) -> SamplingDefaults:
    """The sampling defaults over the loaded model's recommendation."""
    return defaults_from_args(args, engine.loaded.sampling)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: a memory-frugal LLM engine")
    parser.add_argument("--version", action="version", version=version_text())
    # EngineArgumentParser: the flags checked together (-ctk/-ctv, -ngl) fail as usage errors too
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EngineArgumentParser)

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)

    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--session", default=None,
                      help="session file name under --session-dir: restored at start when it "
                           "exists, saved after every turn (with the conversation's messages)")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    add_engine_arguments(serve)
    try:
        from strata.serve.main import add_serve_arguments
    except ImportError:  # the server's modules are optional at import time
        add_serve_arguments = None
    if add_serve_arguments is not None:
        add_serve_arguments(serve)

    stage = sub.add_parser("stage", help="a worker running a main's later layers (--remote-stage)")
    from strata.stage_main import add_stage_arguments

    add_stage_arguments(stage)

    bench = sub.add_parser("bench", help="benchmarks, printed as JSON")
    add_engine_arguments(bench)
    from strata.bench.main import add_bench_arguments

    add_bench_arguments(bench)
    return parser


def _engine(args: argparse.Namespace):
    from strata.engine.engine import Engine

    return Engine(config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    try:
        tok = engine.tokenizer
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        else:
            ids = tok.encode(args.prompt, add_special_tokens=True)
        last = None
        for ev in engine.generate(ids, request_params(args, engine_defaults(args, engine))):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            last = ev
        sys.stdout.write("\n")
        if last is not None:
            print(f"[{last.finish_reason.value if last.finish_reason else '?'}: "
                  f"{last.prompt_tokens} prompt, {last.completion_tokens} generated tokens]",
                  file=sys.stderr)
    finally:
        engine.close()
    return 0


def _session_paths(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """The K/V session file and the messages beside it, both under --session-dir."""
    if not args.session:
        return None
    if not args.session_dir:
        raise BadRequest("--session needs --session-dir DIR (where session files may live)", "session")
    from strata.engine.snapshot import resolve_session_path

    path = resolve_session_path(args.session_dir, args.session)
    return path, path.with_name(path.name + ".messages.json")


EXIT_WORDS = ("/exit", "/quit")


def _read_line() -> str | None:
    """The next user line (readline editing and history where the terminal has them); None: end of
    input or /exit. Ctrl-C at the prompt drops the line being typed, as a shell does."""
    while True:
        try:
            line = input("> ")
        except EOFError:
            return None
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit ends the chat)", file=sys.stderr)
            continue
        if line.strip() in EXIT_WORDS:
            return None
        if line.strip():
            return line


def _stream_reply(engine: Any, ids: list[int], params: Any) -> str:
    """Print the reply as it comes; Ctrl-C stops it (the request is cancelled) and keeps what
    was said so far."""
    handle = engine.generate(ids, params)
    reply: list[str] = []
    try:
        for ev in handle:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            reply.append(ev.text)
    except KeyboardInterrupt:
        handle.cancel()
        for ev in handle:  # the cancelled request's last events
            reply.append(ev.text)
        print(" [stopped]", file=sys.stderr)
    return "".join(reply)


def cmd_chat(args: argparse.Namespace) -> int:
    try:
        import readline  # noqa: F401 - input() gains line editing and history
    except ImportError:  # a Python built without it: plain input()
        pass
    paths = _session_paths(args)
    engine = _engine(args)
    tok = engine.tokenizer
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    defaults = engine_defaults(args, engine)
    print(f"strata chat on {engine.model_name}; Ctrl-C stops a reply, Ctrl-D or /exit ends.", file=sys.stderr)
    print(defaults.describe(), file=sys.stderr)
    try:
        if paths is not None and paths[0].exists() and paths[1].exists():
            engine.restore_session(0, args.session)  # the K/V: the next turn reads only what is new
            messages = json.loads(paths[1].read_text())
            print(f"restored {args.session}: {len(messages)} messages", file=sys.stderr)
        while (line := _read_line()) is not None:
            messages.append({"role": "user", "content": line})
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
            try:
                reply = _stream_reply(engine, ids, request_params(args, defaults))
            except StrataError as e:
                print(f"\nstrata: error: {e}", file=sys.stderr)
                messages.pop()
                continue
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": reply})
            if paths is not None:
                lane = next(x["id"] for x in engine.stats()["lanes"] if x["n_tokens"])
                engine.save_session(lane, args.session)
                paths[1].write_text(json.dumps(messages))
    except KeyboardInterrupt:  # between the prompt and a reply (restoring a session, say)
        pass
    finally:
        engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "serve":
            from strata.serve.main import run_server

            return run_server(args) or 0
        if args.command == "stage":
            from strata.stage_main import run_stage

            return run_stage(args)
        if args.command == "bench":
            from strata.bench.main import run_bench

            return run_bench(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
