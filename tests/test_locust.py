"""deploy/locustfile.py, run by the real locust CLI headless against a fake-engine
server: the custom TTFA and stall metrics arrive as locust request events for both kinds
of users, and the step ramp prints its per-step table."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

from procs import free_port, start_rtts

LOCUSTFILE = Path(__file__).resolve().parent.parent / "deploy" / "locustfile.py"


def locust(host: str, tmp: Path, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("locust") or str(Path(sys.executable).parent / "locust")
    return subprocess.run([exe, "-f", str(LOCUSTFILE), "--headless", "--host", host,
                           "--only-summary", *args], cwd=tmp, capture_output=True, text=True,
                          timeout=90, env={**os.environ, **(env or {})})


def test_locustfile_reports_ttfa_and_stall_and_ramps_in_steps(tmp_path):
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    with start_rtts(["--engine", "fake", "--fake-rtf", "0.3"], port, tmp_path / "serve.log"):
        out = locust(host, tmp_path, "-u", "4", "-r", "4", "-t", "10s",
                     "--csv", str(tmp_path / "run"))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        with (tmp_path / "run_stats.csv").open() as f:
            rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
        for kind in ("TTFA", "STALL"):
            for name in ("native /v1/stream", "openai /v1/audio/speech"):
                row = rows[(kind, name)]
                assert int(row["Request Count"]) >= 1 and int(row["Failure Count"]) == 0, row
        ttfa = rows[("TTFA", "native /v1/stream")]
        assert 0 < float(ttfa["Median Response Time"]) < 5000  # ms, a real measurement
        assert int(rows[("WS", "/v1/stream turn")]["Request Count"]) >= 1
        assert int(rows[("POST", "/v1/audio/speech")]["Failure Count"]) == 0

        # the documented ramp: 2 more users every 2 s up to 4, one line per step
        out = locust(host, tmp_path, "-t", "6s", env={"RTTS_RAMP": "2,2,4"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        text = out.stdout + out.stderr
        table = text[text.index("users  turns  ttfa_p50_ms"):].splitlines()
        steps = {int(line.split()[0]) for line in table[1:] if line.strip()[:1].isdigit()}
        assert steps <= {1, 2, 3, 4} and 4 in steps, table
