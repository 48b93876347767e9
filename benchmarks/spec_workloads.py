"""The conversations `benchmarks.spec_bench` replays: agent-style ones that quote and edit earlier
text, and open text with nothing to copy.

Agent and coding conversations repeat themselves: a file is re-emitted with one edit, a tool's
output is quoted back, the previous answer is repeated with another change. Those are the
conversations where drafts read from the context itself pay, so the agent workload is made of
them; the open workload (stories, explanations) is the control where drafts rarely hold.

Every text is deterministic: files are generated from a seeded `random.Random` (Python modules,
JSON configs, CSV tables, test logs) or cut from the licence texts every Debian machine ships
(`/usr/share/common-licenses`), each grown or clipped to about `file_tokens` tokens of the model's
own tokenizer. Where the licence texts are missing, generated files take their place, and
`sources()` says which were used.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
LICENSE_FILES = ("GPL-3", "Apache-2.0", "GPL-2", "MPL-2.0")
NOUNS = ("order", "invoice", "sensor", "ticket", "shipment", "account", "booking", "device", "report",
         "session", "payment", "route", "sample", "batch", "upload", "review")
VERBS = ("load", "validate", "merge", "render", "score", "split", "archive", "resolve", "normalise",
         "schedule", "export", "refresh")
FIELDS = ("name", "count", "price", "owner", "created", "status", "region", "weight", "limit",
          "priority", "label", "source")
ITEMS = ("bolt", "washer", "hinge", "bracket", "spring", "gasket", "valve", "nozzle", "sprocket",
         "bearing", "clamp", "rivet", "pulley", "flange", "coupling", "spacer", "bushing", "shim")
OPEN_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a curious twelve-year-old.",
    "Describe a busy market in a coastal town at dawn.",
    "Why do leaves change colour in autumn? Explain the chemistry simply.",
    "Write a letter from a traveller to a friend back home about a long train journey.",
    "Explain the difference between weather and climate with everyday examples.",
    "Tell a fable about a fox, a crow and a clever farmer.",
    "How does a bicycle stay upright while it moves? Give an intuitive explanation.",
    "Write a short poem about rain on a tin roof, then explain its imagery.",
    "Describe what a day in the life of a medieval baker might have looked like.",
    "Explain why the sky is blue and sunsets are red.",
    "Write the opening scene of a mystery set in a snowed-in mountain hotel.",
    "What makes bread rise? Walk through what yeast does.",
    "Invent a new board game and explain its rules.",
    "Explain how vaccines train the immune system.",
    "Write a short story about a robot learning to paint.",
)


@dataclass(frozen=True)
class Conversation:
    """Fixed earlier messages, then user turns asked in order, each answered by the model."""

    name: str
    history: tuple[dict[str, str], ...]
    turns: tuple[str, ...]


Counter = Callable[[str], int]  # tokens of a text


def grow(make: Callable[[int], str], count: Counter, target: int, most: int = 200) -> str:
    """`make(n)` for the largest n whose text stays within `target` tokens (at least n = 1)."""
    best = make(1)
    for n in range(2, most):
        text = make(n)
        if count(text) > target:
            break
        best = text
    return best


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"


def python_module(seed: int) -> tuple[Callable[[int], str], str, str, str]:
    """A module of n functions (text by n), one function's name, a free name, and a constant."""
    rng = random.Random(seed)
    noun = NOUNS[seed % len(NOUNS)]
    names = list(dict.fromkeys(_ident(rng) for _ in range(80)))
    fields = ["name", *rng.sample(FIELDS[1:], 3)]
    const = f"MAX_{noun.upper()}_{rng.choice(('RETRIES', 'ITEMS', 'AGE', 'SIZE'))}"
    head = (f'"""Helpers for {noun} records: loading, checking and exporting them."""\n\n'
            "from __future__ import annotations\n\nimport logging\nfrom dataclasses import dataclass\n\n"
            "log = logging.getLogger(__name__)\n"
            f"{const} = {rng.randint(3, 64)}\n\n\n@dataclass\nclass {noun.title()}:\n"
            + "".join(f"    {f}: {rng.choice(('str', 'int', 'float'))}\n" for f in fields))

    def function(i: int) -> str:
        r = random.Random(seed * 1000 + i)
        f, g = r.sample(fields, 2)
        k = r.randint(2, 20)
        return (f"\n\ndef {names[i]}(items: list[{noun.title()}], limit: int = {const}) -> list[{noun.title()}]:\n"
                f'    """The first `limit` {noun}s that have a {f}; sorted by {g} past {k}."""\n'
                f"    out = []\n    for item in items[:limit]:\n"
                f"        if item.{f} is None:\n"
                f'            log.debug("skipping %s without a {f}", item.name)\n            continue\n'
                f"        out.append(item)\n"
                f"    if len(out) > {k}:\n        out.sort(key=lambda item: item.{g})\n"
                f"    return out\n")

    def make(n: int) -> str:
        return head + "".join(function(i) for i in range(n))

    return make, names[0], names[-1], const


def service_config(seed: int) -> Callable[[int], str]:
    """A JSON service config of n upstreams (text by n)."""
    rng = random.Random(seed)
    base = {"service": f"{rng.choice(NOUNS)}-api", "port": 8000 + seed, "debug": False,
            "database": {"host": "db.internal", "port": 5432, "pool": rng.randint(4, 32)},
            "features": sorted(rng.sample(FIELDS, 5))}

    def make(n: int) -> str:
        ups = [{"name": f"{NOUNS[(seed + i) % len(NOUNS)]}-{i}", "url": f"http://10.0.{seed}.{i}:90{i:02d}",
                "timeout_ms": 250 * (1 + (seed + i) % 7), "retries": (seed + i) % 4} for i in range(n)]
        return json.dumps({**base, "upstreams": ups}, indent=2)

    return make


def price_table(seed: int) -> tuple[Callable[[int], str], str]:
    """A CSV table of n parts (text by n), and the first part's name."""
    rng = random.Random(seed)
    parts = rng.sample(ITEMS, len(ITEMS))

    def make(n: int) -> str:
        rows = ["part,size_mm,material,stock,price_eur"]
        for i in range(n):
            r = random.Random(seed * 100 + i)
            rows.append(f"{parts[i % len(parts)]}-{seed}{i},{r.randint(2, 80)},"
                        f"{r.choice(('steel', 'brass', 'nylon', 'zinc'))},{r.randint(0, 900)},"
                        f"{r.randint(1, 400) / 100:.2f}")
        return "\n".join(rows)

    return make, f"{parts[0]}-{seed}0"


def test_log(seed: int) -> Callable[[int], str]:
    """Output of a test run of n tests, some failing (text by n)."""
    def make(n: int) -> str:
        lines, failed = [], []
        for i in range(n):
            r = random.Random(seed * 100 + i)
            name = f"tests/test_{NOUNS[(seed + i) % len(NOUNS)]}.py::test_{_ident(r)}"
            if r.random() < 0.25:
                failed.append(name)
                lines += [f"____ {name.split('::')[1]} ____", f"    assert result == {r.randint(1, 99)}",
                          f"E   AssertionError: assert {r.randint(100, 999)} == {r.randint(1, 99)}",
                          f"{name.split('::')[0]}:{r.randint(10, 300)}: AssertionError"]
            else:
                lines.append(f"{name} PASSED")
        lines += [f"FAILED {f} - AssertionError" for f in failed]
        lines.append(f"==== {len(failed)} failed, {n - len(failed)} passed in {seed + n / 10:.2f}s ====")
        return "\n".join(lines)

    return make


def license_sections() -> list[str]:
    """The numbered sections of the licence texts present, in file order."""
    out = []
    for name in LICENSE_FILES:
        path = LICENSES / name
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        starts = [m.start() for m in re.finditer(r"(?m)^ {2,3}\d+\. ", text)]
        out += [text[a:b].strip("\n") for a, b in zip(starts, starts[1:])]
    return out


def clip(text: str, count: Counter, target: int) -> str:
    """`text`'s first lines within `target` tokens (its whole first line at least)."""
    lines = text.splitlines()
    return grow(lambda n: "\n".join(lines[:n]), count, target, most=len(lines) + 1)


def _edit_code(i: int, count: Counter, target: int) -> Conversation:
    make, old, new, const = python_module(i)
    code = grow(make, count, target)
    return Conversation(f"edit-code-{i}", (), (
        f"Here is `records_{i}.py`:\n```python\n{code}\n```\nRepeat this file in full with one change: "
        f"rename the function `{old}` to `{new}`. Reply with the whole file only.",
        f"Now repeat your last answer in full with one more change: set `{const}` to 100."))


def _edit_license(i: int, count: Counter, target: int, sections: list[str]) -> Conversation:
    text = clip(sections[i % len(sections)], count, target)
    return Conversation(f"edit-text-{i}", (), (
        f"Here is a section of a licence:\n\n{text}\n\nRepeat it word for word, except that every "
        "\"License\" becomes \"Licence\".",
        "Repeat your last answer once more, with the section's heading in capital letters."))


def _edit_config(i: int, count: Counter, target: int) -> Conversation:
    text = grow(service_config(i), count, target)
    return Conversation(f"edit-config-{i}", (), (
        f"This is `config.json`:\n```json\n{text}\n```\nChange the port from {8000 + i} to 9090 and "
        "keep everything else exactly as it is. Reply with the JSON only.",
        "Repeat that JSON again, now also with \"debug\" set to true."))


def _edit_table(i: int, count: Counter, target: int) -> Conversation:
    make, part = price_table(i)
    text = grow(make, count, target)
    return Conversation(f"edit-table-{i}", (), (
        f"Stock list:\n```csv\n{text}\n```\nRepeat this table with the price of {part} changed to 9.99.",
        "Repeat the table again and add a row for a part named spare-1 at the end."))


def _tool_quote(i: int, count: Counter, target: int) -> Conversation:
    log = grow(test_log(i), count, target)
    history = ({"role": "user", "content": "Run the test suite and tell me what failed."},
               {"role": "assistant", "content": "Running the tests:\n```\n$ pytest -q\n```"})
    return Conversation(f"tool-quote-{i}", history, (
        f"The command printed:\n```\n{log}\n```\nQuote every line that starts with `FAILED` or `E ` "
        "exactly as it appears, then summarise in two sentences what is broken.",))


def agent_conversations(n: int, count: Counter, file_tokens: int) -> list[Conversation]:
    """`n` agent-style conversations, the kinds taking turns, each variant on its own file."""
    sections = license_sections()
    kinds: list[Callable[[int], Conversation]] = [
        lambda i: _edit_code(i, count, file_tokens),
        lambda i: _tool_quote(i, count, file_tokens),
        lambda i: _edit_config(i, count, file_tokens),
        lambda i: _edit_table(i, count, file_tokens),
    ]
    if sections:
        kinds.insert(1, lambda i: _edit_license(i, count, file_tokens, sections))
    return [kinds[j % len(kinds)](j // len(kinds)) for j in range(n)]


def open_conversations(n: int) -> list[Conversation]:
    """`n` open-text requests (stories, explanations): one turn each, nothing to copy."""
    k = len(OPEN_PROMPTS)
    return [Conversation(f"open-{j}", (), (OPEN_PROMPTS[j % k] + (f" (Take {j // k + 1}.)" if j >= k else ""),))
            for j in range(n)]


def sources() -> list[str]:
    """The licence files the agent workload cuts sections from (empty: generated files only)."""
    return [name for name in LICENSE_FILES if (LICENSES / name).is_file()]
