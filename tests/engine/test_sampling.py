"""The batched sampler: greedy, penalties, filters, seeded draws, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.sampling import (
    SampleResult,
    apply_penalties,
    filtered_weights,
    make_generator,
    sample,
)
from strata.engine.types import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors run fastest on one thread (the machine is shared); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gens(seeds: list[int]) -> list[torch.Generator]:
    return [make_generator(s, 0, CPU) for s in seeds]


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int] | None = None
) -> SampleResult:
    b = logits.shape[0]
    generators = gens(seeds) if seeds is not None else [None] * b
    return sample(logits, params, [[] for _ in range(b)], generators)


# --- greedy -----------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = sample_rows(logits, [SamplingParams() for _ in range(6)])
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.logprobs == [None] * 6
    # The slow path (logprobs requested) agrees with the fast one.
    out = sample_rows(logits, [SamplingParams(logprobs=2) for _ in range(6)])
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    for extra in ({}, {"logprobs": 1}, {"presence_penalty": 0.5}):
        out = sample(logits, [SamplingParams(**extra)] * 2, [[2], [2]], [None, None])
        assert out.tokens.tolist() == [1, 0]


def test_greedy_rows_unaffected_by_sampled_neighbours() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(),
              SamplingParams(temperature=2.0, top_k=5)]
    out = sample_rows(logits, params, [3, 3, 3, 4])
    assert out.tokens[0] == logits[0].argmax() and out.tokens[2] == logits[2].argmax()


def test_caller_logits_not_modified() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    p = SamplingParams(temperature=0.7, top_p=0.5, repetition_penalty=1.3, frequency_penalty=0.4)
    sample(logits, [p, p], [[1, 2, 2], [3]], gens([1, 2]))
    assert torch.equal(logits, before)


# --- penalties ----------------------------------------------------------------

LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.5, 0.0, 4.0]])
PROMPT = [0, 1, 1]
OUTPUT = [2, 2, 3, 6]


def direct(params: SamplingParams, history: list[int], generated: list[int]) -> list[float]:
    """The penalties written out token by token from their definitions."""
    row = LOGITS[0].tolist()
    out = []
    for tok, x in enumerate(row):
        if tok in history:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        count = generated.count(tok)
        x -= params.frequency_penalty * count
        x -= params.presence_penalty * (1.0 if count > 0 else 0.0)
        out.append(x)
    return out


def close(a: list[float], b: list[float]) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-6)


def penalised(params: SamplingParams, prompt_lens: list[int] | None) -> list[float]:
    return apply_penalties(LOGITS, [params], [PROMPT + OUTPUT], prompt_lens)[0].tolist()


def test_repetition_penalty_hf_semantics() -> None:
    p = SamplingParams(repetition_penalty=1.5)
    got = penalised(p, [len(PROMPT)])
    assert close(got, direct(p, PROMPT + OUTPUT, OUTPUT))
    assert math.isclose(got[0], 2.0 / 1.5, rel_tol=1e-6) and got[1] == -1.5
    assert got[4] == 1.5  # 4 was never seen


def test_presence_penalty_counts_generated_only() -> None:
    p = SamplingParams(presence_penalty=0.75)
    got = penalised(p, [len(PROMPT)])
    assert close(got, direct(p, PROMPT + OUTPUT, OUTPUT))
    assert got[0] == 2.0 and got[2] == 0.5 - 0.75  # prompt token 0 untouched


def test_frequency_penalty_scales_with_count() -> None:
    p = SamplingParams(frequency_penalty=0.25)
    got = penalised(p, [len(PROMPT)])
    assert close(got, direct(p, PROMPT + OUTPUT, OUTPUT))
    assert got[2] == 0.5 - 2 * 0.25 and got[3] == -3.0 - 0.25 and got[1] == -1.0


def test_penalties_combined_and_without_prompt_split() -> None:
    p = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1)
    assert close(penalised(p, [len(PROMPT)]), direct(p, PROMPT + OUTPUT, OUTPUT))
    # Without prompt lengths the whole history counts as generated.
    assert close(penalised(p, None), direct(p, PROMPT + OUTPUT, PROMPT + OUTPUT))


def test_penalties_per_row_in_a_batch() -> None:
    rows = [SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=2.0),
            SamplingParams(presence_penalty=0.5)]
    hist = [[0, 5, 6, 6], [6], []]
    got = apply_penalties(LOGITS.repeat(3, 1), rows, hist, [1, 0, 0])
    for i, p in enumerate(rows):
        gen = hist[i][[1, 0, 0][i]:]
        assert close(got[i].tolist(), direct(p, hist[i], gen))


def test_penalty_changes_greedy_choice() -> None:
    # Token 6 (logit 4.0) was generated three times; a frequency penalty of 1 hands it to token 0.
    p = SamplingParams(frequency_penalty=1.0)
    out = sample(LOGITS, [p], [[6, 6, 6]], [None], prompt_lens=[0])
    assert out.tokens.tolist() == [0]
    out = sample(LOGITS, [p], [[6, 6, 6]], [None], prompt_lens=[3])  # they were prompt tokens
    assert out.tokens.tolist() == [6]


# --- filters ----------------------------------------------------------------


def support(logits: list[float], **kw) -> set[int]:
    p = SamplingParams(temperature=kw.pop("t", 1.0), **kw)
    w = filtered_weights(torch.tensor([logits]), [p])
    return set(torch.nonzero(w[0]).flatten().tolist())


def test_filters_exact_support() -> None:
    # probabilities proportional to 8, 4, 2, 1, 1 (token 4 ties token 3)
    x = [math.log(v) for v in (8.0, 4.0, 2.0, 1.0, 1.0)]
    assert support(x) == {0, 1, 2, 3, 4}
    assert support(x, top_k=2) == {0, 1}
    assert support(x, top_k=4) == {0, 1, 2, 3, 4}  # a tie at the edge is kept
    assert support(x, top_k=3) == {0, 1, 2}
    assert support(x, top_k=99) == {0, 1, 2, 3, 4}
    assert support(x, top_p=0.5) == {0}  # 8/16 reaches 0.5 exactly
    assert support(x, top_p=0.51) == {0, 1}
    assert support(x, top_p=0.0) == {0}
    assert support(x, top_k=3, top_p=0.9) == {0, 1, 2}  # 12/14 < 0.9 within the top 3
    assert support(x, top_k=3, top_p=0.8) == {0, 1}
    assert support(x, min_p=0.25) == {0, 1, 2}
    assert support(x, min_p=0.26) == {0, 1}
    assert support(x, min_p=1.0) == {0}
    # temperature sharpens before min_p: at t=0.5 the weights are 64, 16, 4, 1, 1
    assert support(x, t=0.5, min_p=0.2) == {0, 1}


def allowed(x: list[float], p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Tokens the filters may keep, from their definitions in float64 (with a little slack)."""
    v = len(x)
    z = [xi / p.temperature for xi in x]
    m = max(z)
    w = [math.exp(zi - m) for zi in z]
    vals = sorted(w, reverse=True)
    k = p.top_k if 0 < p.top_k < v else v
    floor = vals[k - 1]
    if p.top_p < 1.0:
        limit = (max(p.top_p, 0.0) + slack) * sum(vals[:k])
        cum, i = 0.0, 0
        for i in range(k):
            cum += vals[i]
            if cum >= limit:
                break
        floor = max(floor, vals[i])
    floor = max(floor, p.min_p - slack)
    return {i for i in range(v) if w[i] > 0 and w[i] >= floor}


GRID = st.integers(-48, 48).map(lambda i: i / 8)  # exact in float32, so no near-ties


@st.composite
def filter_cases(draw: st.DrawFn) -> tuple[list[float], SamplingParams]:
    v = draw(st.integers(2, 40))
    x = draw(st.lists(st.one_of(GRID, GRID, GRID, st.just(-math.inf)), min_size=v, max_size=v))
    x[draw(st.integers(0, v - 1))] = draw(GRID)  # at least one token can be drawn
    p = SamplingParams(
        temperature=draw(st.floats(0.05, 3.0)),
        top_k=draw(st.integers(0, v + 2)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    )
    return x, p


@settings(max_examples=100, deadline=None)
@given(filter_cases(), st.integers(0, 2**32))
def test_filters_only_produce_allowed_tokens(
    case: tuple[list[float], SamplingParams], seed: int
) -> None:
    x, p = case
    rows = 32
    logits = torch.tensor([x] * rows)
    out = sample_rows(logits, [p] * rows, [seed + i for i in range(rows)])
    assert set(out.tokens.tolist()) <= allowed(x, p)


@settings(max_examples=100, deadline=None)
@given(filter_cases(), st.integers(1, 8))
def test_nucleus_window_does_not_change_the_result(
    case: tuple[list[float], SamplingParams], window: int
) -> None:
    """Sorting only the best few weights (then all, where the nucleus spills over) is exact."""
    x, p = case
    logits = torch.tensor([x, x[::-1]])
    params = [p, SamplingParams(temperature=p.temperature, top_p=p.top_p)]
    full = filtered_weights(logits, params, window=len(x))
    assert torch.equal(filtered_weights(logits, params, window=window), full)
    assert set(torch.nonzero(full[0]).flatten().tolist()) <= allowed(x, p)


def test_large_vocab_nucleus_spills_past_the_window() -> None:
    # 3000 distinct logits, flat enough that the 0.9 nucleus holds far more than the window.
    x = torch.linspace(0.0, -3.0, 3000)
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(0))
    logits = x[perm].unsqueeze(0)
    got = filtered_weights(logits, [SamplingParams(temperature=1.0, top_p=0.9)], window=64)
    kept = set(torch.nonzero(got[0]).flatten().tolist())
    w = torch.exp(x.double())
    n = int((torch.cumsum(w, 0) < 0.9 * w.sum()).sum()) + 1  # best-first prefix reaching 0.9
    assert 64 < n < 3000
    assert abs(len(kept) - n) <= 1
    assert kept == set(perm.argsort()[: len(kept)].tolist())  # exactly the best ones


# --- seeded draws -------------------------------------------------------------


FILTERED = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=1234, repetition_penalty=1.1)
PLAIN = SamplingParams(temperature=1.1, min_p=0.01, seed=77)
FLAT = SamplingParams(temperature=4.0, top_p=0.98, seed=5)  # nucleus wider than the window


def decode_run(company: int, mine: SamplingParams, steps: int = 12) -> list[int]:
    """Sample `steps` tokens for a seeded request, with `company` other rows beside it."""
    vocab = 2000
    logit_gen = torch.Generator().manual_seed(99)
    others = [
        SamplingParams(temperature=1.3, seed=7),
        SamplingParams(),
        SamplingParams(temperature=0.5, min_p=0.1, logprobs=3),
        SamplingParams(temperature=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=5, seed=11),
        SamplingParams(logprobs=0, presence_penalty=1.0),
        SamplingParams(temperature=2.0, top_p=0.5),
    ][:company]
    params = [*others[: company // 2], mine, *others[company // 2:]]
    me = company // 2
    generators = [make_generator(p.seed, 1000 + i, CPU) for i, p in enumerate(params)]
    histories: list[list[int]] = [[1, 2, 3] for _ in params]
    mine_tokens = []
    base = torch.randn(steps, vocab, generator=logit_gen) * 3
    for step in range(steps):
        logits = torch.randn(len(params), vocab, generator=logit_gen) * 3
        logits[me] = base[step]
        out = sample(logits, params, histories, generators, prompt_lens=[3] * len(params))
        for h, t in zip(histories, out.tokens.tolist()):
            h.append(t)
        mine_tokens.append(out.tokens[me].item())
    return mine_tokens


@pytest.mark.parametrize("mine", [FILTERED, PLAIN, FLAT], ids=["top-k-p", "min-p", "flat-top-p"])
def test_seeded_run_is_reproducible_and_independent_of_batch(mine: SamplingParams) -> None:
    alone = decode_run(0, mine)
    assert len(set(alone)) > 3  # really sampled, not stuck on one token
    assert decode_run(0, mine) == alone
    assert decode_run(7, mine) == alone
    assert decode_run(3, mine) == alone


def test_batch_independence_with_two_threads() -> None:
    """Intra-op parallelism must not change a row's bits either."""
    torch.set_num_threads(2)
    for mine in (FILTERED, FLAT):
        assert decode_run(7, mine, steps=4) == decode_run(0, mine, steps=4)


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0)
    a = sample(logits.repeat(4, 1), [p] * 4, [[]] * 4, gens([1, 1, 1, 1])).tokens.tolist()
    b = sample(logits.repeat(4, 1), [p] * 4, [[]] * 4, gens([2, 2, 2, 2])).tokens.tolist()
    assert len(set(a)) == 1 and len(set(b)) == 1  # same seed, same token
    assert a != b


def test_make_generator_seed_and_fallback() -> None:
    def first(g: torch.Generator) -> float:
        return torch.rand(1, generator=g).item()

    assert first(make_generator(5, 0, CPU)) == first(make_generator(5, 9, CPU))
    assert first(make_generator(None, 9, CPU)) == first(make_generator(9, 0, CPU))
    assert first(make_generator(-1, 0, CPU)) == first(make_generator(2**64 - 1, 0, CPU))


def chi_square(tokens: list[int], probs: list[float]) -> float:
    n = len(tokens)
    counts = [tokens.count(i) for i in range(len(probs))]
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_temperature_sampling_follows_distribution() -> None:
    x = [0.0, 1.0, 2.0, -1.0]
    t = 0.7
    n = 4000
    probs = torch.softmax(torch.tensor(x) / t, 0).tolist()
    g = make_generator(2024, 0, CPU)
    out = sample(torch.tensor([x] * n), [SamplingParams(temperature=t)] * n, [[]] * n, [g] * n)
    # 3 degrees of freedom: 16.27 is the 0.1% point
    assert chi_square(out.tokens.tolist(), probs) < 16.27
    # a wrong temperature (1.0) is clearly rejected by the same statistic
    assert chi_square(out.tokens.tolist(), torch.softmax(torch.tensor(x), 0).tolist()) > 50


def test_top_k_sampling_renormalises_survivors() -> None:
    x = [0.0, 1.0, 2.0, -1.0, 0.5]
    n = 4000
    g = make_generator(7, 0, CPU)
    p = SamplingParams(temperature=1.0, top_k=3)
    out = sample(torch.tensor([x] * n), [p] * n, [[]] * n, [g] * n)
    kept = torch.tensor([x[1], x[2], x[4]])
    p = torch.softmax(kept, 0).tolist()
    probs = [0.0, p[0], p[1], 0.0, p[2]]
    tokens = out.tokens.tolist()
    assert set(tokens) == {1, 2, 4}
    assert chi_square(tokens, probs) < 13.82  # 2 degrees of freedom, 0.1% point


# --- logprobs -----------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 2
    params = [
        SamplingParams(temperature=0.8, repetition_penalty=1.5, logprobs=5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, params, [[1, 2], [3], []], gens([1, 2, 3]))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for row in (0, 1):
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.token_id == out.tokens[row].item()
        assert math.isclose(lp.logprob, ref[row, lp.token_id].item(), abs_tol=1e-6)
    top = out.logprobs[0].top
    assert len(top) == 5 and out.logprobs[1].top == []
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    for t, v in top:
        assert math.isclose(v, ref[0, t].item(), abs_tol=1e-6)


def test_logprobs_with_text() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = sample(logits, [SamplingParams(logprobs=2)], [[]], [None])
    tl = out.logprobs[0].with_text(lambda t: "abc"[t])
    assert tl.token_id == 1 and tl.text == "b"
    assert [(t, s) for t, s, _ in tl.top] == [(1, "b"), (2, "c")]


def test_top_logprobs_list_tied_tokens_in_greedy_order() -> None:
    """With tied logits, the first alternative is the token greedy decoding picks."""
    from strata.engine.sampling import sample

    logits = torch.zeros(1, 50)
    logits[0, [7, 3, 40]] = 5.0
    res = sample(logits, [SamplingParams(logprobs=3)], [[]], [None])
    assert res.tokens.tolist() == [3]
    assert [t for t, _ in res.logprobs[0].top] == [3, 7, 40]


# --- degenerate temperatures and scores ---------------------------------------


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-6, float("nan")])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    logits = torch.tensor([[0.5, -3.0, 2.5, 2.4, -1.0], [-2.0, -1.0, -9.0, -0.5, -4.0]])
    params = [SamplingParams(temperature=temperature, seed=1)] * 2
    assert params[0].greedy
    assert sample_rows(logits, params, seeds=[1, 2]).tokens.tolist() == [2, 3]


def test_non_finite_scores_never_reach_the_draw() -> None:
    inf, nan = float("inf"), float("nan")
    scores = torch.tensor([[1.0, inf, 0.0, inf], [nan, 2.0, nan, 1.0], [nan, nan, nan, nan],
                           [-inf, -inf, -inf, -inf]])
    weights = filtered_weights(scores, [SamplingParams(temperature=1.0)] * 4)
    assert torch.isfinite(weights).all()
    assert weights[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert weights[1, 0] == 0 and weights[1, 1] == 1 and weights[1, 2] == 0
    assert weights[2].tolist() == [1.0, 0.0, 0.0, 0.0] and weights[3].tolist() == [1.0, 0.0, 0.0, 0.0]
    tokens = sample_rows(scores, [SamplingParams(temperature=0.7)] * 4, seeds=[1, 2, 3, 4]).tokens.tolist()
    assert tokens[0] in (1, 3) and tokens[1] in (1, 3) and tokens[2:] == [0, 0]
