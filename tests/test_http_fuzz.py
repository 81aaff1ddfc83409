"""Property-based fuzzing of the HTTP surface with schemathesis (the CLI, unmodified, from
PyPI) against a real ``rtts serve`` process over a real socket: every operation in
``/openapi.json`` gets generated valid and invalid requests, and none may answer 5xx or leave
a traceback in the server's log. It found a 500 on ``POST /v1/voices`` with a list as
``name`` (fixed). The long-text job API is on (a real redis-server and a worker). The fake
engine stands in for the model.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from procs import free_port, start_redis, start_rtts

KEY = "fuzz-key-0123456789abcdef"
ST = Path(sys.executable).with_name("st")


@pytest.mark.skipif(not ST.exists() and shutil.which("st") is None,
                    reason="schemathesis not installed")
def test_no_server_errors_and_no_tracebacks_under_schemathesis(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    (tmp_path / "redis").mkdir()
    with start_redis(tmp_path / "redis") as redis_url, start_rtts(
            ["--engine", "fake", "--api-key", KEY, "--voices-dir", str(tmp_path / "voices"),
             "--jobs", "--jobs-redis", redis_url, "--jobs-dir", str(tmp_path / "jobs")],
            port, log):
        run = subprocess.run(
            [str(ST if ST.exists() else shutil.which("st")), "run",
             f"http://127.0.0.1:{port}/openapi.json", "-H", f"Authorization: Bearer {KEY}",
             "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "17",
             "--workers", "1", "--no-color"],
            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "Tested: " in out
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
