"""The logits controls and grammar helpers on their own: bit unpacking, bias, bans, masks, errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from strata.engine.controls import banned_ids, biased, mask_words, masked, unpack_bitmask
from strata.engine.grammar import GrammarError, Grammars, json_schema_grammar, lark_json
from strata.engine.types import SamplingParams


def _reference_bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = [[(int(words[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
            for r in range(words.shape[0])]
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_unpack_matches_one_bit_per_token(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2**31, 2**31 - 1, (3, mask_words(vocab)), dtype=torch.int32, generator=g)
    assert torch.equal(unpack_bitmask(words, vocab), _reference_bits(words, vocab))
    wider = unpack_bitmask(words, 32 * mask_words(vocab) + 7)  # logits wider than the masks
    assert not wider[:, 32 * mask_words(vocab):].any()


def test_masked_touches_only_the_named_rows() -> None:
    logits = torch.randn(3, 40)
    words = torch.zeros((2, mask_words(40)), dtype=torch.int32)
    words[0, 0] = 0b1010  # tokens 1 and 3
    words[1, 1] = 1  # token 32
    out = masked(logits, words, [(2, 0), (0, 1)])
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [32]
    assert torch.equal(out[2, [1, 3]], logits[2, [1, 3]])


def test_bias_and_bans() -> None:
    logits = torch.zeros(2, 8)
    assert biased(logits, [{}, {}], [[], []]) is None
    out = biased(logits, [{3: 5.0, 4: -2.0}, {}], [[], [0, 7]])
    assert out is not None and out[0, 3] == 5.0 and out[0, 4] == -2.0 and logits.abs().sum() == 0
    assert out[1].isinf().nonzero().flatten().tolist() == [0, 7]


def test_min_tokens_bans_stop_tokens_until_reached() -> None:
    p = SamplingParams(min_tokens=3, stop_token_ids=[5, 99])
    assert banned_ids(p, 0, {0, 2}, vocab=50) == [0, 2, 5]
    assert banned_ids(p, 3, {0, 2}, vocab=50) == []
    assert banned_ids(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[5]), 1, {0}, 50) == [5]


def test_schema_forms() -> None:
    with pytest.raises(GrammarError) as e:
        json_schema_grammar({"x": float("nan")}, param="response_format")
    assert e.value.param == "response_format"
    assert json_schema_grammar(True, param="p") and json_schema_grammar(False, param="p")
    rule = lark_json({"type": "integer", "x-guidance": {"whitespace_flexible": False}}, param="tools")
    assert rule.startswith("%json ") and '"whitespace_flexible": false' in rule
    with pytest.raises(GrammarError):
        lark_json(False, param="tools")


def test_a_tokenizer_llguidance_cannot_read_makes_grammars_bad_requests() -> None:
    tokenizer = SimpleNamespace(backend=SimpleNamespace(to_str=lambda: "{not json"), vocab_size=10,
                                stop_token_ids={0})
    grammars = Grammars(tokenizer, 10)  # type: ignore[arg-type]
    for _ in range(2):  # tried once, reported every time
        with pytest.raises(GrammarError, match="not available") as e:
            grammars.check(json_schema_grammar({"type": "object"}, param="schema"), "schema")
        assert e.value.param == "schema"
