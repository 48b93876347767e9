"""Reading llama-bench's JSON, the fair peer of `strata bench`."""

from __future__ import annotations

import json

import pytest

from strata.bench.peers import parse_llama_bench


def test_prompt_and_decode_rows_are_read() -> None:
    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 256.3, "n_threads": 2},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 91.9, "n_threads": 2}]
    assert parse_llama_bench(json.dumps(rows)) == {"prompt_tokens_per_s": 256.3,
                                                   "decode_tokens_per_s": 91.9}


def test_output_without_both_rows_is_an_error() -> None:
    with pytest.raises(ValueError, match="pp and tg"):
        parse_llama_bench(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 1.0}]))
