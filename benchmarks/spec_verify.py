"""What verification costs, and what speculation gives when every draft holds (`spec_bench --verify-cost`).

Random weights copy nothing from their context, so on a synthetic model (the GPU's 8B shape)
drafts from the conversation rarely hold and a replayed workload says little. Two figures do not
depend on the weights: the runner's forward of a decode step whose lanes feed k drafted tokens
each (k + 1 rows a lane, logits for all of them) against a step of one row a lane, eager and,
on CUDA, against the captured one-row graph (verify steps run eagerly); and a regenerate, the
same requests sent twice, where the second drafts from the first's finished conversation, so
drafts hold wherever the verify rows compute what one-row steps computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.engine_runs import eager_steps, step_timing
from benchmarks.spec_replay import compare, engine_sender, outputs, replay, summarise
from benchmarks.spec_workloads import Conversation
from strata.engine.engine import Engine

COUNTS = ("drafted_tokens", "accepted_tokens", "verifications")


def verify_costs(engine: Engine, lanes: Sequence[int], drafts: Sequence[int], position: int,
                 reps: int) -> list[dict[str, Any]]:
    """Forward time of a step whose lanes feed k + 1 rows each, for every k in `drafts` (0 among
    them), eagerly and, where the runner has decode graphs (CUDA; sized by the engine's --spec),
    through them; run on the engine's own thread with the engine idle, as its steps are."""
    def measure() -> list[dict[str, Any]]:
        rows = []
        for n in lanes:
            with eager_steps(engine.runner):
                eager = {k: step_timing(engine, n, position, reps, rows=k + 1)["forward_ms"] for k in drafts}
            graph = ({k: step_timing(engine, n, position, reps, rows=k + 1)["forward_ms"] for k in drafts}
                     if engine.runner.graphs is not None else {})
            one = graph.get(0, eager[0])  # a one-row step as the engine runs it
            for k in drafts:
                fastest = min(eager[k], graph.get(k, eager[k]))
                rows.append({"lanes": n, "drafts": k, "rows": n * (k + 1), "eager_ms": eager[k],
                             "graph_ms": graph.get(k), "eager_vs_one_row": eager[k] / eager[0],
                             "graph_vs_one_row": graph[k] / graph[0] if graph else None,
                             "speedup_if_all_accepted": (k + 1) * one / fastest})
        return rows

    return engine.call(measure).result()


def _spec_counts(engine: Engine) -> dict[str, int]:
    spec = engine.stats().get("speculation") or {}
    return {k: int(spec.get(k, 0)) for k in COUNTS}


def regenerate(engine: Engine, convs: Sequence[Conversation], lanes: int, max_tokens: int) -> dict[str, Any]:
    """The conversations twice, `lanes` at once, greedy; the second round's figures and answers."""
    send = engine_sender(engine, max_tokens, 0.0)
    first, _ = replay(convs, lanes, send, engine.tokenizer)
    before = _spec_counts(engine)
    second, wall = replay(convs, lanes, send, engine.tokenizer)
    after = _spec_counts(engine)
    got = {k: after[k] - before[k] for k in COUNTS}
    drafted, accepted, verifications = (got[k] for k in COUNTS)
    return {**summarise(second, wall), "speculation": {
        **got, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": accepted / verifications if verifications else 0.0},
        "same_as_first_round": compare(outputs(second), outputs(first))["identical"],
        "outputs": outputs(second)}
