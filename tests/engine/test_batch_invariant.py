"""`--batch-invariant`: when it is on, what it switches, and that the CPU (invariant by
construction) computes the same bits either way. The kernels and the engine on the GPU are
checked on the device (tests/gpu/test_matmul.py, test_gpu_engine.py::test_batch_company)."""

from __future__ import annotations

import argparse

import pytest
import torch

from strata.engine.config import EngineConfig, add_engine_arguments, batch_invariant_on, config_from_args
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.models.blocks import BlockLinear
from strata.models.dense import Linear


@pytest.mark.parametrize(("flag", "parallel", "spec", "on"), [
    ("auto", 1, 0, False), ("auto", 64, 0, False), ("auto", 1, 4, True), ("auto", 16, 2, True),
    ("on", 1, 0, True), ("off", 64, 4, False),
])
def test_when_it_is_on(flag: str, parallel: int, spec: int, on: bool) -> None:
    """auto: on wherever a lane's own drafts share its steps; company among lanes is `on`."""
    cfg = EngineConfig(batch_invariant=flag, parallel=parallel, spec=spec)
    assert batch_invariant_on(cfg) is on


def test_flag_is_parsed_and_checked() -> None:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert config_from_args(p.parse_args(["--batch-invariant", "on"])).batch_invariant == "on"
    assert config_from_args(p.parse_args([])).batch_invariant == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--batch-invariant", "maybe"])


def test_engine_switches_every_product(tiny_loaded) -> None:
    """The engine sets the model's products as the flag says (and back), every linear of it."""
    model = tiny_loaded.model
    linears = [m for m in model.modules() if isinstance(m, (Linear, BlockLinear))]
    assert linears
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    texts = {}
    for flag in ("on", "off"):
        cfg = EngineConfig(model=tiny_loaded.path, device="cpu", dtype="bfloat16", parallel=2,
                           max_context=64, kv_chunk=16, batch_invariant=flag)
        with Engine(cfg, loaded=tiny_loaded) as engine:
            want = flag == "on"
            assert engine.batch_invariant is want and model.batch_invariant is want
            assert all(m.invariant is want for m in linears)
            texts[flag] = engine.complete(engine.tokenizer.encode("The river"), params).token_ids
    assert texts["on"] == texts["off"]  # the CPU's products are invariant already: nothing changes


def test_cpu_products_unchanged() -> None:
    """On the CPU the invariant switch leaves a Linear's bits alone (it applies to CUDA tensors)."""
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    before = lin.forward(x)
    lin.set_invariant(True)
    assert torch.equal(lin.forward(x), before)
