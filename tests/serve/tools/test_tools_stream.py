"""Streaming: however the output is cut into deltas, the pieces add up to `parse` of it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_outputs import ALL, TOOL_NAMES, counter_ids

from strata.serve.tools import (
    ArgsPiece,
    CallStart,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    TextPiece,
    merge_pieces,
)
from strata.serve.tools.format import ToolFormat
from strata.serve.tools.types import Piece

FORMATS: dict[str, ToolFormat] = {
    "hermes": HermesFormat(),
    "llama3_json": Llama3JsonFormat(),
    "mistral": MistralFormat(named_calls=False),
}


def streamed(fmt: ToolFormat, chunks: list[str]) -> list[Piece]:
    stream = fmt.stream(TOOL_NAMES, counter_ids())
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += stream.feed(chunk)
    return pieces + stream.finish()


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(p % (len(text) + 1) for p in points), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(ALL), points=st.lists(st.integers(min_value=0), max_size=12))
def test_any_split_merges_to_parse(case, points) -> None:
    fmt = FORMATS[case.family]
    pieces = streamed(fmt, cut(case.text, points))
    assert merge_pieces(pieces) == fmt.parse(case.text, TOOL_NAMES, counter_ids())


@pytest.mark.parametrize("case", ALL, ids=lambda c: f"{c.family}: {c.label}")
def test_character_by_character(case) -> None:
    fmt = FORMATS[case.family]
    pieces = streamed(fmt, list(case.text))
    assert merge_pieces(pieces) == fmt.parse(case.text, TOOL_NAMES, counter_ids())
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [p.index for p in starts] == list(range(len(starts)))
    for piece in pieces:  # a call's fragments come after its start
        if isinstance(piece, ArgsPiece):
            assert any(s.index == piece.index for s in starts)


# Fragments of every family's syntax, glued at random: broken calls of every kind.
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
    '{"name": ', '"get_weather"', '"search"', '"nope"', ', "arguments": ', ', "parameters": ',
    "{", "}", "[", "]", '"', "\\", ",", ":", ";", " ", "\n", "1", "-", "e", "true", "nul",
    '"city"', '"Par\\u00e9"', '"a}b"', "get_weather", "é", "🚀", "x",
]


@settings(max_examples=300, deadline=None)
@given(
    family=st.sampled_from(sorted(FORMATS)),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40),
    points=st.lists(st.integers(min_value=0), max_size=8),
)
def test_garbage_never_breaks_the_rules(family, parts, points) -> None:
    fmt = FORMATS[family]
    text = "".join(parts)
    parsed = fmt.parse(text, TOOL_NAMES, counter_ids())
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)
        assert call.name in TOOL_NAMES
    assert merge_pieces(streamed(fmt, cut(text, points))) == parsed


def test_a_possible_marker_is_held_back_until_decided() -> None:
    stream = HermesFormat().stream(TOOL_NAMES, counter_ids())
    assert stream.feed("Hi <tool") == [TextPiece("Hi")]
    assert stream.feed("box> there") == [TextPiece(" <toolbox> there")]
    assert stream.feed(" <tool_call>\n{") == []
    assert stream.finish() == [TextPiece(" <tool_call>\n{")]


def test_name_goes_out_when_known_and_arguments_as_they_come() -> None:
    stream = HermesFormat().stream(TOOL_NAMES, counter_ids())
    assert stream.feed('<tool_call>\n{"name": "search", "argu') == []
    assert stream.feed('ments": {"query": "te') == [
        CallStart(0, "call_0", "search"),
        ArgsPiece(0, '{"query": "te'),
    ]
    assert stream.feed('a", "limit": 1') == [ArgsPiece(0, 'a", "limit": ')]  # 1 may go on
    assert stream.feed("0}}\n</tool_call>") == [ArgsPiece(0, "10}")]
    assert stream.finish() == []


def test_cut_off_arguments_are_closed_at_finish() -> None:
    stream = MistralFormat(named_calls=False).stream(TOOL_NAMES, counter_ids())
    pieces = stream.feed('[TOOL_CALLS][{"name": "search", "arguments": {"tags": ["a", "b\\u00')
    pieces += stream.finish()
    (call,) = merge_pieces(pieces).calls
    assert json.loads(call.arguments) == {"tags": ["a", "b"]}
    assert pieces[-2:] == [ArgsPiece(0, '"]}'), TextPiece("\\u00")]
