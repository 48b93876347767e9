"""Record what llama.cpp's named chat templates make of a few conversations (JSON), the oracle
of `strata/tokenizer/named_templates.py`.

    python -m tools.llama_templates PATH/TO/libllama.so tests/tokenizer/data/llama_named_templates.json

`llama_chat_apply_template` takes a template name and formats the messages with llama.cpp's own
code; the file holds, per name, the text for each conversation of `CONVERSATIONS`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

from strata.tokenizer.named_templates import NAMED

# (messages, add_generation_prompt): a system prompt and two turns; padded content (trimming);
# one user message
CONVERSATIONS: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
      {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Who are you"}], True),
    ([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "  padded text \n"},
      {"role": "assistant", "content": " reply  "}, {"role": "user", "content": "again"}], False),
    ([{"role": "user", "content": "Hello"}], True),
]


class _Message(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


def apply(lib: ctypes.CDLL, name: str, messages: list[dict[str, str]], add_ass: bool) -> str:
    """llama.cpp's text for `messages` under the template called `name`."""
    chat = (_Message * len(messages))(*[_Message(m["role"].encode(), m["content"].encode()) for m in messages])
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = lib.llama_chat_apply_template(name.encode(), chat, len(messages), add_ass, buf, size)
    if n < 0:
        raise ValueError(f"llama.cpp does not know the template {name!r}")
    return buf.raw[:n].decode("utf-8")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.llama_templates", description=__doc__.splitlines()[0])
    p.add_argument("libllama")
    p.add_argument("out")
    args = p.parse_args()
    lib = ctypes.CDLL(args.libllama)
    lib.llama_chat_apply_template.restype = ctypes.c_int32
    lib.llama_chat_apply_template.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Message), ctypes.c_size_t,
                                             ctypes.c_bool, ctypes.c_char_p, ctypes.c_int32]
    record = {"conversations": [{"messages": m, "add_generation_prompt": a} for m, a in CONVERSATIONS],
              "texts": {name: [apply(lib, name, m, a) for m, a in CONVERSATIONS] for name in NAMED}}
    Path(args.out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
