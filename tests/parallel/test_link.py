"""The stage link over loopback: handshake, refusals, messages, tensors, a peer that dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from strata.parallel.handshake import (
    GPU_ID_BYTES,
    MAGIC,
    NONCE_BYTES,
    VERSION,
    StageLinkError,
    read_exact,
    read_key,
)
from strata.parallel.link import Link, Listener, StageLinkTimeout, bind_notice, connect
from strata.parallel.messages import decode, encode, message

KEY = b"k" * 32
REPO = Path(__file__).resolve().parents[2]


@message("test.ping")
@dataclass(frozen=True)
class Ping:
    n: int
    text: str
    items: list
    extra: dict


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


@pytest.fixture
def listener():
    with Listener("127.0.0.1", 0, KEY, timeout=5.0) as lst:
        yield lst


def _pair(pool: ThreadPoolExecutor, listener: Listener, key: bytes = KEY) -> tuple[Link, Link]:
    accepted: Future[Link] = pool.submit(listener.accept, 10.0)
    main = connect("127.0.0.1", listener.port, key, timeout=5.0)
    return main, accepted.result(10)


def _server(pool: ThreadPoolExecutor, serve) -> int:
    """A one-connection TCP server running `serve(conn)`; returns its port."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with srv, srv.accept()[0] as conn:
            serve(conn)

    pool.submit(run)
    return srv.getsockname()[1]


def test_messages_and_tensors_both_ways(pool, listener):
    main, worker = _pair(pool, listener)
    with main, worker:
        assert main.peer == f"127.0.0.1:{listener.port}" and worker.peer.startswith("127.0.0.1:")
        ping = Ping(3, "héllo", [1, 2.5, None, True], {"a": [1, {"b": "c"}]})
        main.send(ping)
        assert worker.recv(5) == ping
        worker.send(Ping(-1, "", [], {}))
        assert main.recv(5) == Ping(-1, "", [], {})
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ((1, 4096), (3, 7), (2, 3, 5), (1,)):
                for a, b in ((main, worker), (worker, main)):
                    t = torch.randn(shape).to(dtype)
                    sent = pool.submit(a.send_tensor, t)
                    got = b.recv_tensor(shape, dtype)
                    sent.result(5)
                    assert got.dtype == dtype and torch.equal(got, t)
        assert main.tensor_device == torch.device("cpu")
        assert main.bytes_sent == worker.bytes_received > 4096 * (4 + 2)
        assert worker.bytes_sent == main.bytes_received
    main.close()  # idempotent
    with pytest.raises(StageLinkError, match="the link is closed"):
        main.send(ping)


def test_timeouts_raise_instead_of_hanging(pool):
    with Listener("127.0.0.1", 0, KEY, timeout=0.5) as listener:
        main, worker = _pair(pool, listener)
        with main, worker:
            start = time.monotonic()
            with pytest.raises(StageLinkTimeout, match="no message"):
                worker.recv(0.2)
            assert time.monotonic() - start < 2
            main.send(Ping(1, "x", [], {}))
            assert worker.recv(5) == Ping(1, "x", [], {})  # a message timeout leaves it usable
            start = time.monotonic()
            with pytest.raises(StageLinkError, match="receiving a tensor .* failed: Timed out"):
                worker.recv_tensor((4,), torch.float32)
            assert time.monotonic() - start < 2
            with pytest.raises(StageLinkError, match="receiving a tensor from"):
                worker.recv_tensor((4,), torch.float32)  # the tensor channel stays failed


def test_wrong_key_is_refused_on_both_sides_then_a_good_main_gets_in(pool, listener):
    accepted = pool.submit(listener.accept, 10.0)
    with pytest.raises(StageLinkError, match="wrong key: the worker rejected this side's key"):
        connect("127.0.0.1", listener.port, b"x" * 32, timeout=5.0)
    with pytest.raises(StageLinkError, match="wrong key: the main did not prove"):
        accepted.result(10)
    main, worker = _pair(pool, listener)
    main.close()
    worker.close()


def test_closing_the_listener_wakes_accept(pool):
    listener = Listener("127.0.0.1", 0, KEY)
    accepted = pool.submit(listener.accept)
    time.sleep(0.2)
    listener.close()
    with pytest.raises(StageLinkError, match="the listener is closed"):
        accepted.result(5)


def test_main_refuses_a_worker_that_cannot_prove_the_key(pool):
    def fake_worker(conn: socket.socket) -> None:
        conn.sendall(MAGIC + bytes([VERSION]) + os.urandom(NONCE_BYTES))
        conn.recv(1024)
        conn.sendall(b"A" + bytes(19) + os.urandom(32))  # a rendezvous with a made-up proof
        conn.recv(1024)

    port = _server(pool, fake_worker)
    with pytest.raises(StageLinkError, match="wrong key: the worker did not prove"):
        connect("127.0.0.1", port, KEY, timeout=5.0)


def test_refusal_reaches_the_main_and_the_listener_stays_usable(pool, listener):
    accepted = pool.submit(listener.accept, 10.0, lambda: "a main is already connected")
    with pytest.raises(StageLinkError, match="worker refused: a main is already connected"):
        connect("127.0.0.1", listener.port, KEY, timeout=5.0)
    with pytest.raises(StageLinkError, match="refused: a main is already connected"):
        accepted.result(10)
    main, worker = _pair(pool, listener)
    main.close()
    worker.close()


def _recording_proxy(pool: ThreadPoolExecutor, port: int, recorded: bytearray) -> int:
    """A one-connection proxy to `port` that keeps what the client sent."""

    def pump(src: socket.socket, dst: socket.socket, keep: bool) -> None:
        while chunk := src.recv(65536):
            if keep:
                recorded.extend(chunk)
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)

    def serve(client: socket.socket) -> None:
        with socket.create_connection(("127.0.0.1", port)) as upstream:
            back = threading.Thread(target=pump, args=(upstream, client, False))
            back.start()
            pump(client, upstream, True)
            back.join(10)

    return _server(pool, serve)


def test_replayed_handshake_is_refused(pool, listener):
    recorded = bytearray()
    proxy = _recording_proxy(pool, listener.port, recorded)
    accepted = pool.submit(listener.accept, 10.0)
    main = connect("127.0.0.1", proxy, KEY, timeout=5.0)
    accepted.result(10).close()
    main.close()
    assert len(recorded) == NONCE_BYTES + 1 + GPU_ID_BYTES + 32

    accepted = pool.submit(listener.accept, 10.0)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as replay:
        assert read_exact(replay, len(MAGIC) + 1 + NONCE_BYTES, "the greeting").startswith(MAGIC)
        replay.sendall(bytes(recorded))
        with pytest.raises(StageLinkError, match="wrong key"):
            accepted.result(10)
        assert replay.recv(16) == b"K"


def test_non_strata_clients_are_refused(pool):
    with Listener("127.0.0.1", 0, KEY, timeout=0.5) as listener:
        cases = [(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3, "wrong key"),
                 (b"hello", "peer closed the link"),
                 (b"", "timed out")]
        for garbage, reason in cases:
            accepted = pool.submit(listener.accept, 10.0)
            with socket.create_connection(("127.0.0.1", listener.port)) as sock:
                sock.sendall(garbage)
                if reason != "timed out":
                    sock.shutdown(socket.SHUT_WR)
                with pytest.raises(StageLinkError, match=reason):
                    accepted.result(10)
        main, worker = _pair(pool, listener)
        main.close()
        worker.close()


def test_connecting_to_something_else_fails_with_a_reason(pool):
    port = _server(pool, lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"))
    with pytest.raises(StageLinkError, match="not a Strata stage"):
        connect("127.0.0.1", port, KEY, timeout=5.0)
    port = _server(pool, lambda conn: conn.recv(1024))
    with pytest.raises(StageLinkError, match="timed out waiting for the worker's greeting"):
        connect("127.0.0.1", port, KEY, timeout=0.3)


def test_oversize_messages_are_refused(pool):
    with Listener("127.0.0.1", 0, KEY, timeout=5.0, max_message=1024) as listener:
        main, worker = _pair(pool, listener)
        with main, worker:
            with pytest.raises(StageLinkError, match="over the cap of 16777216 bytes"):
                main.send(Ping(0, "x" * (17 * 2**20), [], {}))
            main.send(Ping(0, "x" * 4096, [], {}))
            too_big = r"peer sent a message of \d+ bytes, over the cap of 1024 bytes"
            with pytest.raises(StageLinkError, match=too_big):
                worker.recv(5)


def test_encode_and_decode_are_strict():
    assert decode(encode(Ping(1, "a", (1, (2, 3)), {}))) == Ping(1, "a", [1, [2, 3]], {})
    for bad, reason in [(Ping(1, "a", [{1, 2}], {}), r"test.ping.items\[0\]: a set"),
                        (Ping(1, "a", [], {1: 2}), "dict key 1 is not a str"),
                        (Ping(float("nan"), "a", [], {}), "nan is not a JSON number"),
                        (object(), "object is not a registered message")]:
        with pytest.raises(StageLinkError, match=reason):
            encode(bad)
    full = b'{"type": "test.ping", "n": 1, "text": "", "items": [], "extra": {}}'
    assert decode(full) == Ping(1, "", [], {})
    for data, reason in [(b"{not json", "not UTF-8 JSON"),
                         (b"\xff\xfe", "not UTF-8 JSON"),
                         (b"[1]", "with a string 'type'"),
                         (b'{"type": "nope"}', "unknown message type 'nope'"),
                         (b'{"type": "test.ping", "n": 1}', "lacks extra, items, text"),
                         (full[:-1] + b', "more": 2}', "unknown fields more")]:
        with pytest.raises(StageLinkError, match=reason):
            decode(data)
    with pytest.raises(TypeError, match="frozen"):
        message("test.loose")(dataclass(type("Loose", (), {"__annotations__": {"n": int}})))
    with pytest.raises(TypeError, match="already Ping"):
        message("test.ping")(dataclass(frozen=True)(type("Again", (), {})))


CHILD = """
import sys, time
from strata.parallel.handshake import read_key
from strata.parallel.link import connect
link = connect("127.0.0.1", int(sys.argv[1]), read_key(sys.argv[2]), timeout=10.0)
time.sleep(120)
"""


def test_a_killed_peer_fails_recv_at_once_and_recv_tensor_within_its_timeout(tmp_path):
    key_file = tmp_path / "stage.key"
    key_file.write_bytes(KEY + b"\n")
    with Listener("127.0.0.1", 0, KEY, timeout=3.0) as listener:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(listener.port), str(key_file)],
                                 cwd=REPO)
        try:
            worker = listener.accept(timeout=60)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        with worker:
            start = time.monotonic()
            with pytest.raises(StageLinkError, match="peer closed the link"):
                worker.recv(30)
            assert time.monotonic() - start < 2
            start = time.monotonic()
            with pytest.raises(StageLinkError, match="receiving a tensor from 127.0.0.1"):
                worker.recv_tensor((1, 4096), torch.bfloat16)
            assert time.monotonic() - start < worker.timeout + 2


def test_read_key(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"  0123456789abcdef0123\n")
    assert read_key(str(good)) == b"0123456789abcdef0123"
    short = tmp_path / "short"
    short.write_bytes(b"0123456789\n")
    with pytest.raises(StageLinkError, match="short: the stage key is 10 bytes, it needs at least"):
        read_key(str(short))
    with pytest.raises(StageLinkError, match="missing: cannot read the stage key file"):
        read_key(str(tmp_path / "missing"))


def test_bind_notice():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert bind_notice(host) is None
    for host in ("0.0.0.0", "::", "10.0.0.5", "stage-host"):
        notice = bind_notice(host)
        assert notice is not None and "nothing is encrypted" in notice and host in notice
