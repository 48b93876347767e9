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
