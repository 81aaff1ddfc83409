"""Regression tests for the third abuse probe's findings (issue 31), over real sockets.

Each test follows the probe's steps against a real ``rtts serve`` process (or an in-process
server where the server's own state is inspected), with the fake engine (the documented test
double) standing in for the model. Timing assertions compare a well-behaved client under
attack with the same client idle, in the same test, with loose factors: they catch an event
loop frozen for seconds, not a slower machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from wyoming.client import AsyncTcpClient
from wyoming.event import Event

sys.path.insert(0, str(Path(__file__).parent))
from procs import free_port, start_rtts  # noqa: E402

HOSTILE_TEXT = "3-5 " * 5000  # 20,000 characters: the probe's message


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET",
         data: bytes | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def _healthz_s(port: int) -> float:
    """Seconds for one ``GET /healthz`` (from a thread: this loop is the client's)."""
    t0 = time.perf_counter()
    status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
    assert status == 200
    return time.perf_counter() - t0


async def _ttfa_s(port: int, cid: str) -> float:
    """A well-behaved native client: connect, one short sentence, seconds to first audio."""
    async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "start", "context_id": cid}))
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "text", "context_id": cid, "text": "Hello there."}))
        await ws.send(json.dumps({"type": "end", "context_id": cid}))
        async with asyncio.timeout(60):
            while isinstance(await ws.recv(), str):
                pass
        return time.perf_counter() - t0


async def _drain(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        async for _ in ws:
            pass


async def _hostile_native(port: int, stop: asyncio.Event) -> int:
    """The probe's native client: 20,000-character messages of ``3-5 `` as fast as the
    socket takes them (a new context whenever one reaches its 100,000 characters)."""
    sent = 0
    async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
        reader = asyncio.create_task(_drain(ws))
        try:
            n = 0
            while not stop.is_set():
                cid = f"h{n}"
                n += 1
                await ws.send(json.dumps({"type": "start", "context_id": cid}))
                for _ in range(5):
                    await ws.send(json.dumps({"type": "text", "context_id": cid,
                                              "text": HOSTILE_TEXT}))
                    sent += 1
                    await asyncio.sleep(0.05)
                await ws.send(json.dumps({"type": "cancel", "context_id": cid}))
        finally:
            reader.cancel()
    return sent


async def _hostile_wyoming(port: int, stop: asyncio.Event) -> int:
    """The same text over Wyoming (no key at all): a streaming synthesis fed 20,000
    characters a chunk, then a new one."""
    sent = 0
    async with AsyncTcpClient("127.0.0.1", port) as client:
        async def drain() -> None:
            with contextlib.suppress(Exception):
                while await client.read_event() is not None:
                    pass
        reader = asyncio.create_task(drain())
        try:
            while not stop.is_set():
                await client.write_event(Event("synthesize-start", {}))
                for _ in range(5):
                    await client.write_event(Event("synthesize-chunk", {"text": HOSTILE_TEXT}))
                    sent += 1
                    await asyncio.sleep(0.05)
                await client.write_event(Event("synthesize-stop", {}))
                await asyncio.sleep(0.3)
        finally:
            reader.cancel()
    return sent


@contextlib.contextmanager
def _serve(tmp_path: Path, *args: str) -> Any:
    port, wport = free_port(), free_port()
    with start_rtts(["--engine", "fake", "--wyoming-port", str(wport), *args], port,
                    tmp_path / "rtts.log"):
        yield port, wport


# -- High 1: normalization freezes the event loop --------------------------------------------

async def test_hostile_normalization_does_not_delay_other_clients(tmp_path: Path):
    """The probe: one native socket (and one Wyoming connection) sending 20,000-character
    messages of ``3-5 `` blocked ``/healthz`` for 13.6 s and took another client's time to
    first audio from 20 ms to 14.8 s. Now both stay within a loose factor of idle."""
    with _serve(tmp_path) as (port, wport):
        await _ttfa_s(port, "warm")
        idle_ttfa = statistics.median([await _ttfa_s(port, f"i{i}") for i in range(3)])
        idle_health = statistics.median([await _healthz_s(port) for _ in range(3)])

        stop = asyncio.Event()
        hostile = [asyncio.create_task(_hostile_native(port, stop)),
                   asyncio.create_task(_hostile_wyoming(wport, stop))]
        try:
            await asyncio.sleep(1.0)  # let the attack get going
            ttfa, health = [], []
            deadline = time.monotonic() + 4.0
            i = 0
            while time.monotonic() < deadline:
                ttfa.append(await _ttfa_s(port, f"w{i}"))
                health.append(await _healthz_s(port))
                i += 1
        finally:
            stop.set()
            sent = await asyncio.gather(*hostile)
        assert min(sent) >= 5, sent  # the attack did run, on both protocols
        # generous: 10x idle, and never under a second (a shared CI machine)
        assert max(ttfa) < max(10 * idle_ttfa, 1.0), (idle_ttfa, ttfa)
        assert max(health) < max(10 * idle_health, 1.0), (idle_health, health)


def test_normalizer_cost_is_linear_in_its_input():
    """Per-character cost of 8x the text stays near that of 1x (it grew ~8x per character:
    every number scanned back over the whole chunk for the nearest letter)."""
    from rtts.text.normalize import normalize

    for unit in ("3-5 ", "2024-01-05 ", "，" * 7 + "x"):
        def cost(n: int, unit: str = unit) -> float:
            text = (unit * (n // len(unit) + 1))[:n]
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                normalize(text)
                best = min(best, time.perf_counter() - t0)
            return best / n
        small, big = cost(1000), cost(8000)
        assert big < 3 * small, (unit, small, big)
