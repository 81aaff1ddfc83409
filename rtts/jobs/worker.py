"""The job worker: segments from the queue, synthesized at background priority, stored.

One per process (``rtts serve --jobs`` or ``rtts worker``), beside the live front-ends on
the same :class:`~rtts.core.service.Service`: its segments go through the one synthesis
path (:meth:`Service.open_context` with ``background=True``), so the scheduler gives them
only batch slots no live stream wants, and takes them back at the next step when one
does (the segment fails with :class:`~rtts.core.scheduler.Preempted` and is run again).

Memory stays flat whatever the job's length: at most ``concurrency`` segments are in
flight, each one's audio is encoded as it arrives and written to its file when complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rtts.audio.codecs import open_encoder
from rtts.core.context import Audio, SegmentFailed, SpeechContext
from rtts.core.params import SynthParams
from rtts.core.scheduler import Preempted
from rtts.core.service import Service
from rtts.errors import Overloaded, RttsError
from rtts.jobs.model import JobState
from rtts.jobs.store import JobRecord, JobStore, QueueEntry
from rtts.text.segmenter import Chunk

__all__ = ["JobWorker", "WorkerStats"]

logger = logging.getLogger("rtts.jobs.worker")

_READ_BLOCK_MS = 500
_STOP_S = 3.0
_COLLECT_EVERY_S = 600.0


@dataclass
class WorkerStats:
    segments: int = 0  # stored (first time)
    repeats: int = 0  # stored again (another worker had it already)
    preempted: int = 0  # runs that gave their slot to a live stream
    skipped: int = 0  # entries of cancelled, failed or vanished jobs
    failures: int = 0  # engine failures
    audio_s: float = 0.0
    busy: int = 0  # segments in flight now
    started_at: float = field(default_factory=time.monotonic)


class JobWorker:
    """Reads the queue as ``consumer`` and keeps up to ``concurrency`` segments running."""

    def __init__(self, service: Service, store: JobStore, consumer: str,
                 concurrency: int) -> None:
        self.service = service
        self.store = store
        self.consumer = consumer
        self.concurrency = max(1, concurrency)
        self.stats = WorkerStats()
        self._inflight: dict[str, tuple[QueueEntry, SpeechContext | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self._housekeeper: asyncio.Task[None] | None = None
        self._slot_free = asyncio.Event()
        self._stopping = False

    async def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name="rtts-jobs-worker")
        self._housekeeper = asyncio.create_task(self._housekeep(), name="rtts-jobs-keep")
        logger.info("job worker %s: up to %d segments at once", self.consumer,
                    self.concurrency)

    async def stop(self) -> None:
        """Stop reading and cancel the segments in flight (unacknowledged: another worker
        takes them over after ``claim_idle_s``). The reader is not cancelled inside a
        blocking ``XREADGROUP`` (redis-py's asyncio client can hang there): it stops at
        the end of its current read, at most ``block_ms`` later."""
        self._stopping = True
        self._slot_free.set()
        tasks = [t for t in (self._housekeeper, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        if self._main is not None:
            tasks.append(self._main)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_STOP_S)
            for task in pending:  # should not happen; do not hang the shutdown on it
                logger.warning("job worker task %s did not stop", task.get_name())
                task.cancel()
        self._main = self._housekeeper = None

    # -- reading the queue -------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.store.ensure_group()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("job queue unavailable: %s", exc)
                await asyncio.sleep(1.0)
        while not self._stopping:
            free = self.concurrency - len(self._inflight)
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            try:
                entries = await self.store.claim_stale(self.consumer, free)
                if entries:
                    logger.info("took over %d segments left by a stopped worker",
                                len(entries))
                else:
                    entries = await self.store.read(self.consumer, free,
                                                    block_ms=_READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: retry, do not die
                logger.warning("job queue unavailable: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for entry in entries:
                if self._stopping:
                    return  # unacknowledged: taken over by another worker later
                if entry.key in self._inflight:
                    continue
                self._inflight[entry.key] = (entry, None)
                task = asyncio.create_task(self._segment(entry), name="rtts-jobs-segment")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _housekeep(self) -> None:
        """Keep our entries claimed, and stop segments of jobs cancelled meanwhile."""
        keep_every = max(0.2, self.store.config.claim_idle_s / 3)
        last_keep = 0.0
        last_collect = time.monotonic() - _COLLECT_EVERY_S + 5.0  # first soon after start
        while True:
            await asyncio.sleep(min(0.5, keep_every))
            try:
                if time.monotonic() - last_collect >= _COLLECT_EVERY_S:
                    last_collect = time.monotonic()
                    await self.store.collect()  # audio of expired jobs
                if time.monotonic() - last_keep >= keep_every:
                    await self.store.keep(self.consumer,
                                          [e for e, _ in self._inflight.values()])
                    last_keep = time.monotonic()
                for job in {e.job for e, ctx in self._inflight.values() if ctx is not None}:
                    if await self.store.state(job) != JobState.RUNNING:
                        for e, ctx in list(self._inflight.values()):
                            if ctx is not None and e.job == job:
                                ctx.close()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("job worker housekeeping failed: %s", exc)

    # -- one segment -------------------------------------------------------------------

    async def _segment(self, entry: QueueEntry) -> None:
        self.stats.busy += 1
        try:
            await self._process(entry)
        except asyncio.CancelledError:
            raise
        except Exception:  # Redis or disk trouble: leave it unacknowledged (retried)
            logger.exception("segment %d of job %s failed", entry.seg, entry.job)
            await asyncio.sleep(1.0)
        finally:
            self.stats.busy -= 1
            self._inflight.pop(entry.key, None)
            self._slot_free.set()

    async def _process(self, entry: QueueEntry) -> None:
        store = self.store
        record = await store.get(entry.job)
        if record is None or record.final or record.state == "uploading" \
                or await store.is_stored(entry.job, entry.seg):
            self.stats.skipped += record is None or record.final
            await store.ack(entry)
            if record is None or record.state in (JobState.CANCELLED, JobState.FAILED):
                # the job's other entries are dead too: drop them now, not one by one
                self.stats.skipped += await store.drop_entries(entry)
            return
        text = await store.segment_text(entry.job, entry.seg)
        if text is None:
            await store.ack(entry)
            return
        await store.mark_started(entry.job)
        while True:
            result = await self._synthesize(entry, record, text)
            if isinstance(result, tuple):
                break
            if result is None:  # the job was cancelled meanwhile
                self.stats.skipped += 1
                await store.ack(entry)
                return
            if isinstance(result, Preempted):
                self.stats.preempted += 1
                continue  # queued again, behind every live request
            if isinstance(result, Overloaded):
                await asyncio.sleep(0.5)
                continue
            self.stats.failures += 1
            attempts = await store.attempt(entry.job, entry.seg)
            logger.warning("segment %d of job %s failed (attempt %d): %s", entry.seg,
                           entry.job, attempts, result.message)
            if attempts >= store.config.max_attempts:
                await store.fail(entry.job, f"segment {entry.seg} failed: {result.message}")
                await store.ack(entry)
                return
        data, samples = result
        stored = await store.store_segment(entry.job, entry.seg, record.format, data, samples,
                                           self.consumer)
        if stored == -2:
            cap = store.config.max_audio_bytes_per_key
            await store.fail(entry.job, f"the key's stored audio would pass {cap} bytes "
                             "(max_audio_bytes_per_key); delete finished jobs first")
        elif stored == 1:
            self.stats.segments += 1
            self.stats.audio_s += samples / record.sample_rate
        elif stored == 0:
            self.stats.repeats += 1
        await store.ack(entry)

    async def _synthesize(self, entry: QueueEntry, record: JobRecord, text: str
                          ) -> tuple[bytes, int] | RttsError | None:
        """One run of the segment: (encoded audio, samples), the error that ended it, or
        None if the job was cancelled while it ran."""
        fmt = "pcm16" if record.format == "wav" else record.format
        params = SynthParams(**_params(record.params))
        ctx = self.service.open_context(params, lookahead=1, use_cache=False, background=True)
        self._inflight[entry.key] = (entry, ctx)
        encoder = open_encoder(fmt, self.service.sample_rate, record.sample_rate,
                               part=True)
        parts: list[bytes] = []
        error: RttsError | None = None
        ctx.add_segment(Chunk(text, 0, len(text)))
        ctx.end()
        events = ctx.events()
        try:
            async for event in events:
                if isinstance(event, Audio):
                    parts.append(encoder.encode(event.samples))
                elif isinstance(event, SegmentFailed):
                    error = event.error
        finally:
            await events.aclose()
            self._inflight[entry.key] = (entry, None)
        if error is not None:
            return error
        if not ctx.finished:
            return None
        parts.append(encoder.finish())
        return b"".join(parts), encoder.samples


def _params(raw: dict[str, Any]) -> dict[str, Any]:
    allowed = set(SynthParams.__dataclass_fields__)
    return {k: v for k, v in raw.items() if k in allowed}
