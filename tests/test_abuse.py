"""Mixed abuse under load (issue 31): many abusive clients at once, a well-behaved client
measuring time to first audio throughout, and nothing leaked afterwards.

A real ``rtts serve --engine fake`` process (batching continuously, as ChatTTS does; with
a real redis-server for jobs, when one is installed) gets ``CLIENTS`` abusive clients for
``SECONDS`` (tests/abuse_clients.py, a process of its own: slowloris heads and bodies,
idle TCP and WebSocket sockets, 20,000-character normalization texts, speaker-string
bombs, job bombs, protocol-error floods, silent Wyoming connections, from 127.0.0.10-13),
while a well-behaved native client (from 127.0.0.2, so the per-address caps the abusers
fill are not its own) measures its time to first audio. Its median under attack stays
within 2x of idle (plus 50 ms of scheduling noise on a shared CPU); afterwards every
``rtts_active_*`` gauge of ``/metrics`` is back to 0, RSS after the round is within 5% of
what it was after the warm-up rounds of the same mix (after the server's idle heap trim;
the lower of the long round's figure and one more short round's, against the higher of the
two warm-up rounds'), and the log holds no traceback. The long run (200 clients, 60 s;
marker ``abuse``, run by .ci/run as its own step) does it with and without a 1024
open-file limit on the server; the short one (40 clients, 8 s, under the 1024 limit, one
warm-up round, no RSS comparison) has the marker ``long`` (``make test-long``, also a step
of .ci/run).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from procs import free_port, start_redis, start_rtts
from rtts.core.service import TRIM_EVERY_S

HERE = Path(__file__).resolve().parent
GAUGES = re.compile(r"^(rtts_active_\w+(?:\{[^}]*\})?) (\S+)$", re.M)


async def _ttfa_s(port: int, cid: str) -> float:
    async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None,
                       local_addr=("127.0.0.2", 0), open_timeout=30) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "start", "context_id": cid}))
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "text", "context_id": cid, "text": "Hello there."}))
        await ws.send(json.dumps({"type": "end", "context_id": cid}))
        async with asyncio.timeout(30):
            while isinstance(await ws.recv(), str):
                pass
        return time.perf_counter() - t0


def _gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in GAUGES.findall(text)
            if not k.startswith("rtts_active_http_requests")}  # (this request is one)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _settle(port: int, timeout: float = 60.0) -> dict[str, float]:
    """Wait until every active gauge is 0; the gauges (nonzero ones fail the caller)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = _gauges(port)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def _attack(port: int, wport: int, clients: int, seconds: float, bomb: Path
            ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HERE / "abuse_clients.py"), str(port),
                             str(wport), str(clients), str(seconds), str(bomb)],
                            stdout=subprocess.PIPE, text=True)


async def _measure_while(proc: subprocess.Popen[str], port: int) -> list[float]:
    samples = []
    n = 0
    while proc.poll() is None:
        samples.append(await _ttfa_s(port, f"m{n}"))
        n += 1
        await asyncio.sleep(0.2)
    return samples


def run_mixed_abuse(tmp_path: Path, clients: int, seconds: float, nofile: int | None,
                    warm_rounds: int = 2, known_short: bool = False) -> dict[str, Any]:
    """The run and its checks; with ``known_short``, missing the latency or RSS target is
    an xfail (with the figures), not a failure, once no connection, context or traceback
    was left behind."""
    pytest.importorskip("pybase16384")
    from test_security3 import _speaker_bomb

    bomb = tmp_path / "bomb.txt"
    bomb.write_text(_speaker_bomb())
    port, wport = free_port(), free_port()
    log = tmp_path / "rtts.log"
    args = ["--engine", "fake", "--wyoming-port", str(wport), "--voices-dir",
            str(tmp_path / "voices"), "--idle-timeout", "5", "--http-read-timeout", "3"]
    with ExitStack() as stack:
        if shutil.which("redis-server"):
            redis = stack.enter_context(start_redis(tmp_path))
            args += ["--jobs-redis", redis, "--jobs-dir", str(tmp_path / "jobs")]
        proc = stack.enter_context(start_rtts(args, port, log, nofile=nofile))
        # warm-up: a round of the same mix, then settle; RSS from here on
        asyncio.run(_ttfa_s(port, "warm"))
        # (RSS is a high-water mark of the big texts' memory, not a leak: with the
        # connection-level kinds alone it stays flat, with the 20,000-character texts alone
        # it reaches its plateau in the first round; the mix gets there in two)
        # RSS is read after each round once the server's idle heap trim has run (at most
        # every TRIM_EVERY_S: a mid-round idle moment may have put it off by up to that).
        # Even then it swings from one round to the next (84-104 MB on one EPYC; 87-108
        # before Stats.ttfa_s / frame_latency_s were arrays): what a round leaves alive pins
        # blocks of Python's allocator until a later round frees them, and a 20 s round
        # ends anywhere in 82-97 MB there. So the long round's figure is its floor (the
        # lower of it and one more 20 s round's: a leak in the long round raises both),
        # compared with the top of the warm-up rounds' (without a trend: 5 to 8 rounds in a
        # row stayed in one band).
        trimmed = TRIM_EVERY_S + 1.0 if warm_rounds >= 2 else 1.0

        def short_round() -> float:
            """A warm-up-length round of the mix; RSS once settled and trimmed."""
            warm = _attack(port, wport, clients, min(seconds, 20.0), bomb)
            warm.communicate(timeout=120)
            assert not any(_settle(port).values())
            time.sleep(trimmed)
            return _rss_mb(proc.pid)

        warm_rss = [short_round() for _ in range(warm_rounds)]
        rss_before = max(warm_rss, default=0.0)
        idle = [asyncio.run(_ttfa_s(port, f"i{i}")) for i in range(8)]

        attack = _attack(port, wport, clients, seconds, bomb)
        under = asyncio.run(_measure_while(attack, port))
        out, _ = attack.communicate(timeout=120)
        report = json.loads(out.strip().splitlines()[-1])

        gauges = _settle(port)
        time.sleep(trimmed)
        after_rss = [_rss_mb(proc.pid)]
        if warm_rounds >= 2:  # one more round, as long as a warm-up round
            after_rss.append(short_round())
        rss_after = min(after_rss)
        text = log.read_text(errors="replace")
    result = {"idle_ms": statistics.median(idle) * 1000,
              "under_ms": statistics.median(under) * 1000,
              "under_p90_ms": sorted(under)[int(0.9 * (len(under) - 1))] * 1000,
              "samples": len(under), "rss_before_mb": rss_before, "rss_after_mb": rss_after,
              "rss_warm_rounds_mb": warm_rss, "rss_after_rounds_mb": after_rss,
              "gauges": gauges, "tracebacks": text.count("Traceback"),
              "errors_logged": sum(1 for line in text.splitlines() if " ERROR " in line),
              "attack": report}
    print(json.dumps(result))
    assert sum(report["ops"].values()) > clients, result  # the abuse really ran
    assert not any(gauges.values()), result  # every connection and context released
    assert result["tracebacks"] == 0, result
    short = []
    if not (result["samples"] >= seconds  # the good client was served throughout ...
            and result["under_ms"] <= 2 * result["idle_ms"] + 50):  # ... and fast
        short.append("time to first audio past 2x of idle")
    if warm_rounds >= 2 and rss_after > 1.05 * rss_before:  # (once RSS is at its plateau)
        short.append("RSS more than 5% above the warmed-up figure")
    if short and known_short:
        pytest.xfail(f"{', '.join(short)} under {clients} abusive clients: {result}")
    assert not short, (short, result)
    return result


@pytest.mark.long
def test_mixed_abuse_short_under_a_1024_file_limit(tmp_path: Path) -> None:
    """The cheap variant: no RSS comparison (it needs two warm-up rounds to be fair), the
    rest as the long run."""
    run_mixed_abuse(tmp_path, clients=40, seconds=8, nofile=1024, warm_rounds=1)


@pytest.mark.abuse
@pytest.mark.parametrize("nofile", [None, 1024], ids=["no-limit", "nofile-1024"])
def test_mixed_abuse_sixty_seconds_two_hundred_clients(tmp_path: Path,
                                                       nofile: int | None) -> None:
    # (Issue 31: it was an xfail, 84-223 ms under attack vs 17 ms idle and RSS +0.5-8%,
    # until the job bombs were refused as they arrive instead of parsed, the segmenter
    # stopped testing every character of the 20,000-character texts in Python, and the
    # heap is trimmed when the server goes idle; docs/operations/security-round3.md.)
    run_mixed_abuse(tmp_path, clients=200, seconds=60, nofile=nofile)
