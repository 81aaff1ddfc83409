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

**Fair between keys.** Each key (job owner) has its own stream; workers read every
stream with queued work in one ``XREADGROUP``, a few entries from each, so one key's
14,000-segment job cannot keep another key's one sentence waiting: the keys' segments
are taken round-robin.

**Per-key bounds.** A key holds at most ``max_jobs_per_key`` unfinished jobs, at most
``max_queued_chars_per_key`` of their text, and at most ``max_audio_bytes_per_key`` of
stored audio (a job that would write past it fails with the reason); a record that
expired takes its audio with it (:meth:`JobStore.collect`, run by workers).

Keys (``P`` = ``JobsConfig.prefix``)::

    P:queue              stream of {job, seg} of jobs from before per-key streams
    P:queue:OWNER        stream of {job, seg} of one key's jobs; group "workers"
    P:queues             set of the streams that may hold entries
    P:owner:OWNER        hash: job -> bytes of stored audio (the key's jobs)
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

CANCEL_TRIES = 20  # watched transactions a cancel tries before the error goes up

_COMPLETE = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == false or state == 'cancelled' or state == 'failed' then return -1 end
if redis.call('GETBIT', KEYS[2], ARGV[1]) == 0 and tonumber(ARGV[8]) >= 0 then
  local held = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[5])) do held = held + tonumber(v) end
  if held + tonumber(ARGV[6]) > tonumber(ARGV[8]) then return -2 end
end
local old = redis.call('SETBIT', KEYS[2], ARGV[1], 1)
redis.call('RPUSH', KEYS[4], ARGV[1] .. ' ' .. ARGV[3])
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
if old == 1 then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'samples', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'bytes', ARGV[6])
if redis.call('HEXISTS', KEYS[5], ARGV[7]) == 1 then
  redis.call('HINCRBY', KEYS[5], ARGV[7], ARGV[6])
  redis.call('EXPIRE', KEYS[5], ARGV[5])
end
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
    id: str  # the entry's id in its stream
    job: str
    seg: int
    stream: str = ""  # the owner's stream it came from

    @property
    def key(self) -> str:
        """Unique among every stream's entries (ids are unique only within a stream)."""
        return f"{self.stream} {self.id}"


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
        self.queue = f"{config.prefix}:queue"  # (jobs queued before per-key streams)
        self.queues = f"{config.prefix}:queues"
        self.group = "workers"
        self._complete = self.redis.register_script(_COMPLETE)
        self._start = self.redis.register_script(_START)
        self._forget_empty = self.redis.register_script(_FORGET_EMPTY)

    async def aclose(self) -> None:
        await self.redis.aclose()

    def key(self, job: str, part: str = "") -> str:
        return f"{self.config.prefix}:job:{job}" + (f":{part}" if part else "")

    def queue_of(self, owner: str) -> str:
        return f"{self.config.prefix}:queue:{owner}"

    def owner_key(self, owner: str) -> str:
        return f"{self.config.prefix}:owner:{owner}"

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
            "created": time.time(), "chapters": b"[]", "error": "", "bytes": 0})
        await self.redis.expire(key, self.config.ttl_s)
        await self.redis.hset(self.owner_key(owner), job, 0)
        await self.redis.expire(self.owner_key(owner), self.config.ttl_s)

    async def add_segments(self, job: str, texts: Sequence[str]) -> None:
        if texts:
            await self.redis.rpush(self.key(job, "segs"), *texts)

    async def commit(self, job: str, total: int, chars: int, chapters: list[Chapter],
                     owner: str = "") -> None:
        """The upload is complete: queue one stream entry per segment, on the owner's
        stream."""
        ttl = self.config.ttl_s
        table = [[c.start, c.title, c.first_segment] for c in chapters]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(job), mapping={"state": JobState.QUEUED, "total": total,
                                              "chars": chars, "chapters": orjson.dumps(table)})
            pipe.expire(self.key(job, "segs"), ttl)
            await pipe.execute()
        queue = self.queue_of(owner or "_")
        await self._ensure_group(queue)
        for first in range(0, total, 1000):
            async with self.redis.pipeline(transaction=True) as pipe:
                for seg in range(first, min(total, first + 1000)):
                    pipe.xadd(queue, {"job": job, "seg": seg})
                pipe.sadd(self.queues, queue)  # (after the entries: see _FORGET_EMPTY)
                await pipe.execute()

    async def discard(self, job: str, owner: str = "") -> None:
        """Forget a job whose upload failed."""
        if owner:
            await self.redis.hdel(self.owner_key(owner), job)
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
        """Cancel a job that has not finished; delete its stored audio. False if final.

        The state is read and changed in one watched transaction; a worker's write to the
        job between the two (its progress, its start) aborts it, and it is tried again
        (CANCEL_TRIES times: CI once saw the first try fail, and the DELETE answered 503)."""
        from redis.exceptions import WatchError

        for attempt in range(CANCEL_TRIES):
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
                try:
                    await pipe.execute()
                    break
                except WatchError:
                    if attempt + 1 == CANCEL_TRIES:
                        raise
                    logger.debug("job %s changed while it was cancelled; again", job)
        await asyncio.to_thread(shutil.rmtree, self.dir / job, True)
        owner = _s(await self.redis.hget(self.key(job), "owner"))
        if owner and await self.redis.hexists(self.owner_key(owner), job):
            await self.redis.hset(self.owner_key(owner), job, 0)
        return True

    async def delete(self, job: str, owner: str = "") -> None:
        """Forget a finished job and delete its audio."""
        await asyncio.to_thread(shutil.rmtree, self.dir / job, True)
        if owner:
            await self.redis.hdel(self.owner_key(owner), job)
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
        cancelled, -2 if the owner's stored audio would pass ``max_audio_bytes_per_key``
        (the file is removed again; checked in the same script as the count, so workers
        storing at once cannot pass it together)."""
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
        owner = _s(await self.redis.hget(self.key(job), "owner"))
        keys = [self.key(job), self.key(job, "bits"), self.key(job, "seglen"),
                self.key(job, "log"), self.owner_key(owner or "_")]
        result = int(await self._complete(
            keys=keys, args=[seg, samples, consumer, time.time(), self.config.ttl_s,
                             len(data), job,
                             self.config.max_audio_bytes_per_key if owner else -1]))
        if result < 0:
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only if empty: a deleted job leaves no directory
        return result

    # -- the queue (workers) -----------------------------------------------------------

    async def ensure_group(self) -> None:
        """The group on the streams from before per-key streams (if any entries are
        left there, they are read like any key's)."""
        await self._ensure_group(self.queue)
        await self.redis.sadd(self.queues, self.queue)

    async def _ensure_group(self, queue: str) -> None:
        from redis.exceptions import ResponseError

        try:
            await self.redis.xgroup_create(queue, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def streams(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(self.queues))

    @staticmethod
    def _entries(stream: str, raw: Sequence[Any]) -> list[QueueEntry]:
        out = []
        for entry_id, fields in raw:
            if not fields:
                continue
            out.append(QueueEntry(entry_id.decode(), fields[b"job"].decode(),
                                  int(fields[b"seg"]), stream))
        return out

    async def claim_stale(self, consumer: str, count: int) -> list[QueueEntry]:
        """Entries another consumer left unacknowledged for ``claim_idle_s`` (it died)."""
        from redis.exceptions import ResponseError

        idle_ms = int(self.config.claim_idle_s * 1000)
        out: list[QueueEntry] = []
        for stream in await self.streams():
            if len(out) >= count:
                break
            try:
                result = await self.redis.xautoclaim(stream, self.group, consumer, idle_ms,
                                                     start_id="0-0", count=count - len(out))
            except ResponseError:  # NOGROUP: the stream went away meanwhile
                continue
            out += self._entries(stream, result[1])
        return out

    async def read(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        """New entries for this consumer (waits up to ``block_ms``): a share of ``count``
        from every key's stream, so the keys take turns (one entry each when there are
        more keys with work than ``count``)."""
        from redis.exceptions import ResponseError

        streams = await self.streams()
        if not streams:
            await asyncio.sleep(block_ms / 1000)
            return []
        share = max(1, count // len(streams))
        try:
            result = await self.redis.xreadgroup(self.group, consumer,
                                                 dict.fromkeys(streams, ">"),
                                                 count=share, block=block_ms)
        except ResponseError as exc:  # a stream lost its group: make it again
            logger.warning("job queue: %s", exc)
            for stream in streams:
                await self._ensure_group(stream)
            return []
        out: list[QueueEntry] = []
        got = set()
        for stream, raw in result or []:
            name = stream.decode() if isinstance(stream, bytes) else str(stream)
            got.add(name)
            out += self._entries(name, raw)
        for stream in streams:  # nothing left in it: forget it (atomically, see the script)
            if stream not in got and stream != self.queue:
                await self._forget_empty(keys=[stream, self.queues])
        return out

    async def keep(self, consumer: str, entries: Sequence[QueueEntry]) -> None:
        """Reset the idle time of entries this consumer is still working on."""
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(e.stream or self.queue, []).append(e.id)
        for stream, ids in by_stream.items():
            await self.redis.xclaim(stream, self.group, consumer, 0, ids, justid=True)

    async def ack(self, entry: QueueEntry) -> None:
        stream = entry.stream or self.queue
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(stream, self.group, entry.id)
            pipe.xdel(stream, entry.id)
            await pipe.execute()

    async def drop_entries(self, entry: QueueEntry) -> int:
        """Acknowledge and delete the entries of ``entry``'s job that follow it in its
        stream (a cancelled or failed job's: ~700,000 dead entries took minutes to drain
        one by one). A job's entries are added together, so this stops at the first batch
        with none of them. Returns how many were dropped."""
        stream = entry.stream or self.queue
        start, dropped = entry.id, 0
        while True:
            rows = await self.redis.xrange(stream, min=f"({start}", count=1000)
            if not rows:
                return dropped
            ids = [rid for rid, fields in rows if fields.get(b"job", b"").decode() == entry.job]
            if ids:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xack(stream, self.group, *ids)
                    pipe.xdel(stream, *ids)
                    await pipe.execute()
                dropped += len(ids)
            if not ids:
                return dropped
            start = rows[-1][0].decode()

    # -- per-key bounds and collection -------------------------------------------------

    async def holdings(self, owner: str) -> tuple[int, int, int]:
        """(unfinished jobs, bytes of their text, bytes of stored audio) of ``owner``'s
        jobs; forgets the jobs whose records expired (their audio is collected)."""
        jobs = await self.redis.hgetall(self.owner_key(owner))
        if not jobs:
            return 0, 0, 0
        names = [j.decode() for j in jobs]
        async with self.redis.pipeline(transaction=False) as pipe:
            for job in names:
                pipe.hmget(self.key(job), "state", "chars")
            rows = await pipe.execute()
        unfinished = text = audio = 0
        gone = []
        for job, (state, chars) in zip(names, rows, strict=True):
            if state is None:
                gone.append(job)
                continue
            audio += int(jobs[job.encode()] or 0)
            if _s(state) not in (JobState.DONE, JobState.FAILED, JobState.CANCELLED):
                unfinished += 1
                text += int(chars or 0)
        if gone:
            await self.redis.hdel(self.owner_key(owner), *gone)
            for job in gone:
                await asyncio.to_thread(shutil.rmtree, self.dir / job, True)
        return unfinished, text, audio

    async def collect(self) -> int:
        """Delete the audio of jobs whose records expired (or were never committed and
        are gone): every directory under ``dir`` with no record. Returns how many."""
        try:
            names = await asyncio.to_thread(
                lambda: [p.name for p in self.dir.iterdir() if p.is_dir()])
        except OSError:
            return 0
        removed = 0
        for first in range(0, len(names), 500):
            batch = names[first:first + 500]
            async with self.redis.pipeline(transaction=False) as pipe:
                for job in batch:
                    pipe.exists(self.key(job))
                found = await pipe.execute()
            for job, exists in zip(batch, found, strict=True):
                if not exists:
                    await asyncio.to_thread(shutil.rmtree, self.dir / job, True)
                    removed += 1
        if removed:
            logger.info("collected the audio of %d expired jobs", removed)
        return removed


_FORGET_EMPTY = """
if redis.call('XLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], KEYS[1]) end
return 1
"""


def _write_atomic(path: Path, data: bytes, consumer: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{consumer}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
