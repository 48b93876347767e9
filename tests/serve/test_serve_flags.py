"""`strata serve --alias NAME` (llama-server) / `--served-model-name NAME` (vLLM): the name the APIs
report, through the real entry point over the fake engine (a subprocess, no model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
# a script's sys.path starts at its own folder: name this checkout, or an installed strata answers
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                    os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("flag", ["--alias", "--served-model-name"])
def test_alias_is_the_model_name_the_apis_report(flag: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port), flag, "my-model"],
                            env={**ENV, "FAKE_LOAD_S": "0.5"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        names = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{url}/v1/models", timeout=1)
                names.append(r.json()["data"][0]["id"])
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except (httpx.TransportError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.05)
        assert names and set(names) == {"my-model"}  # while loading and once loaded
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        assert httpx.get(f"{url}/v1/models/my-model").status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"model": "anything", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "my-model"
        r = httpx.post(f"{url}/v1/messages", json={"model": "x", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "my-model"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out


def test_bad_value_ends_the_server_before_it_binds() -> None:
    proc = subprocess.run([sys.executable, str(FAKE_SERVER), "--port", str(free_port()), "--kv", "q8_0"],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "not 'q8_0'" in proc.stderr
    assert "binding" not in proc.stderr + proc.stdout
