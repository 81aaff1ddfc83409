"""Where torch work runs (rtts.engines.threads): one-off work and each continuous batch in
a thread that ends with it, so no idle thread keeps an OpenMP team (which would slow every
later decode step; measured in the module's docstring)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rtts.core.params import SynthParams
from rtts.core.scheduler import Scheduler, SchedulerConfig
from rtts.engines.base import SynthRequest
from rtts.engines.fake import FakeEngine
from rtts.engines.threads import run_in_own_thread


def _alive(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


async def _gone(prefix: str) -> bool:
    for _ in range(100):
        if not _alive(prefix):
            return True
        await asyncio.sleep(0.01)
    return False


async def test_run_in_own_thread_returns_raises_and_leaves_no_thread() -> None:
    seen: list[str] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread().name)
        return 2 * x

    assert await run_in_own_thread(work, 21, name="rtts-t1") == 42
    assert seen[0].startswith("rtts-t1") and seen[0] != threading.current_thread().name
    assert await _gone("rtts-t1")

    def fail() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await run_in_own_thread(fail, name="rtts-t2")
    assert await _gone("rtts-t2")


async def test_a_continuous_batch_runs_in_a_thread_that_ends_with_it() -> None:
    engine = FakeEngine(ms_per_char=1, continuous=True)
    sched = Scheduler(engine, SchedulerConfig(max_batch_size=4))
    await sched.start()
    try:
        streams = [sched.submit(SynthRequest(f"hello {i}", SynthParams())) for i in range(3)]
        for s in streams:
            async for _ in s:
                pass
        assert await _gone(f"rtts-{engine.name}"), "the batch's thread outlived it"
        # and a later batch gets a thread of its own again
        async for _ in sched.submit(SynthRequest("again", SynthParams())):
            pass
        assert sched.completed == 4
    finally:
        await sched.stop()
