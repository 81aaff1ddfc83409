"""Per-device batch scheduler: gathers segments from concurrent streams into engine batches.

**Continuous batching** (the default, for engines that support it: ``engine.continuous``
and ``engine.serve``): a running batch is a set of ``max_batch_size`` slots. Before every
engine step the engine asks the scheduler for requests to fill its free slots, so a
request that arrives while a batch runs joins it at the next step instead of waiting for
the whole batch; a finished or cancelled row frees its slot at once. Waiting requests are
admitted a stream's first segment first, then oldest first. Under load the governor can
shrink the slot count (``degraded_slots``). The per-request timeout counts from a
request's admission. ``batching="static"`` keeps the fixed-batch behaviour below.

**Static batching** (``batching="static"``, and engines without ``serve``):
requests wait in a bounded intake list. A dispatcher task takes a device slot (an
``asyncio.Semaphore`` of ``concurrency`` permits), waits up to ``max_wait_ms`` for
more requests (unless the batch is already full), then picks the head request -- a
stream's first segment before anything else, then oldest first -- plus every waiting
request with the same :meth:`Engine.batch_key`, up to ``max_batch_size``. A static batch
runs on the device's own thread pool, a continuous batch in a thread started for it that
ends with it (:mod:`rtts.engines.threads`); each output chunk is handed to the request's
:class:`RequestStream` mailbox on the event loop thread.

If the engine raises, rows that already produced audio fail with :class:`EngineError`;
the others are retried one by one, so a single bad request fails alone.

Mailboxes coalesce: if the consumer lags, pending chunks are concatenated, so the
engine thread never blocks on a slow socket, and memory per request stays bounded by
one segment's audio. Cancelling a request sets its event: a queued request is dropped,
a running row is skipped, and once every row of a batch is cancelled the engine's
generator is closed, which stops generation at its next step.

**Background class** (``priority=BACKGROUND``: long-text job segments, :mod:`rtts.jobs`):
the lowest priority, for continuous batching. A background request takes only slots no
live request wants (after the :attr:`~Scheduler.reserve`, never while a row warms up or a
live request is admitted in the same step; beside live rows at most
``background_rows_with_live``), and gives its slot back: when a live request waits and its
batch has no free slot, or live rows arrive in a batch holding more background rows than
that, the newest background rows are cancelled and fail with :class:`Preempted`; the engine
drops them at its next step, so the live request joins one step later. The job worker
re-runs a preempted segment from the start (segments are idempotent; nothing of a
preempted row is kept). Background requests do not count in
:attr:`~Scheduler.queue_depth` (the governor's load signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rtts.engines.base import ContinuousEngine, Engine, SynthRequest
from rtts.engines.threads import start_in_own_thread
from rtts.errors import EngineError, EngineTimeout, ErrorCode, Overloaded

__all__ = ["BACKGROUND", "Preempted", "RequestStream", "Scheduler", "SchedulerConfig"]

logger = logging.getLogger("rtts.core.scheduler")

BACKGROUND = 9  # SynthRequest.priority of a background (job) segment: see the docstring


class Preempted(EngineError):
    """A background request gave its batch slot to a live one; run it again later."""

    code = ErrorCode.OVERLOADED


# a stream counts as playing (keeps its slot while held at the real-time capacity) until
# it ends (stream_ended), or at most this long after a segment of it was admitted or ended
PLAYING_S = 5.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8  # rows (slots) of a batch
    max_wait_ms: float = 15.0
    concurrency: int = 1  # batches running at once on this device
    max_queue: int = 256  # requests waiting (not running) before submit() raises Overloaded
    request_timeout_s: float = 120.0  # per batch (static) or request (continuous), running
    batching: str = "continuous"  # continuous | static (fixed batches, nobody joins)
    degraded_slots: int | None = None  # slots of a continuous batch while degraded
    # Slots that later segments (lookahead) leave free for streams' first segments, so a
    # new stream starts at the next step; None = 3/8 of the slots (1 of 4, 3 of 8).
    first_segment_slots: int | None = None
    # A later segment waits at most this long while a first segment in the batch has no
    # audio yet (its prefill would delay that first audio); 0 = never waits.
    later_hold_s: float = 3.0
    # Background (job) rows a batch keeps while it has live rows or a live request waits;
    # the rest give their slots back (each row makes a step slower); None = 1/4 of the slots.
    background_rows_with_live: int | None = None
    # Lookahead within the measured real-time capacity: once the engine has measured how
    # many rows stay real time (``realtime_slots``), a stream's next segment joins a batch
    # that already runs a row of that stream only while the batch holds fewer rows.
    # Beyond it every extra row slows the segments being heard below real time (ChatTTS
    # int4 compiled on 2 cores, while serving: 21 ms a step at 4 rows, 30-35 at 5; real
    # time needs <= 21.3). Nor while one more row would lower the batch's tokens per
    # second by the step times the engine measured (``step_ms``): with 4 streams on that
    # CPU the capacity measured 0 or 1 (no limit then) and 5-row steps took 35-40 ms.
    lookahead_within_capacity: bool = True


class RequestStream:
    """The consumer side of one request: ``async for samples in stream``.

    Raises the request's :class:`EngineError` (or :class:`EngineTimeout`) from
    iteration if it failed. Created by :meth:`Scheduler.submit`.
    """

    def __init__(self, request: SynthRequest) -> None:
        self.request = request
        self.submitted_at = time.monotonic()
        self.first_audio_at: float | None = None
        self.solo = False  # retry alone: its batch failed before it produced audio
        self.admitted_at: float | None = None  # when it started running
        self._pending: deque[npt.NDArray[np.float32]] = deque()
        self._pushed_at: deque[float] = deque()
        self.produced_at = 0.0  # when the oldest chunk of the last __anext__ result arrived
        self._done = False
        self._error: Exception | None = None
        self._wakeup = asyncio.Event()
        # called (on the event loop) when the request ends, however it ends
        self.on_finish: Callable[[], None] | None = None

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def ready(self) -> bool:
        """Audio (or the end) can be read without waiting."""
        return bool(self._pending) or self._done

    def cancel(self) -> None:
        self.request.cancel()
        self._finish(None)

    def _push(self, samples: npt.NDArray[np.float32]) -> None:
        if self._done:
            return
        now = time.monotonic()
        if self.first_audio_at is None:
            self.first_audio_at = now
        self._pending.append(samples)
        self._pushed_at.append(now)
        self._wakeup.set()

    def _finish(self, error: Exception | None) -> None:
        if self._done:
            return
        self._done = True
        self._error = error
        self._wakeup.set()
        if self.on_finish is not None:
            callback, self.on_finish = self.on_finish, None
            callback()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> npt.NDArray[np.float32]:
        while True:
            if self._pending:
                self.produced_at = self._pushed_at[0]
                self._pushed_at.clear()
                if len(self._pending) == 1:
                    return self._pending.popleft()
                merged = np.concatenate(list(self._pending))
                self._pending.clear()
                return merged
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()


class Scheduler:
    """One per device. ``start()``, then ``submit()`` from the event loop; ``stop()`` at exit."""

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self._queue: list[RequestStream] = []
        self._qlock = threading.Lock()  # the queue is also read by a continuous batch's thread
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(self.config.concurrency)
        # static batches (a continuous batch runs in a thread of its own)
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.concurrency, thread_name_prefix=f"rtts-{engine.name}"
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self.running_batches = 0
        self.batch_sizes: Counter[int] = Counter()
        self.joined = 0  # requests that joined a batch already running (continuous)
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.degraded = False  # set by the load governor: no batch wait
        # rows the engine keeps in real time, as it measured (None: unknown); while
        # degraded a continuous batch admits no more (set by the service)
        self.realtime_slots: int | None = None
        # rows -> ms of a step at that many rows, as the engine measured them while serving
        # (refresh_step_costs; empty: unknown); holds back lookahead that would lower the
        # batch's tokens per second (lookahead_costs)
        self.step_ms: dict[int, float] = {}
        # rows -> ms of the engine's linear layers at that many rows, timed at load: the
        # step at a row count not measured yet is estimated from it (lookahead_costs)
        self.linear_ms: dict[int, float] = {}
        self._playing: dict[int, float] = {}  # stream -> when a segment of it was admitted
        self.busy_s = 0.0  # device time spent in batches
        self.audio_samples = 0  # audio the engine produced (at engine.sample_rate)
        self.preempted = 0  # background rows that gave their slot to a live request
        self._runs: set[_Run] = set()  # running continuous batches
        self._posts: list[tuple[Callable[[Any], None], object]] = []
        self._posts_lock = threading.Lock()
        self._posts_scheduled = False

    # -- public API ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Live requests waiting (background ones are not load)."""
        return sum(1 for s in self._queue if s.request.priority < BACKGROUND)

    async def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch(), name="rtts-dispatcher")

    def submit(self, request: SynthRequest) -> RequestStream:
        """Queue a request; raise :class:`Overloaded` when the intake is full."""
        if self._dispatcher is None:
            raise EngineError("scheduler is not running", code=ErrorCode.SHUTTING_DOWN)
        stream = RequestStream(request)
        with self._qlock:
            self._queue = [s for s in self._queue if not s.request.cancelled.is_set()]
            if len(self._queue) >= self.config.max_queue:
                raise Overloaded(f"synthesis queue is full ({self.config.max_queue} waiting)")
            self._queue.append(stream)
        self._arrived.set()
        if request.priority < BACKGROUND:
            self._preempt()
        return stream

    @property
    def continuous(self) -> bool:
        return self.config.batching == "continuous" and self.engine.info.continuous

    @property
    def reserve(self) -> int:
        """Free slots that only a stream's first segment may take (continuous)."""
        n = self.config.first_segment_slots
        if n is None:
            n = self.config.max_batch_size * 3 // 8
        return max(0, min(n, self.slot_limit - 1))

    @property
    def slot_limit(self) -> int:
        """Rows a continuous batch may hold now (the governor shrinks it when degraded:
        to ``degraded_slots``, and to the measured real-time capacity)."""
        limit = self.config.max_batch_size
        if self.degraded:
            for cap in (self.config.degraded_slots, self.realtime_slots):
                if cap:
                    limit = max(1, min(limit, cap))
        return limit

    def stream_ended(self, stream: int) -> None:
        """(Event loop.) A stream (context) ended: it no longer holds a slot."""
        if self._playing.pop(stream, None) is not None:
            self._arrived.set()

    def refresh_step_costs(self) -> None:
        """Take the step and linear-layer times the engine reports now (``info.kernels``:
        ChatTTS measures them); an engine that reports none leaves them as they are."""
        kernels = self.engine.info.kernels or {}
        for key in ("step_ms", "linear_ms"):
            if isinstance(got := kernels.get(key), dict):
                setattr(self, key, {int(r): float(ms) for r, ms in got.items()})

    def lookahead_costs(self, rows: int) -> bool:
        """Whether one more row beside ``rows`` would lower the batch's tokens per second,
        by the measured step times (rows per ms). A step at ``rows + 1`` not measured yet
        is estimated as the one at ``rows`` plus what the linear layers add (``linear_ms``,
        timed at load); False where neither says (the row joins, and its steps measure
        it)."""
        now, more = self.step_ms.get(rows), self.step_ms.get(rows + 1)
        lin = self.linear_ms
        if now and not more and rows in lin and rows + 1 in lin:
            more = now + lin[rows + 1] - lin[rows]
        if not now or not more or more <= 0:
            return False
        return (rows + 1) / more < rows / now

    @property
    def capacity_capped(self) -> bool:
        """Degraded, and the measured real-time capacity holds the batch below its slots."""
        cap = self.realtime_slots
        return self.degraded and bool(cap) and cap is not None and (
            cap < self.config.max_batch_size)

    @property
    def live_streams(self) -> int:
        """Live requests running in a continuous batch or waiting for one."""
        running = sum(1 for run in list(self._runs) for s in list(run.streams.values())
                      if not s.finished and s.request.priority < BACKGROUND)
        return running + self.queue_depth

    async def stop(self) -> None:
        """Cancel the dispatcher and every batch, fail what is queued, free the threads."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
            self._dispatcher = None
        with self._qlock:
            queued, self._queue = self._queue, []
        self._shut_down(queued)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            while not self._live():
                self._arrived.clear()
                await self._arrived.wait()
            await self._slots.acquire()
            try:
                await self._gather_wait()
                continuous = self.continuous and not any(s.solo for s in self._live())
                batch = self._pick(self.slot_limit) if continuous else self._take_batch()
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                # held at the capacity: wait for a stream to end or a request to arrive
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self._arrived.wait()
                continue
            run = self._run_continuous(batch) if continuous else self._run(batch)
            task = asyncio.create_task(run, name="rtts-batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _live(self) -> list[RequestStream]:
        with self._qlock:
            self._queue = [s for s in self._queue if not s.request.cancelled.is_set()]
            return self._queue

    @property
    def background_cap(self) -> int:
        """Background rows a batch keeps beside live rows."""
        n = self.config.background_rows_with_live
        return max(0, self.config.max_batch_size // 4 if n is None else n)

    def _pick(self, n: int, warming: bool = False,
              background_room: int | None = None,
              running: Sequence[RequestStream] = ()) -> list[RequestStream]:
        """Take up to ``n`` waiting requests for a continuous batch (any thread) with
        ``n`` free slots: a stream's first segment first, then oldest first; solo retries
        are not taken. Later segments leave :attr:`reserve` slots free, and wait while a
        row of the batch (``warming``; among ``running``, a first segment) or a first
        segment taken now has no audio yet -- their prefill would delay that first audio
        -- unless they have waited ``later_hold_s`` already. (Not for another stream's
        later segment: with 4 streams whose segments ended together, the last one's next
        segment waited 8 steps for the others' first chunks, a gap the listener heard.)
        A later segment of a stream with a row among ``running`` (the batch's rows) waits
        while the batch holds the measured real-time capacity, or while one more row would
        lower the batch's measured tokens per second (``lookahead_within_capacity``); the
        capacity holds it only while no more streams than the capacity have rows running
        (beyond it the heard streams cannot all keep up anyway, and a held next segment
        started only once its stream's row had ended: the listener heard that gap. On the
        2-core AMD EPYC, `auto --compile` at capacity 1 with 2 streams: 0.15-0.17 s of
        silence per second held, 0.08-0.09 joining)."""
        if n <= 0:
            return []
        now = time.monotonic()
        # Held at the measured real-time capacity: streams already playing go first (their
        # later segments, without a reserve or a hold), new streams wait for a free slot;
        # otherwise a new stream would take the slot between two of a stream's segments
        # and every stream would stutter.
        capped = self.capacity_capped
        reserve = 0 if capped else self.reserve
        playing = self._playing
        # (The engine's thread runs this for a continuous batch while the loop changes
        # ``_playing``: dict.copy() is one step for other threads. list(items()) was not:
        # each item's tuple may start a garbage collection, whose callbacks run Python
        # code, where the loop thread can take over; the abuse mix hit "dictionary
        # changed size during iteration" and failed a batch.)
        for stream, at in playing.copy().items():
            if now - at > PLAYING_S:
                playing.pop(stream, None)

        held = capped and len(playing) >= self.slot_limit  # every slot has its stream
        first_warming = warming and (not running or any(
            s.first_audio_at is None and s.request.priority == 0 for s in running))
        within = self.config.lookahead_within_capacity
        cap = self.realtime_slots if within else None
        busy = {s.request.stream for s in running
                if s.request.stream is not None and not s.finished} if within else set()

        def key(s: RequestStream) -> tuple[Any, ...]:
            if not capped:
                return (s.request.priority, s.submitted_at)
            return (s.request.priority >= BACKGROUND, s.request.stream not in playing,
                    s.request.priority, s.submitted_at)

        with self._qlock:
            live = [s for s in self._queue if not s.request.cancelled.is_set()]
            order = sorted((s for s in live if not s.solo), key=key)
            chosen: list[RequestStream] = []
            refreshed = False
            for s in order:
                later = s.request.priority > 0
                if held and s.request.stream not in playing:
                    break  # a new stream waits for one of the playing streams to end
                room = n - len(chosen) - (reserve if later else 0)
                if room <= 0:
                    break
                if s.request.priority >= BACKGROUND and (warming or any(
                        c.request.priority < BACKGROUND for c in chosen) or (
                        background_room is not None and background_room <= 0)):
                    break  # background: only slots nobody live wants, no prefill beside them
                if later and s.request.stream in busy:
                    if not refreshed:  # the engine's step times as of now (rarely needed)
                        self.refresh_step_costs()
                        refreshed = True
                    if (cap and len(busy) <= cap and len(running) + len(chosen) >= cap) \
                            or self.lookahead_costs(len(running) + len(chosen)):
                        continue  # lookahead beyond real time: the heard rows come first
                if s.request.priority >= BACKGROUND and background_room is not None:
                    background_room -= 1
                if later and not capped and (first_warming or any(c.request.priority == 0
                                                            for c in chosen)) \
                        and now - s.submitted_at < self.config.later_hold_s:
                    break
                chosen.append(s)
            for s in chosen:
                if s.request.stream is not None:
                    playing[s.request.stream] = now
            if chosen:
                ids = {id(s) for s in chosen}
                self._queue = [s for s in live if id(s) not in ids]
            return chosen

    async def _gather_wait(self) -> None:
        wait_ms = 0.0 if self.degraded else self.config.max_wait_ms
        deadline = time.monotonic() + wait_ms / 1000.0
        while len(self._live()) < self.config.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._arrived.wait()

    def _take_batch(self) -> list[RequestStream]:
        live = self._live()
        if not live:
            return []
        order = sorted(live, key=lambda s: (not s.solo, s.request.priority, s.submitted_at))
        head = order[0]
        key = self.engine.batch_key(head.request.params)
        batch = [head]
        for s in order[1:]:
            if head.solo or len(batch) >= self.config.max_batch_size:
                break
            if not s.solo and self.engine.batch_key(s.request.params) == key:
                batch.append(s)
        chosen = {id(s) for s in batch}
        with self._qlock:
            self._queue = [s for s in self._queue if id(s) not in chosen]
        return batch

    async def _run(self, batch: list[RequestStream]) -> None:
        loop = asyncio.get_running_loop()
        self.running_batches += 1
        self.batch_sizes[len(batch)] += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("batch of %d: %s", len(batch), [s.request.text[:20] for s in batch])
        started = time.monotonic()
        future = loop.run_in_executor(self._executor, self._run_in_thread, loop, batch)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                await asyncio.shield(future)
        except TimeoutError:
            logger.warning("batch of %d timed out after %.1fs", len(batch),
                           self.config.request_timeout_s)
            for s in batch:
                s.request.cancel()
                s._finish(EngineTimeout(
                    f"synthesis exceeded {self.config.request_timeout_s:g}s"))
            self.failed += len(batch)
            # Keep the slot until the engine really lets go of the device.
            with contextlib.suppress(Exception):
                await future
        except asyncio.CancelledError:
            self._shut_down(batch)
            raise
        except Exception as exc:  # the engine raised: fail only the requests it concerns
            logger.exception("engine failed on a batch of %d", len(batch))
            self._engine_failed(batch, exc)
        finally:
            self.busy_s += time.monotonic() - started
            self.running_batches -= 1
            self._slots.release()
            self._arrived.set()

    async def _run_continuous(self, first: list[RequestStream]) -> None:
        """One continuous batch: runs in a thread of its own until no row is left and no
        request waits; requests join it between steps (see the module docstring)."""
        loop = asyncio.get_running_loop()
        run = _Run(first)
        self._runs.add(run)
        self.running_batches += 1
        self.batch_sizes[len(first)] += 1
        started = time.monotonic()
        # a thread of its own that ends with the batch (rtts.engines.threads: a torch
        # thread that outlives its work slows every later step)
        future = start_in_own_thread(self._serve_in_thread, loop, run,
                                     name=f"rtts-{self.engine.name}")
        try:
            while not future.done():
                await asyncio.wait({future}, timeout=0.25)
                self._expire(run)
                self._preempt()
            future.result()
        except asyncio.CancelledError:
            run.closed = True  # the device thread may still ask for requests: none
            self._shut_down([*run.streams.values(), *run.pending])
            raise
        except Exception as exc:  # the engine raised: fail only the requests it concerns
            running = [*run.streams.values(), *run.pending]
            logger.exception("engine failed on a continuous batch of %d", len(running))
            self._engine_failed(running, exc)
        finally:
            run.closed = True
            self._runs.discard(run)
            self.busy_s += time.monotonic() - started
            self.running_batches -= 1
            self._slots.release()
            self._arrived.set()

    @staticmethod
    def _shut_down(streams: list[RequestStream]) -> None:
        for s in streams:
            s.request.cancel()
            s._finish(EngineError("server is shutting down", code=ErrorCode.SHUTTING_DOWN))

    def _engine_failed(self, streams: list[RequestStream], exc: Exception) -> None:
        """The engine raised while running ``streams``. Which row broke the batch is
        unknown: rows with no audio yet are retried alone, so one bad request cannot fail
        its neighbours; the others fail with an engine error."""
        # The details stay in the log; clients get a code and an incident id to quote.
        incident = secrets.token_hex(4)
        logger.error("engine failed (incident %s)", incident, exc_info=exc)
        error = EngineError(f"synthesis failed (incident {incident})")
        for s in streams:
            if s.finished or s.request.cancelled.is_set():
                continue
            if len(streams) > 1 and s.first_audio_at is None:
                s.solo = True
                with self._qlock:
                    self._queue.append(s)
            else:
                s._finish(error)
                self.failed += 1

    def _preempt(self) -> None:
        """(Event loop.) Live requests wait and a running batch has no free slot for them:
        cancel that batch's newest background rows, one per waiting live request; and a
        batch with live rows or waiting live requests keeps at most :attr:`background_cap`
        background rows. The engine drops a cancelled row at its next step."""
        if not self._runs:
            return
        with self._qlock:
            waiting = sum(1 for s in self._queue if s.request.priority < BACKGROUND
                          and not s.solo and not s.request.cancelled.is_set())
        for run in list(self._runs):
            # (list() first: the engine's thread adds and removes rows while the
            # comprehension's bytecode runs; list() of a dict's values is one step.)
            rows = [s for s in list(run.streams.values()) if not s.finished]
            free = self.slot_limit - len(rows) - len(run.pending)
            background = sorted((s for s in rows if s.request.priority >= BACKGROUND),
                                key=lambda s: -(s.admitted_at or 0.0))
            live = len(rows) - len(background) + len(run.pending)
            over = len(background) - self.background_cap if live or waiting > 0 else 0
            evict = background[:max(0, waiting - max(0, free), over)]
            for s in evict:
                s.request.cancel()
                s._finish(Preempted("background segment preempted by a live stream"))
                self.preempted += 1
            waiting = max(0, waiting - max(0, free) - len(evict))
            if evict:
                logger.debug("preempted %d background rows", len(evict))

    def _expire(self, run: _Run) -> None:
        """Fail (and cancel) requests that have run longer than the request timeout."""
        limit = self.config.request_timeout_s
        now = time.monotonic()
        for s in list(run.streams.values()):
            if s.finished or s.admitted_at is None or now - s.admitted_at <= limit:
                continue
            logger.warning("request timed out after %.1fs in a continuous batch", limit)
            s.request.cancel()
            s._finish(EngineTimeout(f"synthesis exceeded {limit:g}s"))
            self.failed += 1

    def _serve_in_thread(self, loop: asyncio.AbstractEventLoop, run: _Run) -> None:
        def admit(free: int) -> list[SynthRequest]:
            if run.closed:
                return []
            if run.pending:
                taken, run.pending = run.pending[:free], run.pending[free:]
            else:
                rows = list(run.streams.values())
                warming = any(s.first_audio_at is None for s in rows)
                background = sum(1 for s in rows if s.request.priority >= BACKGROUND)
                room = self.background_cap - background if background < len(rows) else None
                taken = self._pick(min(free, self.slot_limit - len(run.streams)), warming, room,
                                   rows)
                self.joined += len(taken)
            now = time.monotonic()
            for s in taken:
                s.admitted_at = now
                run.streams[id(s.request)] = s
            return [s.request for s in taken]

        assert isinstance(self.engine, ContinuousEngine)
        serve = self.engine.serve
        gen = serve(admit, self.config.max_batch_size)
        try:
            for request, samples in gen:
                stream = run.streams[id(request)]
                if samples is None:
                    run.streams.pop(id(request), None)
                    if request.stream in self._playing:  # its next segment comes soon
                        self._playing[request.stream] = time.monotonic()
                    if request.cancelled.is_set():
                        self.cancelled += 1
                    elif not stream.finished:
                        self._post(loop, stream._finish, None)
                        self.completed += 1
                elif samples.size and not stream.finished and not request.cancelled.is_set():
                    self.audio_samples += samples.size
                    self._post(loop, stream._push, samples)
        finally:
            gen.close()

    def _run_in_thread(self, loop: asyncio.AbstractEventLoop, batch: list[RequestStream]) -> None:
        requests: Sequence[SynthRequest] = [s.request for s in batch]
        gen = self.engine.generate(requests)
        finished = [False] * len(batch)
        try:
            for row, samples in gen:
                if all(r.cancelled.is_set() for r in requests):
                    break
                if requests[row].cancelled.is_set() or finished[row]:
                    continue
                if samples is None:
                    finished[row] = True
                    self._post(loop, batch[row]._finish, None)
                    self.completed += 1
                elif samples.size:
                    self.audio_samples += samples.size
                    self._post(loop, batch[row]._push, samples)
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()  # a generator: stops the engine at its next step
        for row, stream in enumerate(batch):
            if requests[row].cancelled.is_set():
                self.cancelled += 1
            elif not finished[row]:
                # The engine ended without closing this row: treat what it gave as complete.
                self._post(loop, stream._finish, None)
                self.completed += 1

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None],
              arg: object) -> None:
        """Hand ``fn(arg)`` to the event loop. Posts coalesce: a batch step's chunks for
        every row cost one loop wake-up (one self-pipe write), not one per row."""
        with self._posts_lock:
            self._posts.append((fn, arg))
            if self._posts_scheduled:
                return
            self._posts_scheduled = True
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._posts_lock:
            posts, self._posts = self._posts, []
            self._posts_scheduled = False
        for fn, arg in posts:
            fn(arg)


class _Run:
    """The requests of one continuous batch, shared by the loop and the device thread."""

    def __init__(self, first: list[RequestStream]) -> None:
        self.pending = list(first)  # handed to the engine at its first admit
        self.streams: dict[int, RequestStream] = {}  # id(request) -> stream, while running
        self.closed = False
