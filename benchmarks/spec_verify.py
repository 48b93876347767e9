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
    """Forward time of a step whose lanes feed k + 1 rows each, for every k in `drafts`, against
    one row a lane; run on the engine's own thread (the engine idle), as its steps are."""
    def measure() -> list[dict[str, Any]]:
        rows = []
        for n in lanes:
            graph = step_timing(engine, n, position, reps)["forward_ms"] if engine.runner.graphs else None
            with eager_steps(engine.runner):
                one = step_timing(engine, n, position, reps)["forward_ms"]
                for k in drafts:
                    ms = one if k == 0 else step_timing(engine, n, position, reps, rows=k + 1)["forward_ms"]
                    rows.append({"lanes": n, "drafts": k, "rows": n * (k + 1), "forward_ms": ms,
                                 "vs_one_row": ms / one, "vs_one_row_graph": ms / graph if graph else None,
                                 "speedup_if_all_accepted": (k + 1) * (graph or one) / ms})
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
