"""The byte-level alphabet of GPT-2 style BPE vocabularies.

Byte-level vocabularies spell every byte as one printable character so that
merges never see whitespace or control bytes. Knowing the table lets us spell
tokens that a GGUF stores as raw text and turn a token back into its bytes.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """Byte value -> the character that spells it in a byte-level vocabulary."""
    kept = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    """The inverse of `byte_to_char`."""
    return {c: b for b, c in byte_to_char().items()}


def spell(text: str) -> str:
    """Spell `text` in the byte-level alphabet (its UTF-8 bytes, one char each)."""
    table = byte_to_char()
    return "".join(table[b] for b in text.encode("utf-8"))


def is_spelled(token: str) -> bool:
    """Whether `token` is already written in the byte-level alphabet."""
    table = char_to_byte()
    return all(c in table for c in token)


def unspell(token: str) -> bytes:
    """The bytes a byte-level token stands for; raw UTF-8 when it is not spelled."""
    table = char_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return token.encode("utf-8")
