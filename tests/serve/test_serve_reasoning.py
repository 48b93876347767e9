"""Splitting `<think>` reasoning from the answer, whatever the delta boundaries."""

from __future__ import annotations

import pytest

from strata.serve.reasoning import ThinkSplitter, prompt_opens_thinking


def split(deltas: list[str], starts_inside: bool = False) -> tuple[str, str]:
    s = ThinkSplitter(starts_inside)
    pieces = [p for d in deltas for p in s.feed(d)] + s.flush()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content


TEXT = "  <think>\nweigh it</think>\n\nThe answer <think> stays."


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_any_chunking_gives_the_same_split(size: int) -> None:
    deltas = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert split(deltas) == ("\nweigh it", "The answer <think> stays.")


def test_no_tags_is_all_content_including_leading_space() -> None:
    assert split([" Hello", " world"]) == ("", " Hello world")
    assert split(["<thi", "nk about it"]) == ("", "<think about it")


def test_prompt_opened_block() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    assert split(["pondering</th", "ink>answer"], starts_inside=True) == ("pondering", "answer")


def test_unclosed_thinking_stays_reasoning() -> None:
    assert split(["<think>still going</thi"]) == ("still going</thi", "")


def test_in_reasoning_tracks_the_state() -> None:
    s = ThinkSplitter()
    assert s.in_reasoning
    s.feed("<think>a")
    assert s.in_reasoning
    s.feed("</think>b")
    assert not s.in_reasoning
