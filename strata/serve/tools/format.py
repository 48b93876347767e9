"""What every model family's tool-call format provides, whatever its syntax."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any, Protocol

from strata.serve.tools.ids import IdFactory, new_call_id
from strata.serve.tools.messages import TemplateInput
from strata.serve.tools.types import Parsed, Piece, Tool


class ToolStream(Protocol):
    """One output's text, fed in order; the pieces are ready to send as they come."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ToolFormat(Protocol):
    """Parsing, streaming, constraining and prompting tool calls for one model family.

    `markers` are the texts a call grammar writes around calls; the caller
    finds which of them are single special tokens of its model (see
    grammar.special_ids_for) and passes them to `call_grammar` as `special_ids`.
    """

    name: str
    markers: tuple[str, ...]

    def parse(
        self, text: str, tool_names: Set[str], new_id: IdFactory = new_call_id
    ) -> Parsed: ...

    def stream(self, tool_names: Set[str], new_id: IdFactory = new_call_id) -> ToolStream: ...

    def call_grammar(
        self, tools: Sequence[Tool], *, parallel: bool, special_ids: Mapping[str, int]
    ) -> str: ...

    def for_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]
    ) -> TemplateInput: ...
