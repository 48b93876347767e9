"""Streamed pieces: collecting them as they are made, and merging them into a Parsed."""

from __future__ import annotations

from collections.abc import Iterable

from strata.serve.tools.types import ArgsPiece, CallStart, Parsed, Piece, TextPiece, ToolCall


class PieceList:
    """Pieces in order, with neighbouring text (or one call's fragments) joined into one."""

    def __init__(self) -> None:
        self.items: list[Piece] = []

    def text(self, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if isinstance(last, TextPiece):
            self.items[-1] = TextPiece(last.text + text)
        else:
            self.items.append(TextPiece(text))

    def start(self, index: int, call_id: str, name: str) -> None:
        self.items.append(CallStart(index, call_id, name))

    def args(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self.items[-1] if self.items else None
        if isinstance(last, ArgsPiece) and last.index == index:
            self.items[-1] = ArgsPiece(index, last.fragment + fragment)
        else:
            self.items.append(ArgsPiece(index, fragment))

    def take(self) -> list[Piece]:
        """The pieces so far, leaving the list empty."""
        out, self.items = self.items, []
        return out


def merge_pieces(pieces: Iterable[Piece]) -> Parsed:
    """What a client ends up with after applying `pieces` in order."""
    text: list[str] = []
    starts: dict[int, CallStart] = {}
    args: dict[int, list[str]] = {}
    for piece in pieces:
        if isinstance(piece, TextPiece):
            text.append(piece.text)
        elif isinstance(piece, CallStart):
            starts[piece.index] = piece
            args.setdefault(piece.index, [])
        else:
            args.setdefault(piece.index, []).append(piece.fragment)
    calls = [
        ToolCall(starts[i].id, starts[i].name, "".join(args[i])) for i in sorted(starts)
    ]
    return Parsed("".join(text), calls)
