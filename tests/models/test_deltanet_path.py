"""Which code runs the gated DeltaNet layers: the torch reference on the CPU and for float32
(FLA's kernels need CUDA and run bf16 / fp16 here, tests/gpu/test_gpu_deltanet.py), and the
varlen layout the FLA path reads the spans as."""

from __future__ import annotations

import sys

import pytest
import torch

from strata.models.deltanet_fla import backend_for, varlen_layout
from tests.models.cut_states import CutStates, parts_read_alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_cpu_takes_the_torch_path_without_importing_fla(dtype: torch.dtype) -> None:
    had_fla = "fla" in sys.modules
    assert backend_for(torch.device("cpu"), dtype) == "torch"
    assert ("fla" in sys.modules) == had_fla


def test_float32_takes_the_torch_path_on_cuda_too() -> None:
    """FLA's float32 products are TF32; float32 is held to the CPU's tokens (docs/GPU.md)."""
    assert backend_for(torch.device("cuda"), torch.float32) == "torch"


def test_spans_become_cu_seqlens_with_decode_rows_apart() -> None:
    spans = ((0, 1), (1, 5), (6, 1), (7, 3))
    layout = varlen_layout(spans, torch.device("cpu"))
    assert layout.num_rows == 10
    assert layout.cu_all.tolist() == [0, 1, 6, 7, 10]
    assert layout.single.tolist() == [0, 2] and layout.single_rows.tolist() == [0, 6]
    assert layout.multi.tolist() == [1, 3] and layout.multi_rows.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert layout.cu_multi.tolist() == [0, 5, 8]


def test_prompts_alone_need_no_gather_and_decode_alone_no_chunks() -> None:
    prompts = varlen_layout(((0, 4), (4, 2)), torch.device("cpu"))
    assert prompts.single is None and prompts.multi_rows is None
    assert prompts.cu_multi.tolist() == [0, 4, 6]
    decode = varlen_layout(((0, 1), (1, 1)), torch.device("cpu"))
    assert decode.multi is None and decode.single.tolist() == [0, 1]


@pytest.mark.parametrize("spans", [((1, 2),), ((0, 2), (3, 1)), ((0, 0),)])
def test_spans_out_of_order_are_refused(spans: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError):
        varlen_layout(spans, torch.device("cpu"))


def test_the_convolution_blocks_are_the_layout_s_own() -> None:
    """FLA's causal_conv1d takes its (sequence, block of 64 rows) pairs from the layout, which
    keeps them alive for a captured graph, instead of a cache of FLA's that forgets them."""
    layout = varlen_layout(((0, 1), (1, 130), (131, 64)), torch.device("cpu"))
    assert layout.conv_chunks.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0]]
    # the chunked delta rule's, over the longer spans only (numbered among themselves)
    assert layout.multi_chunks.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert varlen_layout(((0, 1), (1, 1)), torch.device("cpu")).multi_chunks is None


def test_a_decode_layout_lives_as_long_as_the_process() -> None:
    spans = tuple((i, 1) for i in range(5))
    first = varlen_layout(spans, torch.device("cpu"))
    for n in range(2, 40):  # more layouts than the bounded cache of other steps holds
        varlen_layout(((0, n),), torch.device("cpu"))
    assert varlen_layout(spans, torch.device("cpu")) is first


def _layer():
    from strata.models.base import ModelConfig
    from strata.models.deltanet import GatedDeltaNet

    cfg = ModelConfig(arch="qwen3_next", vocab_size=256, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, layer_types=("linear_attention",),
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel=4, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return layer


def test_a_decode_step_computes_as_its_rows_among_a_prompt() -> None:
    """The one-row fast path (no index tensors, so a graph can capture it) gives the bits the
    general path gives the same rows when a prompt shares the step; a different state shows."""
    layer = _layer()
    g = torch.Generator().manual_seed(1)
    n, t = 3, 3 + 5
    mixed = torch.randn(t, layer.conv_dim, generator=g)
    b, a = torch.randn(t, layer.hv, generator=g), torch.randn(t, layer.hv, generator=g)
    conv = torch.randn(n + 1, layer.conv_dim, layer.kernel - 1, generator=g)
    ssm = 0.3 * torch.randn(n + 1, layer.hv, layer.dk, layer.dv, generator=g)
    decode = [(i, 1) for i in range(n)]
    out, c, s = layer.mix_spans_torch(mixed[:n], b[:n], a[:n], conv[:n], ssm[:n], decode)
    ref_out, ref_c, ref_s = layer.mix_spans_torch(mixed, b, a, conv, ssm, decode + [(n, 5)])
    assert torch.equal(out, ref_out[:n]) and torch.equal(c, ref_c[:n]) and torch.equal(s, ref_s[:n])
    other, _, _ = layer.mix_spans_torch(mixed[:n], b[:n], a[:n], conv[:n], ssm[:n].flip(0), decode)
    assert not torch.equal(other, out)


@pytest.mark.parametrize("shift", [0, 1], ids=["exact", "control"])
@torch.no_grad()
def test_cut_points_inside_a_step_are_steps_ending_there(shift: int) -> None:
    """A step whose prompt pieces carry cut points (a piece of 11 rows cut after 4 and 10, a
    decode row, a piece of 6 cut after 1) gives, bit for bit, the outputs and final states of each
    sequence read alone in steps ending at its cuts, and hands over the state at each cut. The
    control compares the handed-over states with steps ending one row later: they differ."""
    layer = _layer()
    g = torch.Generator().manual_seed(2)
    spans, cuts = [(0, 11), (11, 1), (12, 6)], [(4, 10), (), (1,)]
    t, n = 18, 3
    mixed = torch.randn(t, layer.conv_dim, generator=g)
    b, a = torch.randn(t, layer.hv, generator=g), torch.randn(t, layer.hv, generator=g)
    conv = torch.randn(n, layer.conv_dim, layer.kernel - 1, generator=g)
    ssm = 0.3 * torch.randn(n, layer.hv, layer.dk, layer.dv, generator=g)
    ctx = CutStates(spans, cuts)
    out, c, s = layer.mix_cut(layer.mix_spans_torch, mixed, b, a, conv, ssm, ctx)
    assert sorted(ctx.kept) == [(0, 4), (0, 10), (2, 1)]
    for i, r, done, o, sc, ss in parts_read_alone(layer.mix_spans_torch, mixed, b, a, conv, ssm, ctx, shift):
        if not shift:
            assert torch.equal(out[r], o)
        if (i, done - shift) in ctx.kept:
            kept = ctx.kept[(i, done - shift)]
            assert (torch.equal(kept["conv"], sc) and torch.equal(kept["ssm"], ss)) == (not shift)
        if not shift and done == spans[i][1]:  # the sequence's last part: the step's final states
            assert torch.equal(c[i], sc) and torch.equal(s[i], ss)


@pytest.mark.parametrize("shift", [0, 1], ids=["exact", "control"])
@torch.no_grad()
def test_the_fla_glue_computes_what_the_torch_path_does(shift: int) -> None:
    """FLA's kernels replaced by the torch reference with FLA's signatures (`fake_fla.py`): a
    step of decode rows and prompts through `mix_spans_fla`, and a step with cut points through
    `mix_cut` (one convolution over the whole spans, the tails at the cuts taken from the inputs,
    the delta rule in rounds), give the torch path's convolution tails bit for bit, and its
    outputs and matrix states to float32 rounding (the stand-in's products see other memory
    layouts than the torch path's, which moves BLAS's last bits). The control cuts the torch
    path's pieces one row later: the tails handed over differ."""
    from unittest import mock

    from strata.models import deltanet
    from tests.models.fake_fla import KERNELS

    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return torch.allclose(x, y, rtol=1e-5, atol=1e-6)

    layer = _layer()
    g = torch.Generator().manual_seed(3)
    spans = [(0, 1), (1, 70), (71, 1), (72, 130), (202, 5)]
    t, n = 207, 5
    mixed = torch.randn(t, layer.conv_dim, generator=g)
    b, a = torch.randn(t, layer.hv, generator=g), torch.randn(t, layer.hv, generator=g)
    conv = torch.randn(n, layer.conv_dim, layer.kernel - 1, generator=g)
    ssm = 0.3 * torch.randn(n, layer.hv, layer.dk, layer.dv, generator=g)
    with mock.patch.object(deltanet, "fla_kernels", lambda: KERNELS):
        if not shift:
            out, c, s = layer.mix_spans_fla(mixed, b, a, conv, ssm, spans)
            want = layer.mix_spans_torch(mixed, b, a, conv, ssm, spans)
            assert close(out, want[0]) and torch.equal(c, want[1]) and close(s, want[2])
        cuts = [(), (2, 64), (), (1, 129), (3,)]
        fla = CutStates(spans, cuts)
        out, c, s = layer.mix_cut_fla(mixed, b, a, conv, ssm, fla)
    moved = [tuple(x + shift for x in at if x + shift < rows) for (_, rows), at in zip(spans, cuts)]
    ref = CutStates(spans, moved)
    want = layer.mix_cut(layer.mix_spans_torch, mixed, b, a, conv, ssm, ref)
    assert sorted(fla.kept) == [(1, 2), (1, 64), (3, 1), (3, 129), (4, 3)]
    pairs = [(fla.kept[(i, x)], ref.kept[(i, x + shift)]) for i, x in fla.kept if (i, x + shift) in ref.kept]
    assert len(pairs) >= 3
    if shift:
        assert not any(torch.equal(f["conv"], r["conv"]) for f, r in pairs)
    else:
        assert all(torch.equal(f["conv"], r["conv"]) and close(f["ssm"], r["ssm"]) for f, r in pairs)
        assert close(out, want[0]) and torch.equal(c, want[1]) and close(s, want[2])


@torch.no_grad()
def test_a_later_turn_s_cut_reads_its_rows_as_slices() -> None:
    """One lane cut one row before its end (a later turn): its rounds are consecutive rows, which
    the FLA path takes as views, and the glue still gives the torch path's states and outputs."""
    from unittest import mock

    from strata.models import deltanet
    from strata.models.deltanet import cut_rounds
    from tests.models.fake_fla import KERNELS

    rounds = cut_rounds((((0, 79), (79, 1)),), torch.device("cpu"))
    assert [(r.rows_block, r.seqs_block) for r in rounds] == [(slice(0, 79), slice(0, 1)), (slice(79, 80), slice(0, 1))]
    mixed_rounds = cut_rounds((((0, 3),), ((3, 2), (5, 1))), torch.device("cpu"))
    assert mixed_rounds[0].rows_block == slice(0, 5) and mixed_rounds[1].rows_block == slice(5, 6)
    assert mixed_rounds[1].seqs_block == slice(1, 2)
    assert cut_rounds((((0, 2), (2, 2)), ((4, 1),)), torch.device("cpu"))[0].rows_block is None  # rows 0, 1, 4
    layer = _layer()
    g = torch.Generator().manual_seed(4)
    mixed = torch.randn(80, layer.conv_dim, generator=g)
    b, a = torch.randn(80, layer.hv, generator=g), torch.randn(80, layer.hv, generator=g)
    conv = torch.randn(1, layer.conv_dim, layer.kernel - 1, generator=g)
    ssm = 0.3 * torch.randn(1, layer.hv, layer.dk, layer.dv, generator=g)
    fla, ref = CutStates([(0, 80)], [(79,)]), CutStates([(0, 80)], [(79,)])
    with mock.patch.object(deltanet, "fla_kernels", lambda: KERNELS):
        got = layer.mix_cut_fla(mixed, b, a, conv, ssm, fla)
    want = layer.mix_cut(layer.mix_spans_torch, mixed, b, a, conv, ssm, ref)
    assert torch.equal(fla.kept[(0, 79)]["conv"], ref.kept[(0, 79)]["conv"])
    assert torch.allclose(fla.kept[(0, 79)]["ssm"], ref.kept[(0, 79)]["ssm"], rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(got, want))


@pytest.mark.parametrize("backend", ["torch", "fla_glue"])
@pytest.mark.parametrize("n,rows", [(5, 8), (70, 96), (2, 16), (1, 8)])
@torch.no_grad()
def test_padding_rows_leave_the_state_as_the_tokens_do(n: int, rows: int, backend: str) -> None:
    """A captured prompt step's one sequence of `rows` rows whose first n are tokens
    (`mix_padded`): the padding rows (random, not zeros) leave the matrix state and the
    convolution's tail as the tokens alone leave them read with a cut before the last one, the
    state at that cut is handed over, and the tokens' outputs are theirs. The tails are the same
    bits; outputs and states agree to float32 rounding (the chunked form's last block has other
    row counts). The control does not mask the padding: the states move."""
    import functools
    from unittest import mock

    from strata.kv.state import PadRows
    from strata.models import deltanet
    from strata.models.deltanet_fla import build_layout
    from tests.models.fake_fla import KERNELS

    layer = _layer()
    g = torch.Generator().manual_seed(5)
    mixed = torch.randn(rows, layer.conv_dim, generator=g)
    b, a = torch.randn(rows, layer.hv, generator=g), torch.randn(rows, layer.hv, generator=g)
    conv = torch.randn(1, layer.conv_dim, layer.kernel - 1, generator=g)
    ssm = 0.3 * torch.randn(1, layer.hv, layer.dk, layer.dv, generator=g)
    last = torch.tensor([n - 1])
    if backend == "torch":
        one = many = layer.mix_spans_torch
    else:
        one = layer.mix_spans_fla
        many = functools.partial(one, layout=build_layout(((0, rows),), torch.device("cpu")))
    ref = CutStates([(0, n)], [(n - 1,)] if n > 1 else [()])
    want = layer.mix_cut(layer.mix_spans_torch, mixed[:n], b[:n], a[:n], conv, ssm, ref)
    if n > 1:
        want_cut = ref.kept[(0, n - 1)]
    else:
        want_cut = {"conv": conv[0], "ssm": ssm[0]}
    pad = PadRows(torch.arange(rows) < n - 1, last)
    unmasked = PadRows(torch.ones(rows, dtype=torch.bool), last)
    with mock.patch.object(deltanet, "fla_kernels", lambda: KERNELS):
        out, c, s = layer.mix_padded(many, one, mixed, b, a, conv, ssm, pad)
        control = layer.mix_padded(many, one, mixed, b, a, conv, ssm, unmasked)

    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return torch.allclose(x, y, rtol=1e-5, atol=1e-6)

    assert torch.equal(c, want[1]) and torch.equal(pad.kept[0]["conv"], want_cut["conv"])
    assert close(out[:n], want[0]) and close(s, want[2]) and close(pad.kept[0]["ssm"], want_cut["ssm"])
    assert torch.equal(control[1], want[1]) and not close(control[2], want[2])
    assert not close(unmasked.kept[0]["ssm"], want_cut["ssm"])
