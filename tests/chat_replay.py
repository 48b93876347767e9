"""Chats replayed turn by turn through an engine: the scenario conversation tests compare."""

from __future__ import annotations

import threading

from strata.engine.engine import Engine
from strata.engine.types import FinishReason, SamplingParams


def chat_prompt(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def replay(eng: Engine, system: str, questions: list[list[str]], params: SamplingParams,
           cancel_first: bool = False) -> list[tuple[list[int], list[int], int]]:
    """Every chat's turns, interleaved (turn 1 of each, then turn 2, ...), each reply appended
    before the next turn: (prompt, output ids, cached tokens) per turn. `cancel_first`: each
    request is first sent and cancelled after its first event."""
    tok = eng.tokenizer
    chats = [[{"role": "system", "content": system}] for _ in questions]
    out = []
    for turn in range(len(questions[0])):
        for c, qs in enumerate(questions):
            chats[c].append({"role": "user", "content": qs[turn]})
            ids = chat_prompt(tok, chats[c])
            if cancel_first:
                h = eng.generate(ids, params)
                it = iter(h)
                next(it)
                h.cancel()
                assert list(it)[-1].finish_reason in (FinishReason.CANCELLED, FinishReason.LENGTH)
            r = eng.complete(ids, params)
            out.append((ids, r.token_ids, r.cached_tokens))
            chats[c].append({"role": "assistant", "content": tok.decode(r.token_ids)})
    return out


def concurrent(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The output ids of `prompts` sent at once from threads (several lanes busy together)."""
    results: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        results[i] = eng.complete(prompts[i], params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
