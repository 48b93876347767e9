"""Session files: exact round trips; every kind of bad file refused before anything is returned."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from strata.engine.snapshot import (
    FORMAT_VERSION,
    load_session,
    peek_session,
    read_session,
    resolve_session_path,
    save_session,
)
from strata.errors import BadRequest, SessionFileError

IDENTITY = "3f1c" * 16
FORMAT = "int8"


def layers(n: int, capacity: int | None = None, n_layers: int = 3) -> list[dict[str, torch.Tensor]]:
    """K/V of mixed dtypes, sized `capacity` cells (only the first n are the conversation's)."""
    g = torch.Generator().manual_seed(n)
    cap = capacity or n
    out = []
    for _ in range(n_layers):
        out.append({
            "k_q": torch.randint(-128, 128, (cap, 2, 8), dtype=torch.int8, generator=g),
            "k_scale": torch.randn(cap, 2, generator=g).to(torch.bfloat16),
            "v_q": torch.randint(0, 256, (cap, 2, 4), dtype=torch.uint8, generator=g),
            "v_scale": torch.randn(cap, 2, generator=g).to(torch.float16),
            "extra32": torch.randn(cap, 3, generator=g),
        })
    return out


def save(path: Path, n: int = 17, **kw) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    tokens = [(i * 7919) % 50_000 for i in range(n)]
    kv = layers(n, capacity=n + 5)
    save_session(path, tokens, kv, model_identity=IDENTITY, kv_format=FORMAT, **kw)
    return tokens, kv


def load(path: Path, identity: str = IDENTITY, kv_format: str = FORMAT):
    return load_session(path, model_identity=identity, kv_format=kv_format)


def refused(path: Path, match: str, **kw) -> SessionFileError:
    with pytest.raises(SessionFileError, match=match) as info:
        load(path, **kw)
    assert info.value.path == str(path) and str(path) in str(info.value)
    return info.value


def test_round_trip_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "chat.session"
    tokens, kv = save(path)
    got_tokens, got = load(path)
    assert got_tokens.tolist() == tokens and got_tokens.dtype == torch.int32
    assert len(got) == len(kv)
    for want, have in zip(kv, got):
        assert list(have) == list(want)  # run order kept
        for name in want:
            assert have[name].dtype == want[name].dtype
            assert torch.equal(have[name], want[name][: len(tokens)])
    head = peek_session(path)
    assert (head.n_tokens, head.n_layers, head.kv_format) == (17, 3, FORMAT)
    assert head.model_identity == IDENTITY and head.version == FORMAT_VERSION
    assert [r.dtype for r in head.layers[0]] == ["int8", "bfloat16", "uint8", "float16", "float32"]
    assert head.layers[0][0].shape == (2, 8)
    assert path.stat().st_size > head.payload_len


def test_empty_conversation_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    save_session(path, [], layers(0, capacity=4), model_identity=IDENTITY, kv_format=FORMAT)
    tokens, kv = load(path)
    assert len(tokens) == 0 and all(len(t) == 0 for s in kv for t in s.values())


def test_write_is_atomic_and_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    save(path, n=5)
    save(path, n=9)
    assert load(path)[0].numel() == 9
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no temporary file left behind
    def full_disk(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(SessionFileError, match="cannot write"):
        save(path, n=3)
    monkeypatch.undo()
    assert load(path)[0].numel() == 9 and sorted(os.listdir(tmp_path)) == ["s"]


def test_save_into_a_missing_folder_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "s"
    with pytest.raises(SessionFileError, match="cannot write") as info:
        save(path)
    assert info.value.path == str(path)


def test_save_refuses_too_few_cells(tmp_path: Path) -> None:
    with pytest.raises(SessionFileError, match="fewer than"):
        save_session(tmp_path / "s", [1, 2, 3], layers(2),
                     model_identity=IDENTITY, kv_format=FORMAT)


@pytest.mark.parametrize("keep", [0, 5, 13, 60, -1])
def test_truncated_file(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "t"
    save(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    refused(path, "truncated")


def test_trailing_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t"
    save(path)
    path.write_bytes(path.read_bytes() + b"\0")
    refused(path, "unexpected bytes")


def test_flipped_payload_byte(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(path)
    size = path.stat().st_size
    for offset in (size - 1, size - peek_session(path).payload_len, size - 100):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        bad = tmp_path / f"c{offset}"
        bad.write_bytes(bytes(data))
        refused(bad, "payload checksum")


def test_flipped_header_byte(tmp_path: Path) -> None:
    path = tmp_path / "h"
    save(path)
    data = bytearray(path.read_bytes())
    data[30] ^= 0x20
    path.write_bytes(bytes(data))
    refused(path, "header checksum")


def test_wrong_model(tmp_path: Path) -> None:
    path = tmp_path / "m"
    save(path)
    refused(path, "another model", identity="ab" * 32)
    with pytest.raises(SessionFileError, match="another model"):
        peek_session(path, model_identity="ab" * 32)


def test_wrong_kv_format(tmp_path: Path) -> None:
    path = tmp_path / "f"
    save(path)
    refused(path, "--kv int8.*--kv bf16", kv_format="bf16")


def test_wrong_version_and_magic(tmp_path: Path) -> None:
    path = tmp_path / "v"
    save(path)
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))
    refused(path, f"version {FORMAT_VERSION + 1}")
    data[0:8] = b"GGUF\0\0\0\0"
    path.write_bytes(bytes(data))
    refused(path, "not a Strata session file")


def test_missing_file(tmp_path: Path) -> None:
    refused(tmp_path / "absent", "cannot open")


@pytest.mark.parametrize(
    "name", ["", "  ", ".", "..", "../x", "a/b", "/etc/passwd", "..\\x", "a\\b", "x\0y", "n" * 300]
)
def test_session_names_that_could_leave_the_folder(tmp_path: Path, name: str) -> None:
    with pytest.raises(BadRequest) as info:
        resolve_session_path(tmp_path, name)
    assert info.value.param == "filename"


def test_symlink_out_of_the_session_folder_is_refused(tmp_path: Path) -> None:
    inside = tmp_path / "sessions"
    inside.mkdir()
    (inside / "escape").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadRequest, match="outside"):
        resolve_session_path(inside, "escape")


def test_plain_names_resolve_inside_the_folder(tmp_path: Path) -> None:
    for name in ("chat-1.bin", "..hidden", "a b"):
        path = resolve_session_path(tmp_path, name)
        assert path.parent == tmp_path.resolve() and path.name == name


def states(n_tokens: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Saved states at two positions, the last at the conversation's end."""
    g = torch.Generator().manual_seed(5)
    return [(pos, {"0.conv": torch.randn(6, 3, generator=g), "0.ssm": torch.randn(2, 4, 4, generator=g),
                   "4.ssm": torch.randn(2, 4, 4, generator=g).to(torch.bfloat16)})
            for pos in (n_tokens - 1, n_tokens)]


def rewrite_header(path: Path, version: int, edit) -> None:
    """Rewrite a file's header JSON (and its checksum) as `edit` says, with another version."""
    import json
    import zlib

    data = path.read_bytes()
    _, _, hlen = struct.unpack("<8sII", data[:16])
    header = edit(json.loads(data[16 : 16 + hlen]))
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<8sII", b"STRATAKV", version, len(blob)) + blob
                     + struct.pack("<I", zlib.crc32(blob)) + data[16 + hlen + 4 :])


def test_saved_states_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "recurrent"
    want = states(17)
    tokens, kv = save(path, states=want)
    data = read_session(path, model_identity=IDENTITY, kv_format=FORMAT)
    assert data.tokens.tolist() == tokens and len(data.layers) == len(kv)
    assert [pos for pos, _ in data.states] == [16, 17]
    for (_, w), (_, h) in zip(want, data.states):
        assert list(h) == list(w) and all(torch.equal(h[k], w[k]) and h[k].dtype == w[k].dtype for k in w)
    head = peek_session(path)
    assert head.state_positions == (16, 17) and head.state_runs[2].dtype == "bfloat16"


def test_a_damaged_state_fails_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "recurrent"
    save(path, states=states(17))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # the last state's bytes
    path.write_bytes(bytes(data))
    refused(path, "payload checksum mismatch")


def test_version_1_files_still_load(tmp_path: Path) -> None:
    path = tmp_path / "old"
    tokens, kv = save(path)
    rewrite_header(path, 1, lambda h: {k: v for k, v in h.items() if k != "states"})
    assert peek_session(path).version == 1
    got_tokens, got = load(path)
    assert got_tokens.tolist() == tokens and torch.equal(got[1]["k_q"], kv[1]["k_q"][: len(tokens)])
    assert read_session(path, model_identity=IDENTITY, kv_format=FORMAT).states == []


def test_states_in_a_version_1_file_or_out_of_order_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    save(path, states=states(17))
    rewrite_header(path, 1, lambda h: h)
    refused(path, "version 1 file cannot hold saved states")
    save(path, states=states(17))

    def backwards(h):
        h["states"]["positions"] = [17, 16]
        return h

    rewrite_header(path, FORMAT_VERSION, backwards)
    refused(path, "not ascending")
    with pytest.raises(SessionFileError, match="positions must ascend"):
        save(path, states=states(17)[::-1])
