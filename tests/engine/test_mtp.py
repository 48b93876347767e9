"""Drafts from a Qwen3-Next checkpoint's multi-token-prediction head (`--mtp`).

The head against a plain-torch reference written from its formulas
(`tests/models/tiny_mtp.py`: transformers' decoder layer carrying the head's
weights, since transformers drops the head itself): its logits for a prompt
read in two steps (so it attends over entries an earlier step wrote), and a
chain of greedy drafts. Then the engine: greedy and seeded answers with MTP
drafts equal those without, and the figures name the proposer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.mtp import MtpProposer
from strata.engine.runner import Runner
from strata.engine.types import SamplingParams
from strata.errors import BadRequest
from strata.kv.formats import make_format
from strata.kv.pool import KvPool
from strata.kv.state import StatePool
from strata.kv.step import SeqSpec
from strata.models import load_model
from tests.models.tiny_models import save_byte_tokenizer, save_tiny
from tests.models.tiny_mtp import ReferenceMtp, save_tiny_mtp

PROMPT = [1, 17, 200, 33, 5, 90, 91, 255, 4, 64, 128, 7, 7, 42, 100, 3, 250, 12, 61, 8, 19, 77]
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_next_mtp")
    save_tiny_mtp(path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(folder: Path, tmp_path_factory) -> ReferenceMtp:
    return ReferenceMtp(folder, tmp_path_factory.mktemp("shadow"))


def _proposer(folder: Path) -> tuple[Runner, MtpProposer]:
    """The engine's pieces over one lane: the pool with the head's layer, the state pool, the
    runner keeping its hidden states, the proposer (float32, dense)."""
    loaded = load_model(str(folder), device="cpu", dtype="float32", progress=False)
    model, cfg = loaded.model, loaded.config
    assert cfg.mtp_layers == 1 and model.mtp is not None
    pool = KvPool(make_format("fp32", cfg.num_kv_heads, cfg.head_dim), model.pool_layers() + [cfg.num_layers],
                  1, 64, 16, None)
    assert pool.reserve(0, 64)
    states = StatePool(model.state_layers(), 1, "cpu", model.state_dtypes())
    runner = Runner(model, pool, cfg.attn_scale, torch.device("cpu"), graphs=False, states=states,
                    keep_hidden=True)
    return runner, MtpProposer(model, pool, runner.context, cfg.attn_scale, 0.0)


def test_the_head_matches_its_reference(folder: Path, reference: ReferenceMtp) -> None:
    runner, mtp = _proposer(folder)
    cut = 9  # the prompt in two steps: the second step's entries attend over the first's
    n = len(PROMPT)
    runner.forward([SeqSpec(0, 0, cut)], PROMPT[:cut], [0])
    first = mtp.ingest_rows([SeqSpec(0, 0, cut)], PROMPT[1 : cut + 1], runner.hidden, [7])
    logits = runner.forward([SeqSpec(0, cut, n - cut)], PROMPT[cut:], [1])
    token = int(logits[0].argmax())
    second = mtp.ingest_rows([SeqSpec(0, cut, n - cut)], PROMPT[cut + 1 :] + [token], runner.hidden, [7])
    hidden = reference.hidden(PROMPT)
    torch.testing.assert_close(torch.cat((first, second)), reference.outputs(PROMPT[1:] + [token], hidden), **TOL)
    got = mtp.model.compute_logits(torch.cat((first, second)))
    torch.testing.assert_close(got, reference.logits(reference.outputs(PROMPT[1:] + [token], hidden)), **TOL)
    drafts = mtp.draft(0, 7, n - 1, 4)
    assert drafts == reference.drafts(PROMPT, token, 4)
    # negative control: the same comparison tells apart the head fed other hidden states
    assert not torch.allclose(reference.outputs(PROMPT[1:] + [token], torch.zeros_like(hidden)), second[-1:])
    # a draft starts only from the lane's own last entry
    assert mtp.draft(0, 8, n - 1, 4) == [] and mtp.draft(0, 7, n - 2, 4) == []


def test_a_folder_without_the_head_has_none_and_refuses_mtp(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    save_tiny("qwen3_next", plain)
    save_byte_tokenizer(plain)
    unnamed = tmp_path / "unnamed"  # weights without the config's count: not read
    save_tiny_mtp(unnamed, config_key=False)
    save_byte_tokenizer(unnamed)
    for path in (plain, unnamed):
        assert load_model(str(path), device="cpu", dtype="float32", progress=False).config.mtp_layers == 0
        with pytest.raises(BadRequest, match="--mtp: .* carries no multi-token-prediction head"):
            Engine(EngineConfig(model=str(path), device="cpu", weights="dense", max_context=64, spec=2, mtp=True))


def test_mtp_flags_are_refused_before_the_model_loads() -> None:
    missing = "/nonexistent/model"  # never read: the flags fail first
    with pytest.raises(BadRequest, match="give --spec N"):
        Engine(EngineConfig(model=missing, mtp=True))
    with pytest.raises(BadRequest, match="--kv-resident"):
        Engine(EngineConfig(model=missing, mtp=True, spec=2, kv_resident=64))


def _run(folder: Path, spec: int, requests: list, **flags) -> tuple[list, dict, str]:
    from strata.serve.metrics import ServeMetrics

    cfg = EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", weights="dense", max_context=128,
                       parallel=3, spec=spec, **flags)
    with Engine(cfg) as eng:
        out = [h.result().token_ids for h in [eng.generate(p, params) for p, params in requests]]
        stats = eng.stats()
        return out, stats, ServeMetrics(eng.stats, lambda: "tiny").render().decode()


def test_mtp_drafts_never_change_the_answer(folder: Path) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [(PROMPT, greedy), (PROMPT[:12], greedy),
                (PROMPT, SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True)),
                (PROMPT[3:], SamplingParams(max_tokens=20, repetition_penalty=1.2, logprobs=1, ignore_eos=True))]
    plain, _, _ = _run(folder, 0, requests)
    drafted, stats, metrics = _run(folder, 4, requests, mtp=True, suffix_draft=False)
    assert drafted == plain
    spec = stats["speculation"]
    assert spec["proposers"] == "mtp" and spec["mtp_drafted_tokens"] > 0 and spec["mtp_verifications"] > 0
    found = re.search(r"^strata_engine_speculation_mtp_drafted_tokens (\S+)$", metrics, re.M)
    assert found is not None and float(found.group(1)) == spec["mtp_drafted_tokens"]
    with_suffix, stats, _ = _run(folder, 4, requests, mtp=True)  # both proposers, suffix first
    assert with_suffix == plain and stats["speculation"]["proposers"] == "suffix,mtp"


def test_a_later_turn_drafts_from_entries_kept_with_the_conversation(folder: Path) -> None:
    """The head's entries are K/V of the lane: parked with the conversation and restored for its
    second turn (no re-read), whose answer with MTP drafts equals the one without."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for spec, flags in ((0, {}), (3, {"mtp": True, "suffix_draft": False})):
        cfg = EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", weights="dense", max_context=128,
                           parallel=1, spec=spec, prompt_cache=2, **flags)
        with Engine(cfg) as eng:
            first = eng.complete(PROMPT, greedy)
            n = len(PROMPT) + len(first.token_ids) - 1  # the tokens the lane holds
            kept = _head_kv(eng, n) if spec else []
            eng.complete(PROMPT[5:], greedy)  # one lane: the first conversation is parked, entries too
            other = _head_kv(eng, n) if spec else []
            second = eng.complete(PROMPT + first.token_ids + [9, 10, 11], greedy)
            back = _head_kv(eng, n) if spec else []
            outs[spec] = (first.token_ids, second.token_ids, second.cached_tokens,
                          eng.stats()["conversation_restores"])
    assert outs[3] == outs[0] and outs[3][2] == n and outs[3][3] == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, back))  # the entries came back, bit for bit
    assert not all(torch.equal(a, b) for a, b in zip(kept, other))  # negative control: another's


def _head_kv(eng: Engine, n: int) -> list[torch.Tensor]:
    """Lane 0's K/V of the head's layer at positions [0, n), as stored."""
    def read() -> list[torch.Tensor]:
        pool = eng.pool
        k, v = pool.read(pool.layer_ids[-1], pool.cells_of_range(0, 0, n), torch.float32)
        return [k.clone(), v.clone()]
    return eng.call(read).result()


def test_entries_do_not_depend_on_how_the_rows_came(folder: Path) -> None:
    """The head's entries for a lane whose tokens came in runs of accepted suffix drafts equal,
    bit for bit, those of the same tokens decoded one a step (MTP drafts only, all rejected)."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    got = {}
    for suffix in (True, False):
        cfg = EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", weights="dense", max_context=128,
                           parallel=1, spec=4, mtp=True, suffix_draft=suffix)
        with Engine(cfg) as eng:
            answers = [eng.complete(PROMPT, greedy).token_ids for _ in range(2)]  # the second drafts
            n = len(eng.scheduler.lanes[0].tokens)  # from the first's finished conversation
            got[suffix] = (answers, n, _head_kv(eng, n), eng.stats()["speculation"])
    (answers, n, kv, spec), (answers_1, n_1, kv_1, _) = got[True], got[False]
    assert answers == answers_1 and n == n_1 == len(PROMPT) + 29
    assert spec["suffix_accepted_tokens"] > 0  # runs of several rows were kept
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_1))
    # negative control: entries one position off are told apart by the same comparison
    assert not all(torch.equal(a[1:], b[:-1]) for a, b in zip(kv, kv_1))


def test_mtp_config_keys_are_read(tmp_path: Path) -> None:
    """Either config.json spelling of the head's layer count turns it on."""
    path = tmp_path / "nextn"
    save_tiny_mtp(path, config_key=False)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    save_byte_tokenizer(path)
    assert load_model(str(path), device="cpu", dtype="float32", progress=False).config.mtp_layers == 1
