"""Grammars that constrain a request's output, through llguidance.

A grammar travels as llguidance's grammar text (what the `*_grammar`
functions return); `Grammars` checks such texts against one model's
tokenizer and makes the per-request matchers that compute allowed-token
masks. Building llguidance's tokenizer costs about a second, so it happens
on first use, once, whichever thread gets there first: the server checks
grammars from worker threads while the engine thread makes matchers.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from strata.errors import BadRequest
from strata.tokenizer import Tokenizer

# Compile options for JSON schemas: compact separators, and whitespace where JSON allows it,
# but at most 24 characters in a row (enough to indent a nested pretty-printed value), so a
# model that keeps choosing spaces cannot run to max_tokens inside a valid document. A schema's
# own "x-guidance" options override these.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}",
}


class GrammarError(BadRequest):
    """A grammar or JSON schema llguidance cannot use; `param` names the request field."""


def json_schema_grammar(schema: dict | bool, *, param: str) -> str:
    """The grammar of JSON documents valid under `schema`, properties in the schema's order.

    Only the schema's form is checked here; `Grammars.check` compiles it.
    """
    if schema is False:  # options need an object; `check` reports this one as unsatisfiable
        return LLMatcher.grammar_from_json_schema("false")
    try:
        text = json.dumps(_schema_object(schema, param), allow_nan=False)
        return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise GrammarError(f"invalid JSON schema: {e}", param) from None


def _schema_object(schema: object, param: str) -> dict:
    """The schema as an object (true is {}), or GrammarError."""
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object or a boolean", param)
    return schema


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `response_format: json_object`)."""
    return json_schema_grammar({"type": "object"}, param="response_format")


def lark_grammar(text: str) -> str:
    """A grammar in llguidance's Lark dialect (`%json { schema }` embeds a JSON schema)."""
    return LLMatcher.grammar_from_lark(text)


def lark_json(schema: dict | bool, *, param: str) -> str:
    """`%json { schema }` for a Lark rule, compiled with JSON_OPTIONS like `json_schema_grammar`.

    A bare `%json` allows unbounded whitespace; the schema's own "x-guidance" still wins.
    """
    if schema is False:
        raise GrammarError("the JSON schema false allows no document", param)
    schema = _schema_object(schema, param)
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise GrammarError("a JSON schema's x-guidance must be an object", param)
    try:
        return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **own}}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"invalid JSON schema: {e}", param) from None


class Grammars:
    """Grammar checks and matchers for one model: its tokenizer, stop ids and logits width."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """`vocab_size` is the model's logits width, which may exceed the tokenizer's vocabulary."""
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)  # the masks' width in bits
        self._built: LLTokenizer | None = None
        self._unusable: str | None = None  # why llguidance could not take the tokenizer
        self._lock = threading.Lock()

    def lltokenizer(self, param: str = "grammar") -> LLTokenizer:
        """llguidance's view of the tokenizer, built on the first call (thread-safe).

        A tokenizer llguidance cannot read makes every grammar a GrammarError (tried once).
        """
        with self._lock:
            if self._built is None and self._unusable is None:
                try:
                    self._built = LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=sorted(self._tokenizer.stop_token_ids))
                except Exception as e:  # noqa: BLE001 - reported with every grammar instead
                    self._unusable = f"{type(e).__name__}: {e}"
            built, unusable = self._built, self._unusable
        if built is None:
            raise GrammarError(f"grammars are not available for this model's tokenizer: {unusable}", param)
        return built

    def check(self, grammar: str, param: str) -> None:
        """Raise GrammarError with llguidance's message when `grammar` cannot be used."""
        error = LLMatcher.validate_grammar(grammar, self.lltokenizer(param))
        if error:
            raise GrammarError(f"invalid grammar: {error}", param)

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError if the grammar is invalid."""
        matcher = LLMatcher(self.lltokenizer(), grammar, log_level=0)  # errors are reported, not logged
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}", "grammar")
        return matcher
