"""Usage per API key: characters in, audio seconds out, contexts (pure counters).

Every live :class:`~rtts.core.context.SpeechContext` counts here, whatever protocol opened
it, under its **account**: the owner id of the API key it came with
(:meth:`rtts.api.auth.Authenticator.owner`; a browser token counts as the key it was
issued for), or ``"anonymous"`` when no keys are configured. Accounts are therefore
bounded by the configured keys; as a backstop, past :data:`MAX_ACCOUNTS` distinct ones the
rest count under ``"other"``.

* **characters**: the characters of the input, as written (before normalization), up to
  the end of the last segment queued for synthesis: what the client sent, the whitespace
  between segments included, whitespace after the last one not;
* **audio_seconds**: the audio handed to the front-end (every chunk, so a cancelled
  stream counts what it got);
* **contexts**: contexts opened (an HTTP request is one; a socket may open many).

Long-text job segments (background contexts) are not counted here.

The totals are this process's (``/metrics``). :meth:`Usage.take_pending` hands the
deltas since the last call to a flusher that adds them to a shared store (Redis
``HINCRBY``, batched every few seconds, off the hot path: :class:`UsageFlusher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["ANONYMOUS", "MAX_ACCOUNTS", "KeyUsage", "Usage", "UsageFlusher"]

logger = logging.getLogger("rtts.usage")

ANONYMOUS = "anonymous"
OTHER = "other"
MAX_ACCOUNTS = 4096
REDIS_PREFIX = "rtts:usage:"


@dataclass(slots=True)
class KeyUsage:
    characters: int = 0
    audio_seconds: float = 0.0
    contexts: int = 0

    def add(self, other: KeyUsage) -> None:
        self.characters += other.characters
        self.audio_seconds += other.audio_seconds
        self.contexts += other.contexts

    def as_dict(self) -> dict[str, Any]:
        return {"characters": self.characters,
                "audio_seconds": round(self.audio_seconds, 3),
                "contexts": self.contexts}


class Usage:
    """This process's usage per account, and the deltas not yet flushed to a shared store."""

    def __init__(self) -> None:
        self.totals: dict[str, KeyUsage] = {}
        self._pending: dict[str, KeyUsage] = {}

    def _slots(self, account: str | None) -> tuple[KeyUsage, KeyUsage]:
        name = account or ANONYMOUS
        total = self.totals.get(name)
        if total is None:
            if len(self.totals) >= MAX_ACCOUNTS:
                name = OTHER
                total = self.totals.setdefault(OTHER, KeyUsage())
            else:
                total = self.totals[name] = KeyUsage()
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = KeyUsage()
        return total, pending

    def context(self, account: str | None) -> None:
        for slot in self._slots(account):
            slot.contexts += 1

    def characters(self, account: str | None, n: int) -> None:
        for slot in self._slots(account):
            slot.characters += n

    def audio(self, account: str | None, seconds: float) -> None:
        for slot in self._slots(account):
            slot.audio_seconds += seconds

    def of(self, account: str | None) -> KeyUsage:
        """This process's totals for ``account`` (zeros if it has none)."""
        return self.totals.get(account or ANONYMOUS) or KeyUsage()

    def take_pending(self) -> dict[str, KeyUsage]:
        """The deltas since the last call (and forget them)."""
        pending, self._pending = self._pending, {}
        return pending

    def restore(self, pending: dict[str, KeyUsage]) -> None:
        """Put back deltas a flush could not write (added to those counted meanwhile)."""
        for name, delta in pending.items():
            self._pending.setdefault(name, KeyUsage()).add(delta)

    def unflushed(self, account: str | None) -> KeyUsage:
        return self._pending.get(account or ANONYMOUS) or KeyUsage()


def decode_hash(raw: dict[Any, Any]) -> KeyUsage:
    """A Redis usage hash (bytes fields and values) as :class:`KeyUsage`."""
    def get(name: str) -> bytes:
        value = raw.get(name.encode(), raw.get(name, b"0"))
        return value if isinstance(value, bytes) else str(value).encode()
    try:
        return KeyUsage(int(get("characters")), float(get("audio_seconds")),
                        int(get("contexts")))
    except ValueError:
        return KeyUsage()


class UsageFlusher:
    """Adds this process's usage deltas to Redis every ``interval_s`` (one pipeline of
    ``HINCRBY`` / ``HINCRBYFLOAT`` per flush), so ``GET /v1/usage`` reads every
    instance's sum. A failed flush keeps its deltas for the next one."""

    def __init__(self, usage: Usage, redis_url: str, interval_s: float = 5.0) -> None:
        self.usage = usage
        self.redis_url = redis_url
        self.interval_s = interval_s
        self._redis: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import redis.asyncio as aioredis  # optional dependency: pip install 'rtts[redis]'

        self._redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=2.0,
                                              socket_connect_timeout=1.0)
        self._task = asyncio.create_task(self._run(), name="rtts-usage-flush")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        pending = self.usage.take_pending()
        if not pending:
            return
        if self._redis is None:
            self.usage.restore(pending)
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, d in pending.items():
                    key = REDIS_PREFIX + name
                    if d.characters:
                        pipe.hincrby(key, "characters", d.characters)
                    if d.contexts:
                        pipe.hincrby(key, "contexts", d.contexts)
                    if d.audio_seconds:
                        pipe.hincrbyfloat(key, "audio_seconds", d.audio_seconds)
                await pipe.execute()
        except Exception as exc:  # Redis down: keep the deltas, try again next time
            self.usage.restore(pending)
            logger.warning("usage flush to Redis failed (%s: %s); kept for the next one",
                           type(exc).__name__, exc)

    async def shared(self, account: str | None) -> KeyUsage | None:
        """Every instance's flushed usage of ``account`` plus this one's unflushed part;
        None when Redis cannot be read."""
        if self._redis is None:
            return None
        try:
            raw = await self._redis.hgetall(REDIS_PREFIX + (account or ANONYMOUS))
        except Exception as exc:
            logger.warning("usage read from Redis failed (%s: %s)", type(exc).__name__, exc)
            return None
        total = decode_hash(raw)
        total.add(self.usage.unflushed(account))
        return total

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._redis is not None:
            await self.flush()
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            self._redis = None
