"""Job records and the queue on Redis; segment audio in files under a shared directory.

Why Redis Streams with a consumer group (``redis.asyncio``, already the phrase cache's
client) and not a job library: a job here is thousands of small idempotent segments, and
what a dead worker must hand over is *its current segments*, not a whole job. A stream
entry per segment, read with ``XREADGROUP`` by every worker in one group, gives exactly
that: each entry goes to one worker; a worker acknowledges (``XACK``, then ``XDEL``) only
after the segment's audio is stored; an entry left unacknowledged for ``claim_idle_s``
(its worker was SIGKILLed, or lost its node) is taken over by another worker with
``XAUTOCLAIM``. A living worker keeps its entries by re-claiming them (``XCLAIM`` ...
``JUSTID``) every third of that time, which resets their idle time.

Keys (``P`` = ``JobsConfig.prefix``)::

    P:queue              stream of {job, seg}; group "workers"
    P:job:ID             hash: owner state format sample_rate params chars total done samples
                         chapters created started finished error
    P:job:ID:segs        list of segment texts (as written; normalized by the worker)
    P:job:ID:bits        bitmap: segment stored
    P:job:ID:seglen      hash: segment -> samples (at the job's output rate)
    P:job:ID:log         list of "seg consumer" per store (a re-run segment appears twice)

A segment is stored idempotently: its file is written under a temporary name and renamed
over ``DIR/ID/NNNNNNN.EXT`` (a re-run replaces it with the same audio), then one Lua script
sets its bit and, the first time only, adds its samples and counts it done (and marks the
job done with the last one). So a segment is counted once however often it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rtts.jobs.model import Chapter, JobsConfig, JobState

__all__ = ["JobRecord", "JobStore", "QueueEntry", "segment_ext"]

logger = logging.getLogger("rtts.jobs.store")

_COMPLETE = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == false or state == 'cancelled' or state == 'failed' then return -1 end
local old = redis.call('SETBIT', KEYS[2], ARGV[1], 1)
redis.call('RPUSH', KEYS[4], ARGV[1] .. ' ' .. ARGV[3])
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
if old == 1 then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'samples', ARGV[2])
local done = redis.call('HINCRBY', KEYS[1], 'done', 1)
if done >= tonumber(redis.call('HGET', KEYS[1], 'total')) then
  redis.call('HSET', KEYS[1], 'state', 'done', 'finished', ARGV[4])
end
return 1
"""

_START = """
if redis.call('HGET', KEYS[1], 'state') == 'queued' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'started', ARGV[1])
end
return 1
"""


def segment_ext(fmt: str) -> str:
    """File extension of a stored segment: WAV jobs store PCM16 (one header at download)."""
    return "pcm" if fmt in ("wav", "pcm16") else fmt


@dataclass(frozen=True, slots=True)
class QueueEntry:
    id: str
    job: str
    seg: int


@dataclass(frozen=True)
class JobRecord:
    id: str
    owner: str
    state: str  # a JobState, or "uploading"
    format: str
    sample_rate: int
    params: dict[str, Any]
    chars: int
    total: int
    done: int
    samples: int
    chapters: list[Chapter]
    created: float
    started: float | None
    finished: float | None
    error: str

    @property
    def final(self) -> bool:
        return self.state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


def _s(value: bytes | None) -> str:
    return value.decode() if value is not None else ""


def _f(value: bytes | None) -> float | None:
    return float(value) if value else None


class JobStore:
    """The Redis side and the directory side of jobs, for the API and the workers."""

    def __init__(self, config: JobsConfig) -> None:
        import redis.asyncio as aioredis

        if config.redis_url is None:
            raise ValueError("jobs need a Redis URL")
        self.config = config
        self.dir = Path(config.dir)
        self.redis: Any = aioredis.Redis.from_url(config.redis_url)
        self.queue = f"{config.prefix}:queue"
        self.group = "workers"
        self._complete = self.redis.register_script(_COMPLETE)
        self._start = self.redis.register_script(_START)

    async def aclose(self) -> None:
        await self.redis.aclose()

    def key(self, job: str, part: str = "") -> str:
        return f"{self.config.prefix}:job:{job}" + (f":{part}" if part else "")

    def segment_path(self, job: str, seg: int, fmt: str) -> Path:
        return self.dir / job / f"{seg:07d}.{segment_ext(fmt)}"

    # -- submitting (API) --------------------------------------------------------------

    async def begin(self, job: str, owner: str, fmt: str, sample_rate: int,
                    params: dict[str, Any]) -> None:
        """A new job record in state ``uploading`` (segments follow, then :meth:`commit`)."""
        key = self.key(job)
        await self.redis.hset(key, mapping={
            "owner": owner, "state": "uploading", "format": fmt, "sample_rate": sample_rate,
            "params": orjson.dumps(params), "chars": 0, "total": 0, "done": 0, "samples": 0,
            "created": time.time(), "chapters": b"[]", "error": ""})
        await self.redis.expire(key, self.config.ttl_s)

    async def add_segments(self, job: str, texts: Sequence[str]) -> None:
        if texts:
            await self.redis.rpush(self.key(job, "segs"), *texts)

    async def commit(self, job: str, total: int, chars: int, chapters: list[Chapter]) -> None:
        """The upload is complete: queue one stream entry per segment."""
        ttl = self.config.ttl_s
        table = [[c.start, c.title, c.first_segment] for c in chapters]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(job), mapping={"state": JobState.QUEUED, "total": total,
                                              "chars": chars, "chapters": orjson.dumps(table)})
            pipe.expire(self.key(job, "segs"), ttl)
            await pipe.execute()
        for first in range(0, total, 1000):
            async with self.redis.pipeline(transaction=False) as pipe:
                for seg in range(first, min(total, first + 1000)):
                    pipe.xadd(self.queue, {"job": job, "seg": seg})
                await pipe.execute()

    async def discard(self, job: str) -> None:
        """Forget a job whose upload failed."""
        await self.redis.delete(*(self.key(job, p) for p in ("", "segs", "bits", "seglen",
                                                             "log", "attempts")))

    # -- reading -----------------------------------------------------------------------

    async def get(self, job: str) -> JobRecord | None:
        raw = await self.redis.hgetall(self.key(job))
        if not raw or b"state" not in raw:
            return None
        chapters = [Chapter(i, int(start), str(title), int(first))
                    for i, (start, title, first) in enumerate(orjson.loads(raw[b"chapters"]))]
        return JobRecord(
            id=job, owner=_s(raw.get(b"owner")), state=_s(raw.get(b"state")),
            format=_s(raw.get(b"format")), sample_rate=int(raw.get(b"sample_rate", 0)),
            params=orjson.loads(raw.get(b"params", b"{}")), chars=int(raw.get(b"chars", 0)),
            total=int(raw.get(b"total", 0)), done=int(raw.get(b"done", 0)),
            samples=int(raw.get(b"samples", 0)), chapters=chapters,
            created=float(raw.get(b"created", 0)), started=_f(raw.get(b"started")),
            finished=_f(raw.get(b"finished")), error=_s(raw.get(b"error")))

    async def state(self, job: str) -> str:
        return _s(await self.redis.hget(self.key(job), "state"))

    async def segment_text(self, job: str, seg: int) -> str | None:
        raw = await self.redis.lindex(self.key(job, "segs"), seg)
        return None if raw is None else str(raw.decode())

    async def is_stored(self, job: str, seg: int) -> bool:
        return bool(await self.redis.getbit(self.key(job, "bits"), seg))

    async def samples_of(self, job: str, segs: range) -> int:
        """Samples of the stored segments among ``segs``."""
        total = 0
        for first in range(segs.start, segs.stop, 1000):
            values = await self.redis.hmget(self.key(job, "seglen"),
                                            list(range(first, min(segs.stop, first + 1000))))
            total += sum(int(v) for v in values if v is not None)
        return total

    async def log(self, job: str) -> list[tuple[int, str]]:
        """Every store of a segment, in order: (segment, consumer)."""
        rows = await self.redis.lrange(self.key(job, "log"), 0, -1)
        out = []
        for row in rows:
            seg, consumer = row.decode().split(" ", 1)
            out.append((int(seg), consumer))
        return out

    # -- changing state ----------------------------------------------------------------

    async def cancel(self, job: str) -> bool:
        """Cancel a job that has not finished; delete its stored audio. False if final."""
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(self.key(job))
            state = _s(await pipe.hget(self.key(job), "state"))
            if state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED, ""):
                await pipe.unwatch()
                return False
            pipe.multi()
            pipe.hset(self.key(job), mapping={"state": JobState.CANCELLED,
                                              "finished": time.time()})
            pipe.delete(self.key(job, "segs"))
            await pipe.execute()
        await asyncio.to_thread(shutil.rmtree, self.dir / job, True)
        return True

    async def delete(self, job: str) -> None:
        """Forget a finished job and delete its audio."""
        await asyncio.to_thread(shutil.rmtree, self.dir / job, True)
        await self.redis.delete(*(self.key(job, p) for p in ("", "segs", "bits", "seglen",
                                                             "log", "attempts")))

    async def fail(self, job: str, error: str) -> None:
        await self.redis.hset(self.key(job), mapping={"state": JobState.FAILED,
                                                      "error": error, "finished": time.time()})

    async def mark_started(self, job: str) -> None:
        await self._start(keys=[self.key(job)], args=[time.time()])

    async def attempt(self, job: str, seg: int) -> int:
        """Count one failed attempt at a segment; returns the count."""
        key = self.key(job, "attempts")
        n = int(await self.redis.hincrby(key, seg, 1))
        await self.redis.expire(key, self.config.ttl_s)
        return n

    async def store_segment(self, job: str, seg: int, fmt: str, data: bytes, samples: int,
                            consumer: str) -> int:
        """Write a segment's audio (atomically: temp file, rename), then count it.
        Returns 1 if newly stored, 0 if it was stored already, -1 if the job is gone or
        cancelled (the file is removed again)."""
        path = self.segment_path(job, seg, fmt)
        try:
            await asyncio.to_thread(_write_atomic, path, data, consumer)
        except FileNotFoundError:
            # the job was cancelled or deleted (its directory removed) while this segment
            # was written: nothing to store
            state = _s(await self.redis.hget(self.key(job), "state"))
            if state in (JobState.CANCELLED, ""):
                return -1
            raise
        keys = [self.key(job), self.key(job, "bits"), self.key(job, "seglen"),
                self.key(job, "log")]
        result = int(await self._complete(
            keys=keys, args=[seg, samples, consumer, time.time(), self.config.ttl_s]))
        if result < 0:
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only if empty: a deleted job leaves no directory
        return result

    # -- the queue (workers) -----------------------------------------------------------

    async def ensure_group(self) -> None:
        from redis.exceptions import ResponseError

        try:
            await self.redis.xgroup_create(self.queue, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @staticmethod
    def _entries(raw: Sequence[Any]) -> list[QueueEntry]:
        out = []
        for entry_id, fields in raw:
            if not fields:
                continue
            out.append(QueueEntry(entry_id.decode(), fields[b"job"].decode(),
                                  int(fields[b"seg"])))
        return out

    async def claim_stale(self, consumer: str, count: int) -> list[QueueEntry]:
        """Entries another consumer left unacknowledged for ``claim_idle_s`` (it died)."""
        idle_ms = int(self.config.claim_idle_s * 1000)
        result = await self.redis.xautoclaim(self.queue, self.group, consumer, idle_ms,
                                             start_id="0-0", count=count)
        return self._entries(result[1])

    async def read(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        """New entries for this consumer (waits up to ``block_ms``)."""
        result = await self.redis.xreadgroup(self.group, consumer, {self.queue: ">"},
                                             count=count, block=block_ms)
        return self._entries(result[0][1]) if result else []

    async def keep(self, consumer: str, ids: Sequence[str]) -> None:
        """Reset the idle time of entries this consumer is still working on."""
        if ids:
            await self.redis.xclaim(self.queue, self.group, consumer, 0, list(ids),
                                    justid=True)

    async def ack(self, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.queue, self.group, entry_id)
            pipe.xdel(self.queue, entry_id)
            await pipe.execute()


def _write_atomic(path: Path, data: bytes, consumer: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{consumer}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
