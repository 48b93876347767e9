"""Model outputs in each family's call format, with what parsing them must give.

Handwritten the way each family writes calls (its chat template shows the
model the same text), including the ways outputs go wrong: broken JSON,
unknown tools, cut off by max_tokens, strings full of braces and quotes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

TOOL_NAMES = frozenset({"get_weather", "get_time", "search"})

NESTED_ARGS = (
    r'{"query": "a {b} \"c\" \\ d [e] ,f:", "filter": {"tags": ["x}", "{y", "\u00e9\n"],'
    r' "n": {"deep": [1, -2.5e-3, {"k": null, "t": true, "f": false}]}}}'
)
UNICODE_ARGS = '{"city": "Zürich 東京 🚀", "note": "naïve — ok"}'


@dataclass(frozen=True)
class Case:
    """`calls`: (name, arguments text) in order."""

    family: str
    label: str
    text: str
    content: str
    calls: tuple[tuple[str, str], ...]


def counter_ids() -> Callable[[], str]:
    """Ids call_0, call_1, ...: two runs over the same text get the same ids."""
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def _h(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


_W = '{"city": "Paris"}'
_T = '{"timezone": "Europe/Paris"}'

HERMES = [
    Case("hermes", "single", _h("get_weather", _W), "", (("get_weather", _W),)),
    Case(
        "hermes", "two calls", _h("get_weather", _W) + "\n" + _h("get_time", _T), "",
        (("get_weather", _W), ("get_time", _T)),
    ),
    Case(
        "hermes", "text before", "Let me look that up.\n\n" + _h("get_weather", _W),
        "Let me look that up.", (("get_weather", _W),),
    ),
    Case("hermes", "plain answer", "It is sunny in Paris.\n", "It is sunny in Paris.\n", ()),
    Case(
        "hermes", "malformed json",
        '<tool_call>\n{name: "get_weather", arguments: {}}\n</tool_call>',
        '<tool_call>\n{name: "get_weather", arguments: {}}\n</tool_call>', (),
    ),
    Case("hermes", "unknown tool", _h("delete_all", "{}"), _h("delete_all", "{}"), ()),
    Case(
        "hermes", "non-object arguments",
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', (),
    ),
    Case(
        "hermes", "cut off before the arguments",
        'Checking.<tool_call>\n{"name": "get_wea', 'Checking.<tool_call>\n{"name": "get_wea', (),
    ),
    Case(
        "hermes", "cut off in the arguments",
        _h("get_time", _T) + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "", (("get_time", _T), ("get_weather", '{"city": "Par"}')),
    ),
    Case(
        "hermes", "cut off after a key",
        '<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit',
        ', "limit', (("search", '{"query": "x"}'),),
    ),
    Case(
        "hermes", "syntax error in the arguments",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris" "x": 1}}\n</tool_call>',
        '"x": 1}}\n</tool_call>', (("get_weather", '{"city": "Paris" }'),),
    ),
    Case("hermes", "nested arguments", _h("search", NESTED_ARGS), "", (("search", NESTED_ARGS),)),
    Case(
        "hermes", "unicode", "Voilà: " + _h("get_weather", UNICODE_ARGS), "Voilà:",
        (("get_weather", UNICODE_ARGS),),
    ),
    Case(
        "hermes", "broken call before a good one",
        "<tool_call>oops " + _h("get_time", _T), "<tool_call>oops", (("get_time", _T),),
    ),
    Case(
        "hermes", "missing close tag", _h("get_time", _T)[: -len("</tool_call>")] + "Done.",
        "Done.", (("get_time", _T),),
    ),
    Case("hermes", "almost a marker", "Use <tool_box> or <tool", "Use <tool_box> or <tool", ()),
]


def _l(name: str, args: str) -> str:
    return f'{{"name": "{name}", "parameters": {args}}}'


LLAMA3 = [
    Case("llama3_json", "single", _l("get_weather", _W), "", (("get_weather", _W),)),
    Case(
        "llama3_json", "python tag", "<|python_tag|>" + _l("get_time", _T), "",
        (("get_time", _T),),
    ),
    Case(
        "llama3_json", "two calls", _l("get_weather", _W) + "; " + _l("get_time", _T), "",
        (("get_weather", _W), ("get_time", _T)),
    ),
    Case(
        "llama3_json", "arguments key", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "", (("get_weather", _W),),
    ),
    Case("llama3_json", "plain answer", "It is sunny.", "It is sunny.", ()),
    Case(
        "llama3_json", "text before is not a call", "Sure! " + _l("get_weather", _W),
        "Sure! " + _l("get_weather", _W), (),
    ),
    Case("llama3_json", "json answer", '{"answer": 42}', '{"answer": 42}', ()),
    Case("llama3_json", "unknown tool", _l("reboot", "{}"), _l("reboot", "{}"), ()),
    Case(
        "llama3_json", "malformed json", '{"name": get_weather, "parameters": {}}',
        '{"name": get_weather, "parameters": {}}', (),
    ),
    Case(
        "llama3_json", "cut off", '{"name": "search", "parameters": {"query": "tea", "tags": ["gre',
        "", (("search", '{"query": "tea", "tags": ["gre"]}'),),
    ),
    Case(
        "llama3_json", "nested arguments", _l("search", NESTED_ARGS), "",
        (("search", NESTED_ARGS),),
    ),
    Case(
        "llama3_json", "unicode", _l("get_weather", UNICODE_ARGS), "",
        (("get_weather", UNICODE_ARGS),),
    ),
    Case(
        "llama3_json", "trailing text", _l("get_weather", _W) + " I hope this helps.",
        "I hope this helps.", (("get_weather", _W),),
    ),
]


def _m(name: str, args: str) -> str:
    return f'{{"name": "{name}", "arguments": {args}}}'


MISTRAL = [
    Case("mistral", "single", f"[TOOL_CALLS][{_m('get_weather', _W)}]", "", (("get_weather", _W),)),
    Case(
        "mistral", "two calls",
        f"[TOOL_CALLS] [{_m('get_weather', _W)}, {_m('get_time', _T)}]", "",
        (("get_weather", _W), ("get_time", _T)),
    ),
    Case(
        "mistral", "text before", f"Hello[TOOL_CALLS][{_m('get_time', _T)}]", "Hello",
        (("get_time", _T),),
    ),
    Case(
        "mistral", "named", f"[TOOL_CALLS]get_weather[ARGS]{_W}", "", (("get_weather", _W),),
    ),
    Case(
        "mistral", "named twice, [ARGS] decoded away",
        f"[TOOL_CALLS]get_weather{_W}[TOOL_CALLS]get_time{_T}", "",
        (("get_weather", _W), ("get_time", _T)),
    ),
    Case("mistral", "plain answer", "Bonjour !", "Bonjour !", ()),
    Case(
        "mistral", "malformed json",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": Paris}}]',
        "Paris}}]", (("get_weather", '{"city": null}'),),
    ),
    Case(
        "mistral", "unknown tool", f"[TOOL_CALLS][{_m('launch', '{}')}]",
        f"[TOOL_CALLS][{_m('launch', '{}')}]", (),
    ),
    Case(
        "mistral", "cut off", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ly',
        "", (("get_weather", '{"city": "Ly"}'),),
    ),
    Case(
        "mistral", "nested arguments", f"[TOOL_CALLS]search[ARGS]{NESTED_ARGS}", "",
        (("search", NESTED_ARGS),),
    ),
    Case(
        "mistral", "unicode", f"[TOOL_CALLS][{_m('get_weather', UNICODE_ARGS)}]", "",
        (("get_weather", UNICODE_ARGS),),
    ),
]

ALL = HERMES + LLAMA3 + MISTRAL
