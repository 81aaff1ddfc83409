"""Owned tasks: the one create / track / cancel policy of every socket front-end.

A connection (native, ElevenLabs, Wyoming) starts tasks for its writer, timers and contexts.
Each one is kept in :class:`OwnedTasks` until it ends, so nothing is left running when the
connection goes: :meth:`OwnedTasks.cancel_all` cancels them and waits (bounded) for them to
finish. Cancelled tasks keep a traceback that holds their frames; clearing the set lets a
closed connection be freed by reference counting rather than a full garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["OwnedTasks"]

logger = logging.getLogger("rtts.api.tasks")


class OwnedTasks:
    """The tasks one owner started and has not yet seen end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    async def cancel_all(self, grace_s: float | None = None) -> None:
        """Cancel every task and wait for them (at most ``grace_s`` seconds; a task that
        ignores its cancellation that long is logged and left)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                logger.warning("task %s did not stop within %ss", task.get_name(), grace_s)
        self._tasks.clear()
