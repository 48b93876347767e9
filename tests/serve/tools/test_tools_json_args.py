"""The arguments scanner: every prefix of an object can be closed into valid JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.serve.tools.json_args import JsonArgs

FLOATS = st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.none() | st.booleans() | st.integers() | FLOATS | st.text()
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
OBJECTS = st.dictionaries(st.text(max_size=5), VALUES, max_size=5)


def scan(text: str) -> tuple[JsonArgs, int]:
    """The scanner after `text`, and how many characters it took."""
    args = JsonArgs()
    for n, c in enumerate(text):
        if not args.push(c):
            return args, n
    return args, len(text)


@settings(max_examples=100, deadline=None)
@given(obj=OBJECTS, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]), data=st.data())
def test_every_prefix_closes(obj, ascii_only, indent, data) -> None:
    text = json.dumps(obj, ensure_ascii=ascii_only, indent=indent)
    args, taken = scan(text)
    assert taken == len(text) and args.done and args.safe_text() == text
    cut = data.draw(st.integers(1, len(text)))  # the call stream always gives the "{"
    args, _ = scan(text[:cut])
    args.end()
    assert text.startswith(args.safe_text())
    assert isinstance(json.loads(args.safe_text() + args.closing), dict)


@pytest.mark.parametrize(
    ("text", "safe", "closing"),
    [
        ("{", "{", "}"),
        ('{"a', "{", "}"),
        ('{"a": ', '{"a": ', "null}"),
        ('{"a": "x\\', '{"a": "x', '"}'),
        ('{"a": "\\u00', '{"a": "', '"}'),
        ('{"a": 12', '{"a": 12', "}"),
        ('{"a": 1.', '{"a": ', "null}"),
        ('{"a": tr', '{"a": ', "null}"),
        ('{"a": [1, ', '{"a": [1', "]}"),
        ('{"a": {"b": [{}', '{"a": {"b": [{}', "]}}"),
    ],
)
def test_cut_off(text: str, safe: str, closing: str) -> None:
    args, taken = scan(text)
    assert taken == len(text)
    args.end()
    assert (args.safe_text(), args.closing) == (safe, closing)


@pytest.mark.parametrize(
    ("text", "taken"),
    [
        ("[]", 0),  # not an object
        ("{'a': 1}", 1),
        ('{"a": 01}', 7),
        ('{"a": 1,}', 8),
        ('{"a" 1}', 5),
        ('{"a": "x\ny"}', 8),  # raw control characters are not JSON
        ('{"a": "\\x"}', 8),
        ('{"a": nul}', 9),
        ('{"a": [1}', 8),
        ('{"a": 1}}', 8),
    ],
)
def test_syntax_errors_stop_the_scan(text: str, taken: int) -> None:
    assert scan(text)[1] == taken
