"""Gated DeltaNet through flash-linear-attention's kernels on CUDA against the torch reference.

`GatedDeltaNet.mix_spans_fla` (FLA's conv1d, chunked and fused recurrent delta rule over the
step's spans as varlen rows) and `mix_spans_torch` (deltanet.py's loops) from the same inputs
and states: outputs and final states agree within TOLERANCE, relative to each sequence's
largest reference value, for one long prompt, several prompts of different lengths from
nonzero states, a decode step of 8 sequences, and a mix. A wrong initial state must not pass.

`python -m tests.gpu.test_gpu_deltanet` prints, as JSON lines, the two paths' times and errors
on a Qwen3-Next-80B-shaped layer (docs/PERFORMANCE.md); `... warm` calls each once (FLA's
compile and autotune, kept in Triton's caches on the machine).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.kv.state import StatePool
from strata.models.base import ModelConfig
from strata.models.deltanet import GatedDeltaNet
from strata.models.deltanet_fla import backend_for, fla_kernels
from tests.models.cut_states import CutStates, parts_read_alone
from tests.models.tiny_models import PROMPT, save_byte_tokenizer, save_tiny

if __name__ != "__main__":
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    if fla_kernels() is None:
        pytest.skip("needs flash-linear-attention (pip install 'strata[gpu]')", allow_module_level=True)

# max |fla - torch| / max |torch| per sequence, in bf16 (the serving dtype): FLA rounds q, k, v,
# the normalized q and k and the state to bf16 inside its products, the reference computes in
# float32 from the same bf16 inputs. (float32 and the tiny model's head dims of 8 and 12 run
# through the engine in test_gpu_hybrid.py: each dtype and shape costs FLA a full autotune.)
TOLERANCE = 2e-2
DTYPE = torch.bfloat16

LAYOUTS = {  # name -> (lengths, which sequences start fresh (zero state))
    "one_long_prompt": ([1000], [True]),
    "prompts_from_states": ([37, 64, 129, 5, 300], [False] * 5),
    "decode_8": ([1] * 8, [False] * 8),
    "mix": ([1, 70, 1, 1, 33, 2, 1, 200], [False, True, False, False, False, False, True, False]),
}
SHAPE = (2, 4, 128, 128)  # key heads, value heads, key dim, value dim: value heads grouped by 2


def make_layer(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, hidden: int = 64,
               seed: int = 0) -> GatedDeltaNet:
    """A DeltaNet layer with random weights of realistic scale on CUDA."""
    cfg = ModelConfig(arch="qwen3_next", vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, layer_types=("linear_attention",),
                      linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                      linear_value_head_dim=dv, linear_conv_kernel=4, rms_norm_eps=1e-6)
    layer = GatedDeltaNet(cfg, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.0, math.log(16.0), generator=gen))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.startswith("norm"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return layer.to("cuda", dtype)


def make_inputs(layer: GatedDeltaNet, lengths: list[int], fresh: list[bool], dtype: torch.dtype,
                seed: int = 1) -> tuple[torch.Tensor, ...]:
    """mixed, b, a for the step's rows and each sequence's conv tail and matrix state."""
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lengths), len(lengths)
    mixed = torch.randn(t, layer.conv_dim, generator=gen)
    b = torch.randn(t, layer.hv, generator=gen)
    a = torch.randn(t, layer.hv, generator=gen)
    conv = torch.randn(n, layer.conv_dim, layer.kernel - 1, generator=gen).to(dtype).float()
    ssm = 0.3 * torch.randn(n, layer.hv, layer.dk, layer.dv, generator=gen)
    zero = torch.tensor(fresh)
    conv[zero], ssm[zero] = 0, 0
    return (*(x.to("cuda", dtype) for x in (mixed, b, a)), conv.cuda(), ssm.cuda())


def spans_of(lengths: list[int]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(starts, lengths))


def per_sequence_error(got: torch.Tensor, ref: torch.Tensor, spans: list[tuple[int, int]] | None) -> float:
    """The largest over sequences of max |got - ref| / max |ref| (rows by spans, or dim 0)."""
    parts = [(slice(s, s + n),) for s, n in spans] if spans else [(i,) for i in range(ref.shape[0])]
    return max(((got[p].float() - ref[p].float()).abs().max() / ref[p].float().abs().max().clamp_min(1e-12)).item()
               for p in parts)


def compare(layout: str, wrong_state: bool = False, shape: tuple[int, int, int, int] = SHAPE,
            dtype: torch.dtype = DTYPE) -> dict[str, float]:
    """Errors of the FLA path against the torch reference (output, conv tails, matrix states).

    wrong_state: FLA starts from states of the wrong sequence (rolled by one): the control."""
    lengths, fresh = LAYOUTS[layout]
    layer = make_layer(*shape, dtype)
    mixed, b, a, conv, ssm = make_inputs(layer, lengths, fresh, dtype)
    spans = spans_of(lengths)
    with torch.inference_mode():
        ref = layer.mix_spans_torch(mixed, b, a, conv, ssm, spans)
        if wrong_state:
            conv, ssm = conv.roll(1, 0), ssm.roll(1, 0) + 0.3
        got = layer.mix_spans_fla(mixed, b, a, conv, ssm, spans)
    return {"out": per_sequence_error(got[0], ref[0], spans), "conv": per_sequence_error(got[1], ref[1], None),
            "ssm": per_sequence_error(got[2], ref[2], None)}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fla_matches_the_torch_reference(layout: str) -> None:
    errors = compare(layout)
    print(f"\n{layout}: {errors}")  # the figures docs/PERFORMANCE.md quotes (pytest -s)
    assert max(errors.values()) < TOLERANCE, errors


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [0, 1], ids=["exact", "control"])
def test_fla_cut_points_inside_a_step_are_steps_ending_there(shift: int) -> None:
    """Through FLA (one convolution over the whole spans, the tails at the cuts taken from the
    inputs), against each sequence read by `mix_spans_fla` in steps ending at its cuts: the
    convolution tails handed over at the cuts are the same bits; the matrix states at the cuts,
    the outputs and the final states agree within TOLERANCE (FLA's convolution may round a row
    whose inputs come from its initial state otherwise than one whose inputs are in the span).
    The control compares the handed-over states with steps ending one row later."""
    layer = make_layer(*SHAPE, DTYPE)
    lengths = [150, 1, 70, 9]
    cuts = [(4, 149), (), (1, 64, 69), (3,)]
    mixed, b, a, conv, ssm = make_inputs(layer, lengths, [False] * 4, DTYPE)
    spans = spans_of(lengths)
    ctx = CutStates(spans, cuts)

    def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
        return per_sequence_error(got[None], ref[None], None) < TOLERANCE

    with torch.inference_mode():
        out, c, s = layer.mix_cut_fla(mixed, b, a, conv, ssm, ctx)
        assert sorted(ctx.kept) == [(0, 4), (0, 149), (2, 1), (2, 64), (2, 69), (3, 3)]
        for i, r, done, o, sc, ss in parts_read_alone(layer.mix_spans_fla, mixed, b, a, conv, ssm, ctx, shift):
            if not shift:
                assert close(out[r], o), (i, r)
            if (i, done - shift) in ctx.kept:
                kept = ctx.kept[(i, done - shift)]
                assert torch.equal(kept["conv"], sc) == (not shift), (i, done)
                if not shift:
                    assert close(kept["ssm"], ss), (i, done)
            if not shift and done == spans[i][1]:  # the sequence's last part: the step's final states
                assert torch.equal(c[i], sc) and close(s[i], ss)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["prompts_from_states", "decode_8", "mix"])
def test_a_wrong_initial_state_is_caught(layout: str) -> None:
    errors = compare(layout, wrong_state=True)
    assert errors["out"] > 10 * TOLERANCE, errors
    assert errors["ssm"] > 10 * TOLERANCE, errors


@pytest.mark.gpu
def test_the_layer_takes_fla_on_cuda_and_keeps_each_lane_state() -> None:
    """forward through a StatePool step: lanes out of order, one fresh, states saved in place."""
    dtype = DTYPE
    layer = make_layer(*SHAPE, dtype)
    assert backend_for(torch.device("cuda"), DTYPE) == "fla"
    pool = StatePool({0: layer.state_shapes()}, 4, "cuda")
    gen = torch.Generator().manual_seed(3)
    for t in pool.layers[0].values():
        t.copy_(0.3 * torch.randn(t.shape, generator=gen))
    pool.layers[0]["conv"].copy_(pool.layers[0]["conv"].to(dtype).float())
    before = {name: t.clone() for name, t in pool.layers[0].items()}
    lengths, lanes, fresh = [1, 40, 1, 9], [2, 0, 3, 1], [False, False, False, True]
    spans = spans_of(lengths)
    x = torch.randn(sum(lengths), 64, generator=gen).to("cuda", dtype)
    with torch.inference_mode():
        out = layer.forward(x, pool.step(spans, lanes, fresh))
        mixed, z, b, a = layer._split(x)
        idx = torch.tensor(lanes, device="cuda")
        conv0, ssm0 = before["conv"][idx], before["ssm"][idx]
        conv0[3], ssm0[3] = 0, 0
        core, conv, ssm = layer.mix_spans_torch(mixed, b, a, conv0, ssm0, spans)
        ref = layer.out_proj.forward(layer.norm.forward(core, z).reshape(x.shape[0], -1))
    assert per_sequence_error(out, ref, spans) < TOLERANCE
    assert per_sequence_error(pool.layers[0]["conv"][idx], conv, None) < TOLERANCE
    assert per_sequence_error(pool.layers[0]["ssm"][idx], ssm, None) < TOLERANCE


def _time_ms(fn, reps: int = 10) -> float:
    """Median milliseconds of fn() on the GPU, after warm-up (FLA autotunes on its first calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.mark.gpu
def test_the_engine_in_bf16_repeats_an_answer_through_a_checkpoint(tmp_path) -> None:
    """The tiny Qwen3-Next (head dims 8 and 12) served in bf16 through FLA: a repeat resumes from
    the checkpoint one token before the prompt's end and must give the same tokens, so the
    kernels read a sequence in pieces deterministically."""
    assert backend_for(torch.device("cuda"), DTYPE) == "fla"
    save_tiny("qwen3_next", tmp_path)
    save_byte_tokenizer(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", weights="dense", parallel=1,
                       max_context=128, prefill_chunk=8)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(cfg) as eng:
        first = eng.complete(PROMPT, greedy)
        again = eng.complete(PROMPT, greedy)
        stats = eng.stats()
    assert again.token_ids == first.token_ids
    assert stats["checkpoints"]["restores"] >= 1


def bench(timing: bool = True) -> None:
    """Each case's errors (the test's shape), then both paths on a Qwen3-Next-80B-shaped layer
    (16 key heads, 32 value heads of 128, kernel 4, hidden 2048, bf16): a 4096-token prompt
    from zero state and a decode step of 64 lanes. One JSON line per result, as it comes.

    timing=False: one call of each (FLA compiles and autotunes, into Triton's disk caches)."""
    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)

    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fla": fla_kernels().version})
    dtype = torch.bfloat16
    layer = make_layer(16, 32, 128, 128, dtype, hidden=2048)
    for name, lengths, fresh in [("prompt_4096", [4096], [True]), ("decode_64", [1] * 64, [False] * 64)]:
        mixed, b, a, conv, ssm = make_inputs(layer, lengths, fresh, dtype)
        spans = spans_of(lengths)
        pool = StatePool({0: layer.state_shapes()}, len(lengths), "cuda")
        x = torch.randn(sum(lengths), 2048, device="cuda", dtype=dtype)
        with torch.inference_mode():
            ref = layer.mix_spans_torch(mixed, b, a, conv, ssm, spans)
            got = layer.mix_spans_fla(mixed, b, a, conv, ssm, spans)
            layer.forward(x, pool.step(spans, list(range(len(lengths))), fresh))
            row = {"case": name, "shape": "hk16 hv32 dk128 dv128 conv4 hidden2048 bf16",
                   "out_error": per_sequence_error(got[0], ref[0], spans),
                   "ssm_error": per_sequence_error(got[2], ref[2], None)}
            if timing:
                row["fla_ms"] = _time_ms(lambda: layer.mix_spans_fla(mixed, b, a, conv, ssm, spans))
                row["torch_ms"] = _time_ms(lambda: layer.mix_spans_torch(mixed, b, a, conv, ssm, spans))
                row["speedup"] = row["torch_ms"] / row["fla_ms"]
                row["layer_forward_fla_ms"] = _time_ms(
                    lambda: layer.forward(x, pool.step(spans, list(range(len(lengths))), fresh)))
        emit(row)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    bench(timing="warm" not in sys.argv[1:])
