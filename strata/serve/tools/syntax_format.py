"""Parsing and streaming shared by the formats that declare their calls as a `Syntax`."""

from __future__ import annotations

from collections.abc import Set

from strata.serve.tools.call_stream import CallStream
from strata.serve.tools.ids import IdFactory, new_call_id
from strata.serve.tools.pieces import merge_pieces
from strata.serve.tools.syntax import Syntax
from strata.serve.tools.types import Parsed


class SyntaxFormat:
    """`parse` is the stream run over the whole text, so the two can never disagree."""

    syntax: Syntax

    def parse(self, text: str, tool_names: Set[str], new_id: IdFactory = new_call_id) -> Parsed:
        """Never raises: anything that is not a well-formed call of a known tool is content."""
        stream = self.stream(tool_names, new_id)
        return merge_pieces(stream.feed(text) + stream.finish())

    def stream(self, tool_names: Set[str], new_id: IdFactory = new_call_id) -> CallStream:
        return CallStream(self.syntax, tool_names, new_id)
