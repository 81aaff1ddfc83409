"""A short soak: thousands of sessions through one server; memory stays flat, nothing leaks.

CI runs 2,500 sessions (about 15 s). RSS is compared after a warm-up of 1,000 sessions, when
allocator pools and caches have grown to their working size.
"""

import asyncio
import gc
import json
import os

import psutil
from websockets.asyncio.client import connect

from helpers import server
from rtts.engines.fake import FakeEngine

SESSIONS = int(os.environ.get("RTTS_SOAK_SESSIONS", "2500"))
WARMUP = 1000


async def one(url: str, i: int) -> None:
    async with connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "start", "voice": f"seed:{i % 7}"}))
        await ws.send(json.dumps({"type": "text", "text": f"Session {i}, short and sweet."}))
        if i % 5 == 0:
            await ws.send(json.dumps({"type": "cancel"}))
        else:
            await ws.send(json.dumps({"type": "end"}))
        async for msg in ws:
            if isinstance(msg, str) and json.loads(msg)["type"] in ("done", "cancelled"):
                break


async def test_rss_flat_across_thousands_of_sessions():
    proc = psutil.Process()
    async with server(engine=FakeEngine(ms_per_char=2)) as (app, url):
        sem = asyncio.Semaphore(20)

        async def bounded(i: int) -> None:
            async with sem:
                await one(url, i)

        await asyncio.gather(*(bounded(i) for i in range(WARMUP)))
        gc.collect()
        base = proc.memory_info().rss
        await asyncio.gather(*(bounded(i) for i in range(WARMUP, SESSIONS)))
        gc.collect()
        grown = proc.memory_info().rss / base - 1
        for _ in range(100):
            if not app.connections:
                break
            await asyncio.sleep(0.05)
        assert not app.connections
        assert app.scheduler.queue_depth == 0 and app.scheduler.running_batches == 0
        assert app.stats.connections_total == SESSIONS
        print(f"soak: {SESSIONS} sessions, RSS growth after warm-up {grown * 100:.2f}%")
        assert grown < 0.05, f"RSS grew {grown * 100:.1f}% over {SESSIONS - WARMUP} sessions"
