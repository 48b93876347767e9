"""The canonical tool-calling values every model family's format converts to and from.

The HTTP layers (OpenAI, Anthropic) and the chat templates each spell tool
calls their own way; these types are the one shape in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: dict


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """A model's output split into its answer text and its tool calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class TextPiece:
    """Answer text, ready to send."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A new call: `index` counts the output's calls from 0."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    """More of call `index`'s arguments; a call's fragments concatenated are its arguments."""

    index: int
    fragment: str


Piece = Union[TextPiece, CallStart, ArgsPiece]
