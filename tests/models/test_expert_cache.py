"""The expert cache gives the bits of all experts resident, whatever few slots it has."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_hf_model

from strata.models import load_model
from strata.models.experts import CacheStats, ExpertCache, install_expert_cache
from strata.models.moe import SparseMLP


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_moe")
    tiny_hf_model("qwen2_moe").save_pretrained(folder)
    return load_model(str(folder), device="cpu", dtype="bfloat16", progress=False).model


class _OneLayer(torch.nn.Module):
    """What install_expert_cache walks (`.layers[i].mlp`), around one sparse MLP."""

    def __init__(self, mlp: SparseMLP) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.mlp = mlp
        self.layers = torch.nn.ModuleList([layer])


def _steps(seed: int) -> list[torch.Tensor]:
    """Inputs of a prompt (17 rows: more experts than slots) and then one-row decode steps."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 64, generator=g).to(torch.bfloat16) for n in (17, 1, 1, 3, 1, 1, 1, 9, 1)]


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_cache_equals_all_resident(moe_model, slots: int) -> None:
    ref = moe_model.layers[0].mlp
    assert isinstance(ref, SparseMLP)
    cached = copy.deepcopy(ref)
    stats = CacheStats()
    install_expert_cache(_OneLayer(cached), slots, torch.device("cpu"), stats)
    assert isinstance(cached.experts, ExpertCache) and cached.experts.num_slots == slots
    needs = 0
    with torch.inference_mode():
        for x in _steps(0):
            ids, _ = ref.route(x)
            needs += len(set(ids.view(-1).tolist()))
            assert torch.equal(cached.forward(x), ref.forward(x))
    assert stats.hits + stats.misses == needs and stats.misses >= 1
    assert stats.bytes_uploaded == stats.misses * cached.experts.expert_bytes
    assert len(cached.experts.resident()) == slots


def test_cache_negative_control(moe_model) -> None:
    """One wrong byte in one host expert shows up in the tokens that use it."""
    ref = moe_model.layers[0].mlp
    cached = copy.deepcopy(ref)
    install_expert_cache(_OneLayer(cached), 2, torch.device("cpu"), CacheStats())
    x = _steps(1)[0]
    ids, _ = ref.route(x)
    with torch.inference_mode():
        cached.experts.host_tensors()[2][int(ids[0, 0])] *= 1.02
        assert not torch.equal(cached.forward(x), ref.forward(x))


def test_full_model_with_a_cache_keeps_its_greedy_tokens(tmp_path) -> None:
    from dense_context import greedy
    from tiny_models import PROMPT

    tiny_hf_model("qwen3_moe").save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="bfloat16", progress=False)
    want = greedy(loaded, PROMPT, 12)
    stats = CacheStats()
    install_expert_cache(loaded.model, 3, torch.device("cpu"), stats)
    assert greedy(loaded, PROMPT, 12) == want
    assert stats.slots == {0: 3, 1: 3} and 0 < stats.hit_rate() < 1


def test_slots_must_fit() -> None:
    with pytest.raises(ValueError, match="0 slots"):
        ExpertCache(None, [torch.zeros(4, 2, 2)], 0, torch.device("cpu"), 0, CacheStats())


def test_uploads_past_the_cap_stay_on_the_host() -> None:
    from strata.models.experts import uploads_and_host

    routed = [3, 5, 5, 7, 7, 7, 9]
    assert uploads_and_host([3, 5, 7, 9], routed, None) == ([3, 5, 7, 9], [])
    assert uploads_and_host([3, 5, 7, 9], routed, 4) == ([3, 5, 7, 9], [])
    assert uploads_and_host([3, 5, 7, 9], routed, 2) == ([5, 7], [3, 9])  # the most-used copied
    assert uploads_and_host([3, 9], routed, 1) == ([3], [9])  # a tie: the lower id
    assert uploads_and_host([3, 5], routed, 0) == ([], [3, 5])


@pytest.mark.parametrize("cap", [0, 1])
def test_a_capped_cache_computes_the_rest_on_the_host(moe_model, cap: int) -> None:
    """With at most `cap` uploads a step, the other misses are computed from the host tensors;
    on the CPU (the host's kernels on both sides) the bits are all-resident's."""
    ref = moe_model.layers[0].mlp
    cached = copy.deepcopy(ref)
    stats = CacheStats()
    install_expert_cache(_OneLayer(cached), 2, torch.device("cpu"), stats, max_uploads=cap)
    with torch.inference_mode():
        for x in _steps(2):
            assert torch.equal(cached.forward(x), ref.forward(x))
    assert stats.host_computed > 0
    assert stats.bytes_uploaded == (stats.misses - stats.host_computed) * cached.experts.expert_bytes
    if cap == 0:  # everything from the host tensors: one wrong byte there shows (negative control)
        assert stats.bytes_uploaded == 0 and not cached.experts.resident()
        x = _steps(3)[0]
        ids, _ = ref.route(x)
        with torch.inference_mode():
            cached.experts.host_tensors()[2][int(ids[0, 0])] *= 1.02
            assert not torch.equal(cached.forward(x), ref.forward(x))


def test_a_capped_cache_of_packed_blocks_is_refused() -> None:
    from strata.errors import BadRequest

    class Packed:
        packed = True

    with pytest.raises(BadRequest, match="--expert-uploads: .*packed"):
        ExpertCache(Packed(), [torch.zeros(4, 2, 2)], 2, torch.device("cpu"), 0, CacheStats(), max_uploads=1)


def test_prefetched_experts_are_hits(moe_model) -> None:
    """Experts copied in ahead (`prefetch`) are resident when their step comes: no misses, the
    copies counted as prefetched and used; without the prefetch the same step misses (the
    negative control). The products stay all-resident's."""
    ref = moe_model.layers[0].mlp
    x = _steps(4)[1]  # one decode row: k experts
    ids, _ = ref.route(x)
    need = sorted(set(ids.view(-1).tolist()))
    for ahead in (False, True):
        cached = copy.deepcopy(ref)
        stats = CacheStats()
        install_expert_cache(_OneLayer(cached), len(need), torch.device("cpu"), stats)
        if ahead:
            cached.experts.prefetch(need + need[:1])  # repeats and all: at most the slots
            assert stats.prefetched == len(need) and sorted(cached.experts.resident()) == need
        with torch.inference_mode():
            assert torch.equal(cached.forward(x), ref.forward(x))
        assert stats.misses == (0 if ahead else len(need))
        assert stats.prefetch_used == (len(need) if ahead else 0)


def test_prefetch_fills_at_most_the_slots_and_keeps_the_bits(moe_model) -> None:
    """More predicted experts than slots: as many as fit are copied in, the step's own misses
    still evict them as needed; a two-layer chain that looks ahead gives all-resident's bits."""
    ref = moe_model.layers[0].mlp
    cached = copy.deepcopy(ref)
    stats = CacheStats()
    install_expert_cache(_OneLayer(cached), 2, torch.device("cpu"), stats)
    cached.experts.prefetch([0, 1, 2, 3, 4])
    assert stats.prefetched == 2 and sorted(cached.experts.resident()) == [0, 1]
    cached.experts.prefetch([0, 1, 2, 3, 4])  # both of its slots hold predicted experts already
    assert stats.prefetched == 2
    with torch.inference_mode():
        for x in _steps(5):
            assert torch.equal(cached.forward(x), ref.forward(x))

    class _TwoLayers(torch.nn.Module):
        def __init__(self, a: SparseMLP, b: SparseMLP) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
            self.layers[0].mlp, self.layers[1].mlp = a, b

    a, b = copy.deepcopy(ref), copy.deepcopy(ref)  # the tiny model's one sparse layer, twice
    stats = CacheStats()
    install_expert_cache(_TwoLayers(a, b), 2, torch.device("cpu"), stats, prefetch=True)
    assert a.experts.ahead is not None and b.experts.ahead is None
    with torch.inference_mode():
        for x in _steps(6):
            assert torch.equal(b.forward(a.forward(x)), ref.forward(ref.forward(x)))
    assert stats.prefetched > 0
