"""llama-server's --no-slots and a unix-socket --host, through the real `strata serve` entry point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import free_port, wait_for_health

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def _start(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(FAKE_SERVER), *flags], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_no_slots_turns_the_lane_list_off_only() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start("--port", str(port), "--no-slots")
    try:
        assert wait_for_health(url, 60)
        r = httpx.get(f"{url}/slots")
        assert r.status_code == 501 and "--no-slots" in r.text
        assert httpx.post(f"{url}/slots/0?action=erase").status_code == 200  # the actions stay
    finally:
        _stop(proc)
    port = free_port()
    proc = _start("--port", str(port))
    try:
        assert wait_for_health(f"http://127.0.0.1:{port}", 60)
        assert httpx.get(f"http://127.0.0.1:{port}/slots").status_code == 200  # the default lists them
    finally:
        _stop(proc)


def test_a_host_ending_in_sock_binds_a_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "strata.sock"
    proc = _start("--host", str(sock))
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://strata")
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.get("/health").json().get("status") == "ok":
                    break
            except (httpx.TransportError, ValueError):
                pass
            assert time.monotonic() < deadline, "the server never answered on its socket"
            time.sleep(0.2)
        assert client.get("/v1/models").status_code == 200
    finally:
        out = _stop(proc)
    assert f"unix socket {sock}" in out
