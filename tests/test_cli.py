"""The `strata` command: streaming generation and one-line errors for bad models."""

from __future__ import annotations

import pytest

from strata.cli import main


def test_generate_streams_text_from_a_model_folder(tiny_model_dir, capsys) -> None:
    rc = main(["generate", "--model", str(tiny_model_dir), "--max-tokens", "5", "Hello there"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.strip()
    assert "5 generated tokens" in out.err


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p / "missing.gguf", "no such file"),
        (lambda p: (p / "junk.gguf").write_bytes(b"not a gguf file at all") and p / "junk.gguf", "junk.gguf"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "config.json"),
    ],
)
def test_bad_model_is_one_clear_line(tmp_path, capsys, make, words) -> None:
    path = make(tmp_path)
    rc = main(["generate", "--model", str(path), "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1].startswith("strata: error:") and words in err[-1]
    assert not any("Traceback" in line for line in err)


def test_truncated_default_model_copy_is_one_clear_line(tmp_path, capsys, default_gguf) -> None:
    data = default_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 3])
    rc = main(["generate", "--model", str(bad), "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and "cut.gguf" in err[-1] and "Traceback" not in "\n".join(err)


def test_chat_session_is_saved_and_restored(tiny_model_dir, tmp_path, capsys, monkeypatch) -> None:
    import io
    import json

    args = ["chat", "--model", str(tiny_model_dir), "--max-tokens", "4",
            "--session-dir", str(tmp_path), "--session", "talk"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n\n"))
    assert main(args) == 0
    assert (tmp_path / "talk").is_file()
    assert len(json.loads((tmp_path / "talk.messages.json").read_text())) == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("And again\n\n"))
    assert main(args) == 0
    assert "restored talk: 2 messages" in capsys.readouterr().err
    assert len(json.loads((tmp_path / "talk.messages.json").read_text())) == 4


def test_chat_session_needs_a_session_dir(tiny_model_dir, capsys) -> None:
    rc = main(["chat", "--model", str(tiny_model_dir), "--session", "x"])
    assert rc == 1 and "--session-dir" in capsys.readouterr().err


def test_chat_keeps_going_past_empty_lines_and_ends_on_exit(tiny_model_dir, capsys, monkeypatch) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n\n   \nAgain\n/exit\nnever read\n"))
    assert main(["chat", "--model", str(tiny_model_dir), "--max-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 2  # two replies: the empty lines ended nothing, /exit did


def test_ctrl_c_stops_a_reply_and_keeps_what_was_said(monkeypatch, capsys) -> None:
    """`_stream_reply` with a handle whose second event is interrupted: the request is cancelled,
    the text so far (and the cancelled request's last event) is the reply."""
    from types import SimpleNamespace

    from strata.cli import _stream_reply

    class Handle:
        def __init__(self) -> None:
            self.cancelled = False
            self.events = iter([SimpleNamespace(text="Par"), KeyboardInterrupt, SimpleNamespace(text="is")])

        def __iter__(self):
            return self

        def __next__(self):
            ev = next(self.events)
            if ev is KeyboardInterrupt:
                raise KeyboardInterrupt
            return ev

        def cancel(self) -> None:
            self.cancelled = True

    handle = Handle()
    engine = SimpleNamespace(generate=lambda ids, params: handle)
    assert _stream_reply(engine, [1], None) == "Paris" and handle.cancelled
    assert "[stopped]" in capsys.readouterr().err


def test_ctrl_c_at_the_prompt_drops_the_line_not_the_chat(monkeypatch, capsys) -> None:
    from strata.cli import _read_line

    answers = iter([KeyboardInterrupt, "", "hi", "/quit"])

    def fake_input(prompt: str) -> str:
        a = next(answers)
        if a is KeyboardInterrupt:
            raise KeyboardInterrupt
        return a

    monkeypatch.setattr("builtins.input", fake_input)
    assert _read_line() == "hi" and _read_line() is None
    assert "Ctrl-D or /exit ends" in capsys.readouterr().err
