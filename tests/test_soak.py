"""A short soak: thousands of sessions through one server; memory stays flat, nothing leaks.

CI runs 2,500 sessions (about 15 s). RSS is compared after a warm-up of 1,000 sessions, when
allocator pools and caches have grown to their working size.
"""

import asyncio
import gc
import os

import psutil
import pytest

from helpers import base_config, server
from rtts.bench.main import soak_session
from rtts.core.cache import CacheConfig
from rtts.engines.fake import FakeEngine

SESSIONS = int(os.environ.get("RTTS_SOAK_SESSIONS", "2500"))
WARMUP = 1000


@pytest.mark.long
async def test_rss_flat_across_thousands_of_sessions():
    proc = psutil.Process()
    # A small phrase cache: it fills up during the warm-up and then stays at its bound.
    cfg = base_config(cache=CacheConfig(memory_mb=0.5))
    async with server(cfg, FakeEngine(ms_per_char=2)) as (app, url):
        sem = asyncio.Semaphore(20)

        async def bounded(i: int) -> None:
            async with sem:
                await soak_session(url, i)

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
        assert app.cache.memory.bytes <= 0.5 * 2**20 and app.cache.stats.hits_memory > 0
        print(f"soak: {SESSIONS} sessions, RSS growth after warm-up {grown * 100:.2f}%")
        assert grown < 0.05, f"RSS grew {grown * 100:.1f}% over {SESSIONS - WARMUP} sessions"
