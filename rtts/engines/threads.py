"""Where an engine's torch work runs: in threads that end with their work.

torch's CPU kernels run their parallel regions on OpenMP (GNU libgomp in the PyPI
wheels). libgomp gives every thread that opens a parallel region a team of its own, whose
helper threads live as long as that thread. Once the helpers of all teams outnumber the
cores, libgomp stops letting idle helpers spin (its "throttled" spin count, 100 spins):
they go to sleep at once, and every parallel region afterwards pays a wake-up. A decode
step opens hundreds of small regions, so the whole step slows down for the life of the
process. Measured on the 2-core Sapphire Rapids Xeon, int4 linear layers of the full-size
GPT, one pass on the device thread: 7.1 ms at 1 row and 11.7 ms at 4 rows; after one
matmul on any other thread that stays alive, 11.4 and 15.9 ms, for good; when that other
thread has ended, 7.1 and 11.8 ms again (its team goes with it).

``asyncio.to_thread`` runs on the loop's default executor, whose threads stay alive. So
one-off torch work (loading a model, warming it up, encoding a voice sample) runs through
:func:`run_in_own_thread`: a thread started for the call that ends with it. Each
continuous batch runs in a thread started for it (:func:`start_in_own_thread`), so a
serving process keeps one team per running batch (one at the default ``--concurrency``)
and an idle one keeps none, and benchmarks that serve several settings one after another
never have two. Static batches (``--batching static``, engines without continuous
batching) still run on the scheduler's long-lived executor threads: alone in a process
that is one team, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["run_in_own_thread", "start_in_own_thread"]

T = TypeVar("T")


def start_in_own_thread(fn: Callable[..., T], *args: object, name: str = "rtts-once"
                        ) -> asyncio.Future[T]:
    """Start ``fn(*args)`` in a thread of its own that ends once ``fn`` returns (see the
    module docstring); its result as a future of the running loop."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    future = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    pool.shutdown(wait=False)  # the call submitted still runs; then the worker ends
    return future


async def run_in_own_thread(fn: Callable[..., T], *args: object, name: str = "rtts-once") -> T:
    """``fn(*args)`` in a thread that ends with it; the event loop is not blocked."""
    return await start_in_own_thread(fn, *args, name=name)
