"""A layer split and a remote stage on the GPU: the same greedy tokens as one GPU.

With two GPUs the split is `--gpus 0,1` and the remote stage's `strata stage` child runs on
the second GPU (NCCL carries the hidden states). On a machine with one GPU the split runs as
two stages on that GPU (`--gpus 0,0`): the same code, each stage with its own pool part and
CUDA graphs, a captured head on the main device; the child runs on the same GPU (tensors then
travel by gloo through the host: NCCL needs two GPUs). The model is a random four-layer GGUF
(`tools.synth --shape tiny-4`) with the default model's tokenizer, from the embedded model or
`--gpu-tokenizer`. Lane-by-lane requests must match exactly; a batch of four submitted at
once is reported (on the GPU a lane's bits may depend on its company, issue 20).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from benchmarks.stage_process import NO_MULTICAST, StageProcess
from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams

TWO = torch.cuda.device_count() >= 2
if TWO:  # this process joins an NCCL group with the child: NVLink multicast stays off here too
    os.environ.update(NO_MULTICAST)
SPLIT = "0,1" if TWO else "0,0"
WORKER = "cuda:1" if TWO else "cuda"
PROMPTS = ["The quick brown fox", "In 1492, Columbus sailed", "Water boils at", "Once upon a time"]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
KEY = "a-gpu-stage-test-key-0123456789"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, gpu_tokenizer: str) -> str:
    from tools.synth import main as synth

    out = tmp_path_factory.mktemp("split-gpu") / "tiny4.gguf"
    assert synth([str(out), "--shape", "tiny-4", "--tokenizer-from", gpu_tokenizer]) == 0
    return str(out)


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, device="cuda", weights="dense", parallel=4, max_context=256,
                        kv_chunk=64, **kw)


def _answers(eng: Engine) -> tuple[list[list[int]], list[list[int]]]:
    tok = eng.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    alone = [eng.complete(p, PARAMS).token_ids for p in ids]
    handles = [eng.generate(p, PARAMS) for p in ids]
    return alone, [h.result().token_ids for h in handles]


@pytest.fixture(scope="module")
def one_gpu(model: str):
    with Engine(_config(model)) as eng:
        assert eng.runner.graphs is not None
        return _answers(eng)


def test_two_stages_on_the_gpu_equal_one(model, one_gpu) -> None:
    with Engine(_config(model, gpus=SPLIT)) as eng:
        stages = eng.runner.stages
        assert [s.layers for s in stages] == [range(0, 2), range(2, 4)]
        assert eng.runner.graphs is not None and all(s.graphs is not None for s in stages)
        alone, batch = _answers(eng)
        steps = eng.stats()["steps"]
    agree = sum(a == b for a, b in zip(batch, one_gpu[1]))
    print(f"\n[gpu-split {SPLIT}] batch of 4 through the split equal to one GPU: {agree} of 4; steps {steps}")
    assert alone == one_gpu[0]


def test_remote_stage_on_the_gpu_equals_one(model, one_gpu, tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text(KEY)
    worker = StageProcess(["--model", model, "--device", WORKER, "--weights", "dense",
                           "--stage-key-file", str(key)], tmp_path / "stage.log")
    try:
        with Engine(_config(model, remote_stage=worker.address, stage_key_file=str(key), split_at=2)) as eng:
            alone, batch = _answers(eng)
            stage = eng.stats()["stages"][1]
    finally:
        worker.kill()
    agree = sum(a == b for a, b in zip(batch, one_gpu[1]))
    print(f"\n[gpu-remote] batch of 4 equal to one GPU: {agree} of 4; stage "
          f"{json.dumps({k: stage[k] for k in ('steps', 'link_seconds_per_decode_step', 'bytes_per_step')})}")
    assert alone == one_gpu[0]
