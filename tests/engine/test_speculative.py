"""Speculative decoding never changes the answer: greedy and seeded output with --spec equal the
output without, in mixed batches, across turns and parking; rejected drafts leave nothing behind."""

from __future__ import annotations

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import BadRequest

REPEATED = list(range(300, 340))  # a run the prompt quotes twice: drafts have something to copy


def _prompt(i: int) -> list[int]:
    return [1, 50 + i] + REPEATED + [77, 78 + i] + REPEATED[:20]


Requests = list[tuple[list[int], SamplingParams]]


def _run(loaded, spec: int, rounds: list[Requests], parallel: int = 3, **config) -> tuple[list, dict]:
    """Each round's requests together, the rounds one after the other: a random model copies
    nothing from its prompt, so drafts come from the finished conversations of earlier rounds."""
    cfg = EngineConfig(max_context=512, parallel=parallel, spec=spec, **config)
    out = []
    with Engine(cfg, loaded=loaded) as eng:
        for requests in rounds:
            handles = [eng.generate(p, params) for p, params in requests]
            out.append([h.result().token_ids for h in handles])
        return out, eng.stats()


def _greedy_answer(loaded, prompt: list[int], n: int) -> list[int]:
    with Engine(EngineConfig(max_context=512), loaded=loaded) as eng:
        return eng.complete(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids


def _decoy(prompt: list[int], answer: list[int], at: int) -> tuple[list[int], SamplingParams]:
    """A request whose finished conversation continues `prompt + answer[:at]` otherwise than the
    model does: a later request drafting from it gets its drafts rejected there."""
    wrong = [(t + 1) % 1000 + 1000 for t in answer[at : at + 4]]
    return prompt + answer[:at] + wrong, SamplingParams(max_tokens=1)


def test_mixed_lanes_give_the_same_tokens_with_and_without_drafts(tiny_loaded) -> None:
    grammar = 'start: /[a-z ]{1,40}/'
    first = [(_prompt(i), SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(4)]
    decoys = [_decoy(_prompt(0), _greedy_answer(tiny_loaded, _prompt(0), 40), at) for at in (5, 12, 20)]
    again = [
        (_prompt(0), SamplingParams(max_tokens=48, ignore_eos=True)),  # greedy: its first answer, drafted
        (_prompt(1), SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)),  # sampled
        (_prompt(2), SamplingParams(max_tokens=30, logprobs=2, repetition_penalty=1.3, ignore_eos=True)),
        (_prompt(3), SamplingParams(max_tokens=20, grammar=grammar)),  # constrained: never drafts
        (_prompt(0), SamplingParams(max_tokens=40, stop_token_ids=[7])),
        *[(_prompt(0), SamplingParams(max_tokens=40, temperature=0.2, seed=s, ignore_eos=True))
          for s in range(3)],
    ]
    plain, plain_stats = _run(tiny_loaded, 0, [first, decoys, again])
    drafted, stats = _run(tiny_loaded, 4, [first, decoys, again])
    assert drafted == plain
    spec = stats["speculation"]
    assert spec["accepted_tokens"] > 0  # drafts were kept ...
    assert spec["drafted_tokens"] > spec["accepted_tokens"]  # ... and some rejected and rolled back
    assert stats["steps"] < plain_stats["steps"]  # verified drafts saved steps


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_seeded_sampling_draws_the_same_tokens(tiny_loaded, temperature: float, top_p: float) -> None:
    """Sampling row by row with the request's generator, stopping at the first mismatch, consumes
    the noise a run without drafts consumes: the same seed gives the same tokens."""
    greedy = [(_prompt(i), SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(3)]
    greedy += [_decoy(_prompt(i), _greedy_answer(tiny_loaded, _prompt(i), 24), 8) for i in range(3)]
    sampled = [(_prompt(s % 3), SamplingParams(max_tokens=24, temperature=temperature, top_p=top_p,
                                               seed=s, ignore_eos=True)) for s in range(24)]
    plain, _ = _run(tiny_loaded, 0, [greedy, sampled], parallel=4)
    drafted, stats = _run(tiny_loaded, 6, [greedy, sampled], parallel=4)
    assert drafted == plain
    assert 0 < stats["speculation"]["accepted_tokens"] < stats["speculation"]["drafted_tokens"]
    assert len({tuple(o) for o in plain[1]}) > 12  # the seeds do sample different answers


def _lane_kv(eng: Engine, n: int) -> list[torch.Tensor]:
    """Lane 0's K/V (every pool layer) at positions [0, n), as stored."""
    def read() -> list[torch.Tensor]:
        pool = eng.pool
        cells = pool.cells_of_range(0, 0, n)
        out = []
        for layer in pool.layer_ids:
            k, v = pool.read(layer, cells, torch.float32)
            out += [k.clone(), v.clone()]
        return out
    return eng.call(read).result()


def test_rejected_drafts_are_rolled_back_by_length(tiny_loaded) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    answer = _greedy_answer(tiny_loaded, _prompt(0), 40)
    decoys = [_decoy(_prompt(0), answer, at) for at in (6, 13, 22)]  # several: a draft may end just
    results = {}  # before one
    for spec in (0, 4):
        with Engine(EngineConfig(max_context=512, parallel=1, spec=spec), loaded=tiny_loaded) as eng:
            eng.complete(_prompt(0), params)
            for decoy in decoys:
                eng.complete(*decoy)
            decoy_kv = _lane_kv(eng, len(decoys[-1][0]))  # the lane holds the last decoy now
            r = eng.complete(_prompt(0), params)  # drafts from all: the decoys' are rejected
            held = len(eng.scheduler.lanes[0].tokens)
            results[spec] = (r.token_ids, held, _lane_kv(eng, held), decoy_kv, eng.stats())
    (plain, n0, kv0, _, _), (drafted, n1, kv1, decoy_kv, stats) = results[0], results[4]
    assert drafted == plain and n1 == n0
    assert stats["speculation"]["drafted_tokens"] > stats["speculation"]["accepted_tokens"]
    assert all(torch.equal(a, b) for a, b in zip(kv0, kv1))  # the lane's K/V: bit for bit
    # negative control: K/V holding a wrong token where the answer has another (what a kept
    # rejected draft would leave) is seen by the same comparison
    n = len(decoy_kv[0])
    assert not all(torch.equal(a, b[:n]) for a, b in zip(decoy_kv, kv1))


def test_turns_with_prefix_reuse_and_parking_match(tiny_loaded) -> None:
    """Three conversations through two lanes (parking on), each continued for a second turn."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for spec in (0, 4):
        cfg = EngineConfig(max_context=512, parallel=2, spec=spec, conversation_cache_mib=64,
                           kv_pool_tokens=512, kv_chunk=64)
        with Engine(cfg, loaded=tiny_loaded) as eng:
            first = [eng.complete(_prompt(i), params).token_ids for i in range(3)]
            second = [eng.complete(_prompt(i) + first[i] + REPEATED[:12], params) for i in range(3)]
            outs[spec] = (first, [r.token_ids for r in second], [r.cached_tokens for r in second],
                          eng.stats())
    assert outs[4][:2] == outs[0][:2]
    assert outs[4][2] == outs[0][2] and sum(outs[4][2]) > 0  # the second turns reused their prefix
    assert outs[4][3]["conversation_parks"] > 0


def test_limits_hold_with_drafts(tiny_loaded) -> None:
    """max_tokens and the context end a request exactly where they do without drafts."""
    prompt = _prompt(0)
    for params, ctx in ((SamplingParams(max_tokens=7, ignore_eos=True), 512),
                        (SamplingParams(max_tokens=200, ignore_eos=True), len(prompt) + 13)):
        got = {}
        for spec in (0, 8):
            with Engine(EngineConfig(max_context=ctx, spec=spec), loaded=tiny_loaded) as eng:
                r = eng.complete(prompt, params)
                got[spec] = (r.token_ids, r.finish_reason)
        assert got[8] == got[0]


def test_bad_spec_values_are_refused(tiny_loaded) -> None:
    with pytest.raises(BadRequest, match="--spec"):
        Engine(EngineConfig(max_context=128, spec=-1), loaded=tiny_loaded)
    with pytest.raises(BadRequest, match="--spec-min-p"):
        Engine(EngineConfig(max_context=128, spec=2, spec_min_p=1.5), loaded=tiny_loaded)


def test_metrics_show_drafts_and_acceptance(tiny_loaded) -> None:
    import re

    from strata.serve.metrics import ServeMetrics

    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with Engine(EngineConfig(max_context=512, spec=4), loaded=tiny_loaded) as eng:
        eng.complete(_prompt(0), params)
        eng.complete(_prompt(0), params)  # drafts from the first: all accepted
        spec = eng.stats()["speculation"]
        text = ServeMetrics(eng.stats, lambda: "tiny").render().decode()
    assert spec["accepted_tokens"] == spec["drafted_tokens"] > 0
    assert spec["mean_accepted_length"] == spec["accepted_tokens"] / spec["verifications"]

    def value(pattern: str) -> float:
        m = re.search(pattern + r" (\S+)$", text, re.M)
        assert m is not None, pattern
        return float(m.group(1))

    assert value(r"^strata_engine_speculation_accepted_tokens") == spec["accepted_tokens"]
    assert value(r'^vllm:spec_decode_num_accepted_tokens_total\{model_name="tiny"\}') == spec["accepted_tokens"]
    assert value(r'^vllm:spec_decode_num_drafts_total\{model_name="tiny"\}') == spec["verifications"]
    assert value(r"^strata_engine_speculation_enabled") == 1.0


def test_drafts_stay_within_the_step_budget() -> None:
    """A step's decode rows (lanes plus drafts) stay within `step_rows`; lanes whose drafts held
    lately draft first."""
    from strata.engine.request import Request, RequestHandle
    from strata.engine.speculative import SpecConfig, Speculator, SuffixProposer
    from strata.engine.suffix import SharedCorpus

    corpus = SharedCorpus(1000)
    text = list(range(100, 160))
    corpus.add(text)  # every request below finds 4 tokens to draft
    spec = Speculator(SpecConfig(n=4, step_rows=8), [SuffixProposer(corpus, 0.0)])
    reqs = [Request(text[:20], SamplingParams(), RequestHandle(f"r{i}")) for i in range(4)]
    first = spec.plan([(r, 10) for r in reqs])
    assert sum(map(len, first)) == 8 - 4 and first[0] == text[20:24]  # the budget, to the first
    for req, accepted in zip(reqs, (0, 1, 4, 2)):
        spec.draft(req, 4)
        spec.verified(req, 4, accepted)  # the one whose draft held whole drafts first next time
    second = spec.plan([(r, 10) for r in reqs])
    assert [len(d) for d in second] == [0, 0, 4, 0]
    assert spec.plan([(r, 10) for r in reqs] * 2) == [[]] * 8  # 8 lanes fill the step
    assert sum(map(len, spec.plan([(reqs[1], 2)]))) == 2  # within the request's room


@pytest.fixture(scope="module")
def other_draft(tiny_model_dir, tmp_path_factory):
    """A second random llama with the same tokenizer: its drafts mostly miss."""
    import shutil

    from strata.models import load_model
    from tests.tiny_llama import write_tiny_llama

    out = tmp_path_factory.mktemp("draft")
    for f in tiny_model_dir.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", progress=False)
    tok = loaded.tokenizer
    write_tiny_llama(out, tok.vocab_size, tok.bos_token_id, tok.eos_token_id, hidden=32, intermediate=64)
    return load_model(str(out), device="cpu", dtype="bfloat16", progress=False)


@pytest.mark.parametrize("drafter", ["same", "other"])
def test_a_draft_model_never_changes_the_answer(tiny_loaded, other_draft, drafter: str) -> None:
    """The model itself as its draft (drafts hold) and another random model (they mostly miss):
    greedy and seeded answers equal those without drafts; the figures are the draft model's."""
    draft = tiny_loaded if drafter == "same" else other_draft
    requests = [(_prompt(i), SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(3)]
    requests += [(_prompt(0), SamplingParams(max_tokens=24, temperature=0.9, seed=s, ignore_eos=True))
                 for s in range(3)]
    plain, _ = _run(tiny_loaded, 0, [requests])
    cfg = EngineConfig(max_context=512, parallel=3, spec=4, suffix_draft=False)
    with Engine(cfg, loaded=tiny_loaded, spec_model=draft) as eng:
        got = [h.result().token_ids for h in [eng.generate(p, params) for p, params in requests]]
        spec = eng.stats()["speculation"]
    assert got == plain[0]
    assert spec["proposers"] == "draft_model" and spec["draft_model_drafted_tokens"] > 0
    if drafter == "same":
        assert spec["draft_model_acceptance_rate"] > 0.5
    else:
        assert spec["draft_model_acceptance_rate"] < 0.5


class _Spelling:
    """A tokenizer as the check sees it: a size and each token's bytes."""

    def __init__(self, words: list[bytes]) -> None:
        self.vocab_size = len(words)
        self.words = words

    def token_bytes(self, i: int) -> bytes:
        return self.words[i]


def test_a_draft_model_with_another_vocabulary_is_refused() -> None:
    from strata.engine.draft_model import check_same_vocabulary
    from strata.errors import ModelLoadError

    words = [b"a", b"b", b"c"]
    check_same_vocabulary(_Spelling(words), _Spelling(list(words)), "draft.gguf")
    with pytest.raises(ModelLoadError, match="2 tokens, the model 3"):
        check_same_vocabulary(_Spelling(words[:2]), _Spelling(words), "draft.gguf")
    with pytest.raises(ModelLoadError, match="spells token 1 as b'x'"):
        check_same_vocabulary(_Spelling([b"a", b"x", b"c"]), _Spelling(words), "draft.gguf")


def test_a_step_rests_from_drafting_only_when_no_lane_would_draft() -> None:
    """`rests`: no room in the step, or every lane constrained or in a pause; `rested` counts the
    pipelined step off the pauses as `draft` would have."""
    from strata.engine.request import Request, RequestHandle
    from strata.engine.speculative import SpecConfig, Speculator, SuffixProposer
    from strata.engine.suffix import SharedCorpus

    corpus = SharedCorpus(1000)
    text = list(range(100, 160))
    corpus.add(text)  # every request below finds drafts
    spec = Speculator(SpecConfig(n=4, step_rows=8), [SuffixProposer(corpus, 0.0)])
    reqs = [Request(text[:20], SamplingParams(), RequestHandle(f"r{i}")) for i in range(2)]
    constrained = Request(text[:20], SamplingParams(grammar='start: "a"'), RequestHandle("g"))
    assert not spec.rests(reqs)  # they have never drafted: they would try
    assert spec.rests([constrained, None])
    assert spec.rests(reqs * 4)  # 8 lanes fill the step's rows
    for req in reqs:  # two verifications accepting nothing: a pause of PAUSE_STEPS steps
        for _ in range(2):
            assert spec.draft(req, 4)
            spec.verified(req, 4, 0)
    assert spec.rests(reqs + [constrained])
    pauses = [spec._lanes[r.id].pause for r in reqs]
    spec.rested(reqs)
    assert [spec._lanes[r.id].pause for r in reqs] == [p - 1 for p in pauses]
    spec.rested(reqs * 4)  # no room: `draft` would not have been asked, nothing counted off
    assert [spec._lanes[r.id].pause for r in reqs] == [p - 1 for p in pauses]
    for _ in range(pauses[0] - 1):
        spec.rested(reqs)
    assert not spec.rests(reqs)  # the pauses are over: they would draft again


def test_pipelined_steps_with_drafting_give_the_same_tokens(tiny_loaded) -> None:
    """With the pipeline on, a step is launched before the last one is post-processed while no
    lane of it would draft (here: eight lanes fill the CPU's eight decode rows), and the answers
    are those without drafts and without the pipeline; fewer lanes draft, unpipelined."""
    eight = [(_prompt(i % 4), SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(8)]
    few = [(_prompt(0), SamplingParams(max_tokens=40, ignore_eos=True))]
    plain, _ = _run(tiny_loaded, 0, [eight, few, few], parallel=8)
    piped, stats = _run(tiny_loaded, 4, [eight, few, few], parallel=8, pipeline="on")
    assert piped == plain
    assert stats["pipelined_steps"] > 10, stats["pipelined_steps"]
    assert stats["speculation"]["accepted_tokens"] > 0  # the lone lane still drafted from the others
