"""Drain tells the truth: while a SIGTERM'd server finishes its streams it keeps answering
HTTP (``/healthz`` 200, ``/readyz`` 503 with the reason, new WebSocket upgrades 503 with
``Retry-After``), so a load balancer sees a draining instance, not a dead one."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from helpers import base_config, client, server
from procs import free_port, wait_http
from rtts.engines.fake import FakeEngine
from rtts.errors import CLOSE_GOING_AWAY
from rtts.server import bound_port


def get(port: int, path: str) -> tuple[int, str, dict[str, str]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


async def test_drain_keeps_answering_http_refuses_new_streams_finishes_old_ones():
    engine = FakeEngine(ms_per_char=20, rtf=0.5)
    cfg = replace(base_config(), shutdown_grace_s=10.0)
    async with server(cfg, engine) as (app, url), client(url) as c:
        port = bound_port(app)
        assert (await asyncio.to_thread(get, port, "/readyz"))[0] == 200
        await c.send(type="start", context_id="a")
        await c.send(type="text", context_id="a", text="Finish this sentence, please. " * 2)
        await c.send(type="end", context_id="a")
        await c.until("segment_started", "a")
        shutdown = asyncio.create_task(app.drain_and_close())
        await asyncio.sleep(0.05)
        assert app.state == "draining" and not shutdown.done()

        status, body, _ = await asyncio.to_thread(get, port, "/readyz")
        assert status == 503 and "draining" in body
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
        metrics = (await asyncio.to_thread(get, port, "/metrics"))[1]
        assert 'rtts_up{state="draining"} 1' in metrics
        with pytest.raises(InvalidStatus) as info:
            async with connect(url):
                pass
        assert info.value.response.status_code == 503
        assert info.value.response.headers["Retry-After"]
        assert b"draining" in info.value.response.body

        done = await c.until("done", "a", timeout=20)  # the in-flight stream completes
        assert done["segments"] == len(c.got.of("segment_done", "a")) >= 1
        with pytest.raises(ConnectionClosed) as closed:
            await c.until("never")
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CLOSE_GOING_AWAY
        await shutdown
        app.state = "stopped"
        with pytest.raises(OSError):  # after the drain the listener is gone
            await asyncio.open_connection("127.0.0.1", port)


def test_sigterm_on_a_real_process_drains_with_readyz_503(tmp_path):
    """``rtts serve`` itself: SIGTERM during a stream, probes during the drain, exit 0."""
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rtts", "serve", "--engine", "fake", "--fake-rtf", "1.0",
         "--port", str(port), "--shutdown-grace", "15"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)

        async def scenario() -> list[tuple[float, int, int]]:
            async with client(f"ws://127.0.0.1:{port}/v1/stream") as c:
                await c.send(type="start", context_id="a")
                await c.send(type="text", context_id="a", text="A sentence that takes a "
                             "while to say, spoken in real time by the fake engine.")
                await c.send(type="end", context_id="a")
                await c.until("segment_started", "a")
                proc.send_signal(signal.SIGTERM)
                probes = []
                t0 = time.monotonic()
                while not c.got.of("done", "a"):
                    ready = (await asyncio.to_thread(get, port, "/readyz"))[0]
                    health = (await asyncio.to_thread(get, port, "/healthz"))[0]
                    probes.append((time.monotonic() - t0, ready, health))
                    try:
                        await c.until("done", "a", timeout=0.3)
                    except TimeoutError:
                        pass
                return probes

        probes = asyncio.run(scenario())
        assert probes, "the stream ended before any probe"
        assert all(r == 503 and h == 200 for _, r, h in probes[1:]), probes
        assert probes[-1][1:] == (503, 200)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert "draining" in (tmp_path / "serve.log").read_text()
