"""StopMatcher: stop strings are never shown, whatever way the text is cut into pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.stop import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    """Feed pieces until a stop; return all text shown (flush included) and the stop."""
    m = StopMatcher(stops)
    shown = []
    for piece in pieces:
        emit, stopped = m.push(piece)
        shown.append(emit)
        if stopped is not None:
            shown.append(m.flush())
            return "".join(shown), stopped
    shown.append(m.flush())
    return "".join(shown), None


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Cut at the stop string that completes first (the longest if several end together)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_stop_string_is_not_emitted_and_later_text_dropped() -> None:
    m = StopMatcher(["</s>"])
    assert m.push("Hello</s> world") == ("Hello", "</s>")
    assert m.push("more") == ("", "</s>")
    assert m.flush() == ""


def test_stop_split_across_pushes() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("abc S") == ("abc ", None)
    assert m.push("T") == ("", None)
    assert m.push("O") == ("", None)
    assert m.push("Px") == ("", "STOP")
    assert m.stopped == "STOP"


def test_partial_match_released_when_it_breaks() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", None)
    assert m.push("Ox") == ("STOx", None)


def test_flush_releases_incomplete_tail() -> None:
    m = StopMatcher(["\n\nUser:"])
    assert m.push("answer\n\nUs") == ("answer", None)
    assert m.flush() == "\n\nUs"
    assert m.stopped is None


def test_overlapping_prefixes() -> None:
    m = StopMatcher(["abd", "abc", "bce"])
    assert m.push("xab") == ("x", None)
    # "abc" completes here, before "bce" could.
    assert m.push("ce") == ("", "abc")
    m = StopMatcher(["abd", "bc"])
    assert m.push("ab") == ("", None)
    assert m.push("c") == ("a", "bc")


def test_same_end_prefers_longest() -> None:
    m = StopMatcher(["c", "abc"])
    assert m.push("xa") == ("x", None)
    assert m.push("bc") == ("", "abc")


def test_no_stop_strings_passes_text_through() -> None:
    m = StopMatcher(["", ""])
    assert m.push("a") == ("a", None)
    assert m.flush() == ""


def test_held_text_is_only_a_possible_stop_start() -> None:
    m = StopMatcher(["<|end|>"])
    emit, _ = m.push("x <|e")
    assert emit == "x "
    emit, _ = m.push("nd")
    assert emit == ""
    emit, _ = m.push(" no")
    assert emit == "<|end no"


@st.composite
def text_stops_pieces(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    alphabet = st.sampled_from("abc")
    text = draw(st.text(alphabet, max_size=30))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return text, stops, pieces


@settings(max_examples=200, deadline=None)
@given(text_stops_pieces())
def test_emitted_text_is_input_cut_at_first_stop(case: tuple[str, list[str], list[str]]) -> None:
    text, stops, pieces = case
    shown, stopped = run(stops, pieces)
    expected, expected_stop = reference(text, stops)
    assert shown == expected
    assert stopped == expected_stop
    for s in stops:
        assert s not in shown


@settings(max_examples=100, deadline=None)
@given(text_stops_pieces())
def test_nothing_emitted_could_still_start_a_stop(case: tuple[str, list[str], list[str]]) -> None:
    """Each emitted piece is final: text shown so far is a prefix of the final output."""
    text, stops, pieces = case
    final, _ = reference(text, stops)
    m = StopMatcher(stops)
    shown = ""
    for piece in pieces:
        emit, stopped = m.push(piece)
        shown += emit
        assert final.startswith(shown)
        if stopped is not None:
            break


def test_memory_is_linear_in_the_stop_strings_length() -> None:
    """A long stop string costs its length, not its length squared (every prefix kept)."""
    import tracemalloc

    stop = "ab" * 5_000 + "c"  # 10,001 characters: keeping every prefix would take ~50 MB
    tracemalloc.start()
    try:
        m = StopMatcher([stop, "xyz"])
        shown = [m.push("ab" * 100) for _ in range(60)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert all(emit == "" and stop_ is None for emit, stop_ in shown[:50])  # all could still be the stop
    last = m.push("c")
    assert "".join(emit for emit, _ in shown) + last[0] == "ab" * 1_000 and last[1] == stop


def test_long_stop_string_still_matches_across_pieces() -> None:
    stop = "ab" * 2_000 + "c"
    m = StopMatcher([stop])
    text = "x" + "ab" * 3_000 + "c tail"
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    shown, stopped = run([stop], pieces)
    assert stopped == stop and shown == "x" + "ab" * 1_000
    assert m.push("abab") == ("", None)
