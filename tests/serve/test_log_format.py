"""`--log-format json`: one JSON object a log line; text stays the default."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from conftest import free_port, wait_for_health
from test_serve_flags import ENV, FAKE_SERVER

from strata.serve.log_format import JsonFormatter


def test_a_record_becomes_one_json_line_with_its_traceback() -> None:
    try:
        raise ValueError("bad \"value\"\nsecond line")
    except ValueError:
        record = logging.getLogger("strata.test").makeRecord(
            "strata.test", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert (out["level"], out["logger"], out["message"]) == ("error", "strata.test", "failed here")
    assert out["time"].endswith("+00:00") and "ValueError: bad" in out["exception"]


def test_the_server_logs_json_lines() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port), "--log-format", "json"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for_health(f"http://127.0.0.1:{port}", 20)
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=20)
    # the fake engine's own prints ("fake engine closed") are not log records
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("fake ")]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and len(records) == len(lines), output  # every line is a JSON object
    assert any("serving on http://127.0.0.1" in r["message"] for r in records)


def test_an_unknown_log_format_is_refused_before_anything_starts() -> None:
    done = subprocess.run([sys.executable, str(FAKE_SERVER), "--log-format", "yaml"], env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'yaml'" in done.stderr and "Traceback" not in done.stderr
