"""The synthesis service: engines, schedulers, phrase cache, load governor and counters.

Every protocol front-end (:mod:`rtts.api`) holds one :class:`Service` and asks it for
audio; none of them talks to the cache or the scheduler itself. The one path from text to
audio is :meth:`Service.open_segment` (cache hit, else a scheduler request) and
:meth:`Service.segment_recorder` (store what was made); :class:`~rtts.core.context.SpeechContext`
builds feed/flush/end/cancel contexts on top of it.

**Engines per voice.** A service may run several engines side by side (ChatTTS and piper),
each with its own scheduler and device thread pool. The first is the primary
(:attr:`Service.engine`, the default for any voice); an engine with a ``voice_prefix``
(piper: ``piper:``) takes the voices that start with it, and its named voices are
registered in the voice store with their engine. Every engine outputs at the primary's
sample rate, so contexts and front-ends see one rate.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt
import psutil

from rtts import __version__
from rtts.audio.decode import ClipError, decode_clip
from rtts.config import ServerConfig
from rtts.core.cache import CachedStream, PhraseCache
from rtts.core.context import SpeechContext
from rtts.core.governor import Governor, GovernorConfig, Level, LoadSignals
from rtts.core.params import MAX_SAMPLE_SECONDS, SpeakerSample, SynthParams
from rtts.core.scheduler import BACKGROUND, RequestStream, Scheduler, SchedulerConfig
from rtts.core.usage import Usage, UsageFlusher
from rtts.core.voices import Voice, VoiceStore
from rtts.engines import build_engines
from rtts.engines.base import Engine, SampleEngine, SynthRequest
from rtts.engines.threads import run_in_own_thread
from rtts.errors import ErrorCode, ProtocolError, RttsError

__all__ = ["MAX_CLIP_BYTES", "TRIM_EVERY_S", "Recent", "SegmentRecorder", "Service", "Source",
           "Stats", "trim_heap"]

logger = logging.getLogger("rtts.core")

MAX_CLIP_BYTES = 8 * 2**20  # an uploaded reference clip, before decoding

Source = RequestStream | CachedStream


class State(StrEnum):
    """Where a server is in its life: ``/readyz``, ``/v1/info``, ``rtts_up{state}``."""

    LOADING = "loading"  # listening, the engine loading: /readyz 503
    READY = "ready"
    FAILED = "failed"  # the engine did not load: /readyz 503 with the reason
    DRAINING = "draining"  # shutting down: in-flight work finishes, new work gets 503
    STOPPED = "stopped"


class Recent:
    """The last ``capacity`` float samples, in one array allocated up front.

    A ``deque`` of Python floats did this before; its floats were made all through a busy
    minute among that minute's short-lived objects, so each one kept a block of Python's
    allocator alive after the rest was freed, and RSS after a round of the mixed-abuse
    load (tests/test_abuse.py) was 87-108 MB from one round to the next."""

    def __init__(self, capacity: int) -> None:
        self._values = np.zeros(capacity, dtype=np.float64)
        self._count = 0  # appended, ever

    def append(self, value: float) -> None:
        self._values[self._count % len(self._values)] = value
        self._count += 1

    def __len__(self) -> int:
        return min(self._count, len(self._values))

    def values(self) -> list[float]:
        """Oldest first."""
        n, cap = len(self), len(self._values)
        start = self._count % cap if self._count > cap else 0
        return [*self._values[start:n].tolist(), *self._values[:start].tolist()]

    def __iter__(self) -> Iterator[float]:
        return iter(self.values())


@dataclass
class Stats:
    connections_total: int = 0
    contexts_total: int = 0
    segments_total: int = 0
    segment_errors: int = 0
    cancels: int = 0
    protocol_errors: int = 0
    rejected: int = 0
    # refusals by reason: unauthorized, forbidden_origin, quota, client_connections
    auth_rejected_by: Counter[str] = field(default_factory=Counter)
    idle_closed: int = 0  # WebSockets closed by the idle timeout
    frames_sent: int = 0
    http_requests: int = 0
    ttfa_s: Recent = field(default_factory=lambda: Recent(1024))  # the last ones
    # time to first audio and audio seconds per engine (every context's, whatever protocol
    # it came in by); the totals are their sums
    ttfa_by_engine: dict[str, Recent] = field(default_factory=dict)
    ttfa_count_by_engine: Counter[str] = field(default_factory=Counter)
    audio_seconds_by_engine: dict[str, float] = field(default_factory=dict)
    # engine output -> frame handed to the socket, per live frame (server-added latency)
    frame_latency_s: Recent = field(default_factory=lambda: Recent(20000))

    def record_ttfa(self, engine: str, seconds: float) -> None:
        """A live context's first audio exists ``seconds`` after its request was made."""
        self.ttfa_s.append(seconds)
        self.ttfa_by_engine.setdefault(engine, Recent(1024)).append(seconds)
        self.ttfa_count_by_engine[engine] += 1

    def record_audio(self, engine: str, seconds: float) -> None:
        """A live context's segment of ``seconds`` was delivered (to its front-end)."""
        self.audio_seconds_by_engine[engine] = self.audio_seconds_by_engine.get(engine, 0.0) \
            + seconds

    @property
    def ttfa_count(self) -> int:
        return sum(self.ttfa_count_by_engine.values())

    @property
    def audio_seconds_sent(self) -> float:
        return sum(self.audio_seconds_by_engine.values())

    @property
    def auth_rejected(self) -> int:
        """Refusals by key, token, origin or quota (not by the connection caps)."""
        return sum(n for reason, n in self.auth_rejected_by.items()
                   if reason != "client_connections")


class SegmentRecorder:
    """Collects one segment's engine audio and stores it in the phrase cache at the end
    (unless it was cancelled, failed, or grew past the cache's entry limit)."""

    def __init__(self, service: Service, key: str | None) -> None:
        self._cache = service.cache
        self._key = key
        self._parts: list[npt.NDArray[np.float32]] | None = [] if key is not None else None
        self._samples = 0

    def add(self, samples: npt.NDArray[np.float32]) -> None:
        if self._parts is None:
            return
        self._samples += len(samples)
        if self._samples > self._cache.max_entry_samples:
            self._parts = None  # too long to store
        else:
            self._parts.append(samples)

    def commit(self, stream: Source) -> None:
        if not self._parts or self._key is None:
            return
        if isinstance(stream, RequestStream) and stream.request.cancelled.is_set():
            return
        self._cache.put(self._key, np.concatenate(self._parts))
        if isinstance(stream, RequestStream) and stream.request.produced is not None \
                and stream.request.produced.frames:
            self._cache.put_sample(self._key, stream.request.produced)


class Service:
    """Owns the engine, the scheduler, the cache and the server state (loading/ready/...)."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None,
                 own_engine: bool = True) -> None:
        self.config = config
        self.own_engine = own_engine  # close the engine at shutdown
        engines = build_engines(config.engine, engine)
        self.engine: Engine = engines[0]  # the primary: every voice no other engine claims
        self.engines: dict[str, Engine] = {e.name: e for e in engines}
        # engines this service closes at shutdown (one passed in is the caller's unless
        # own_engine; the ones built here are always ours)
        self._owned = [e for e in engines if e is not engine or own_engine]
        self.schedulers: dict[str, Scheduler] = {
            e.name: Scheduler(e, _scheduler_config(e, config.scheduler)) for e in engines}
        self.scheduler = self.schedulers[self.engine.name]
        self.state = State.LOADING
        self.state_reason = "model loading"
        self.stats = Stats()
        self.usage = Usage()  # per key, every protocol (rtts.core.usage)
        # shared through the Redis the instance already uses (phrase cache, else jobs)
        usage_redis = config.cache.redis_url or config.jobs.redis_url
        self.usage_flusher = (UsageFlusher(self.usage, usage_redis)
                              if usage_redis is not None else None)
        self.speaking = 0  # live contexts whose events are being played, every protocol
        self.started_at = time.monotonic()
        self.activity = asyncio.Event()  # set when a context or connection ends (for drain)
        self.governor = Governor(_scaled_governor(config))
        self._sampler: asyncio.Task[None] | None = None
        self._process = psutil.Process()
        self._used_since_trim = False  # busy since the heap was last trimmed (idle_trim)
        self._trimmed_at = float("-inf")
        self.cache = PhraseCache(config.cache, self.engine.name, self.engine.sample_rate)
        self.voices = VoiceStore(config.voices_dir, max_per_owner=config.max_voices_per_key)
        self.voices.default_engine = self.engine.name
        self._clip_slots = asyncio.Semaphore(2)  # clips decoded and encoded at once
        for e in engines:
            info = e.info
            if info.voice_prefix is not None:
                for name in info.voices:
                    self.voices.add_engine_voice(Voice(name, builtin=True, engine=e.name,
                                                       target=info.voice_prefix + name))

    # -- lifecycle -------------------------------------------------------------------

    async def load(self) -> None:
        """Load and warm up the engine off the event loop; /readyz turns 200 after this."""
        t0 = time.monotonic()
        try:
            # in threads that end with the call (rtts.engines.threads: a thread that stays
            # alive after torch work slows every later decode step)
            for engine in self.engines.values():
                await run_in_own_thread(engine.load, name="rtts-load")
            self.state_reason = "warming up"
            for engine in self.engines.values():
                await run_in_own_thread(engine.warmup, name="rtts-warmup")
            if self.config.freeze_gc:
                # Everything alive now (modules, the model) lives as long as the process:
                # take it out of the collector's sight, before the first client, so full
                # collections walk only per-session objects.
                gc.collect()
                gc.freeze()
        except Exception as exc:
            self.state = State.FAILED
            self.state_reason = f"model load failed: {type(exc).__name__}: {exc}"
            if getattr(exc, "expected", False):  # the machine's state (offline…): one line
                logger.error("engine %s failed to load: %s", self.engine.name, exc)
            else:
                logger.exception("engine %s failed to load", self.engine.name)
            raise
        await self.start_serving()
        logger.info("engine %s ready on %s in %.1fs",
                    " + ".join(self.engines), self.engine.info.device, time.monotonic() - t0)

    async def start_serving(self) -> None:
        """With a loaded engine: start the scheduler and the governor; /readyz turns 200."""
        for scheduler in self.schedulers.values():
            await scheduler.start()
        # Known only once loaded (the weights' identity names the cache namespace).
        self.cache.engine_id = "+".join(getattr(e, "identity", e.name)
                                        for e in self.engines.values())
        await self.cache.start()
        if self.usage_flusher is not None:
            await self.usage_flusher.start()
        self._sampler = asyncio.create_task(self._sample_load(), name="rtts-governor")
        if self.state != State.DRAINING:  # a drain asked for while loading stays
            self.state, self.state_reason = State.READY, "ready"

    async def stop_sampling(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
            self._sampler = None

    async def stop_core(self) -> None:
        """Stop the scheduler and the cache, and close the engine if we own it."""
        await self.stop_sampling()
        for scheduler in self.schedulers.values():
            await scheduler.stop()
        await self.cache.close()
        if self.usage_flusher is not None:
            await self.usage_flusher.close()
        for engine in self._owned:
            await asyncio.to_thread(engine.close)

    # -- load governor -----------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self.governor.level >= Level.DEGRADED

    @property
    def rejecting(self) -> bool:
        return self.governor.level >= Level.REJECTING

    def load_signals(self) -> LoadSignals:
        gpu = 0.0
        if self.engine.info.device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info()
            gpu = 1.0 - free / total
        # the real-time capacity the primary engine measured from its own steps (ChatTTS
        # on a CPU; None for engines that do not say, 0 while nothing is real time)
        cap = (self.engine.info.kernels or {}).get("realtime_streams")
        scheduler = self.scheduler
        scheduler.realtime_slots = int(cap) if cap else None
        over = max(0, scheduler.live_streams - int(cap)) if cap else 0
        return LoadSignals(
            queue_depth=sum(s.queue_depth for s in self.schedulers.values()),
            rss_mb=self._process.memory_info().rss / 2**20,
            cpu_percent=psutil.cpu_percent(None),
            gpu_mem_fraction=gpu,
            streams_over_capacity=over,
        )

    async def _sample_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.governor.interval_s)
            before = self.governor.level
            level = self.governor.update(self.load_signals(), time.monotonic())
            if level != before:
                self.apply_level(level)
            await self.idle_trim(time.monotonic())

    async def idle_trim(self, now: float) -> bool:
        """Once the server is idle after being busy (no connection, no context), and at most
        every :data:`TRIM_EVERY_S`: give the heap's free pages back to the system
        (:func:`trim_heap`, in a thread; its garbage collection holds the GIL for some
        milliseconds, while nothing is connected). What a burst freed otherwise stays in the
        process as scattered free chunks, and RSS kept the burst's high-water mark: after
        each minute of the mixed-abuse load (tests/test_abuse.py) it sat 0.5-7% higher.
        True when it trimmed."""
        if self.active_connections() or self.speaking:
            self._used_since_trim = True
            return False
        if not self._used_since_trim or now - self._trimmed_at < TRIM_EVERY_S:
            return False
        self._used_since_trim = False
        self._trimmed_at = now
        return await asyncio.to_thread(trim_heap)

    def apply_level(self, level: Level) -> None:
        """Propagate a governor level to the scheduler (front-ends extend this)."""
        for scheduler in self.schedulers.values():
            scheduler.degraded = level >= Level.DEGRADED

    # -- gauges that front-ends report (metrics reads these) ---------------------------

    def active_connections(self) -> int:
        return 0

    def connections_by_protocol(self) -> dict[str, int]:
        return {}

    def active_contexts(self) -> int:
        return 0

    def start_drain(self) -> None:
        """Begin a graceful drain (the admin API's; the server adds its front-ends): new
        work is refused, open work finishes."""
        self.state, self.state_reason = State.DRAINING, "draining: shutting down"

    def sessions_left(self) -> int:
        """What a drain waits for: busy sessions (the server counts every front-end's)."""
        return self.speaking

    def anchor_fits(self, engine: Engine) -> bool:
        """Whether a new context on ``engine`` anchors by default (``anchor`` unset): unless
        the engine's measured real-time capacity does not cover one more stream than speak
        now. Anchoring makes a later segment wait for the first one's generation and
        prefill its codes, which an engine behind real time pays as silence: on the 2-core
        Xeon, int4, full size, silence per second of audio went 0.20 -> 0.38 at 1 stream
        and 1.24 -> 1.71 at 4 (docs/voices.md). Unmeasured (the fake engine, ChatTTS before
        its first timed steps): anchor."""
        kernels = engine.info.kernels or {}
        measured = kernels.get("realtime_streams")
        if isinstance(measured, int | float) and kernels.get("step_ms"):
            return int(measured) >= self.speaking + 1
        return True

    def capacity(self) -> tuple[int, str]:
        """The streams this instance can speak at once, and where the figure comes from:
        per engine, the real-time streams its decode steps measure (``measured``: ChatTTS
        once steps have been timed; it may be 0: not even one stream keeps up), else its
        scheduler's slots times its concurrency (``slots``: fake, piper, ChatTTS before
        its first steps). Summed over the engines."""
        total, sources = 0, set()
        for name, engine in self.engines.items():
            kernels = engine.info.kernels or {}
            measured = kernels.get("realtime_streams")
            if isinstance(measured, int | float) and kernels.get("step_ms"):
                total += int(measured)
                sources.add("measured")
            else:
                sch = self.schedulers[name]
                total += sch.slot_limit * max(1, sch.config.concurrency)
                sources.add("slots")
        return total, "+".join(sorted(sources))

    def job_counters(self) -> dict[str, float]:
        """This instance's job worker's counters (none without a worker)."""
        return {}

    def active_http_requests(self) -> int:
        """HTTP requests being answered (a streamed speech body counts until it ends)."""
        return 0

    # -- synthesis ---------------------------------------------------------------------

    def engine_for(self, params: SynthParams) -> Engine:
        """The engine that speaks ``params.voice`` (already resolved from a name): the one
        whose ``voice_prefix`` it starts with, else the primary."""
        voice = params.voice
        if voice is not None and len(self.engines) > 1:
            for engine in self.engines.values():
                prefix = engine.info.voice_prefix
                if prefix is not None and voice.startswith(prefix):
                    return engine
        return self.engine

    def validate_params(self, params: SynthParams, owner: str | None = None) -> None:
        """Reject params the engine cannot use (e.g. a malformed voice) before queueing.
        A named voice is checked as what it resolves to for ``owner`` (the key's owner id,
        :meth:`VoiceStore.apply`)."""
        params = self.voices.apply(params, owner)
        try:
            self.engine_for(params).validate(params)
        except ValueError as exc:
            raise ProtocolError(str(exc), code=ErrorCode.INVALID_PARAMS) from None

    def check_admission(self) -> None:
        """Raise ``Overloaded``-coded :class:`ProtocolError` while the governor rejects."""
        if self.rejecting:
            self.stats.rejected += 1
            raise ProtocolError("server overloaded; retry later", code=ErrorCode.OVERLOADED)

    def stream_ended(self, stream: int) -> None:
        """A context ended (done or cancelled): the schedulers stop holding its slot."""
        for scheduler in self.schedulers.values():
            scheduler.stream_ended(stream)

    async def open_segment(self, text: str, params: SynthParams, *, first: bool,
                           use_cache: bool = True, background: bool = False,
                           stream: int | None = None
                           ) -> tuple[Source | RttsError, str | None]:
        """The audio source for one segment: a cache hit, else a scheduler request (or the
        error submitting it). Returns the cache key to store the result under (None for a
        hit or when the cache is not used). ``background``: the scheduler's lowest,
        preemptible priority (long-text jobs). ``stream``: the context it belongs to (the
        scheduler keeps a playing stream's slot while held at the real-time capacity)."""
        degraded = self.degraded
        key = self.cache.key(text, params, degraded) if use_cache else None
        if key is not None and (hit := await self.cache.get(key)) is not None:
            return CachedStream(hit, self.cache.sample(key)), None
        priority = BACKGROUND if background else 0 if first else 1
        request = SynthRequest(text, params, priority=priority, degraded=degraded,
                               stream=stream)
        try:
            return self.schedulers[self.engine_for(params).name].submit(request), key
        except RttsError as exc:
            return exc, None

    async def sample_from_clip(self, data: bytes, transcript: str) -> SpeakerSample:
        """A voice sample from an uploaded clip: decoded (any format PyAV reads, bounded to
        :data:`MAX_CLIP_BYTES` and :data:`~rtts.core.params.MAX_SAMPLE_SECONDS`), resampled
        to the engine's rate and encoded by the engine (ChatTTS: its DVAE encoder), all
        off the event loop. :class:`VoiceError` (400) for audio it cannot use."""
        from rtts.core.voices import VoiceError

        engine = self.engine
        if not engine.info.samples or not isinstance(engine, SampleEngine):
            raise VoiceError(f"the {engine.name} engine cannot make voices from audio",
                             param="audio")
        async with self._clip_slots:
            try:
                audio = await asyncio.to_thread(
                    decode_clip, data, rate=engine.sample_rate,
                    max_seconds=MAX_SAMPLE_SECONDS, max_bytes=MAX_CLIP_BYTES)
                if audio.size < engine.sample_rate // 2:
                    raise ClipError("the clip is shorter than 0.5 s")
                return await run_in_own_thread(engine.encode_sample, audio, transcript,
                                               name="rtts-encode")
            except ValueError as exc:  # ClipError, or the engine's refusal
                raise VoiceError(f"audio: {exc}", param="audio") from None

    def segment_recorder(self, key: str | None) -> SegmentRecorder:
        return SegmentRecorder(self, key)

    @property
    def engine_name(self) -> str:
        """The primary engine's name (the ready event, /v1/info)."""
        return self.engine.name

    @property
    def sample_rate(self) -> int:
        """The rate of every engine's audio here (the primary's; the others resample)."""
        return self.engine.sample_rate

    def open_context(self, params: SynthParams, *, owner: str | None = None,
                     account: str | None = None, **options: Any) -> SpeechContext:
        """A new :class:`~rtts.core.context.SpeechContext` on this service, with the
        server's ``lookahead`` and ``max_chunk_chars`` unless ``options`` say otherwise.
        The one place a named voice resolves (:meth:`VoiceStore.apply`, among the voices
        of ``owner``, the key's owner id, and the shared ones): once per context, so every
        segment of it uses the same speaker and params (and the cache keys them by the
        speaker), whatever happens to the name meanwhile. Usage counts under ``account``
        (the key's owner id; by default ``owner``; None: anonymous)."""
        options.setdefault("lookahead", self.config.lookahead_segments)
        options["account"] = account if account is not None else owner
        options.setdefault("max_chunk_chars", self.config.limits.default_max_chunk_chars)
        return SpeechContext(self, self.voices.apply(params, owner), **options)

    def weights(self) -> dict[str, str]:
        """Which weights the engine serves: ``kind`` (``real``, ``random``; ``none`` for an
        engine without weights), ``source`` and ``identity`` (/v1/info, ready, /metrics)."""
        return {k: str(v) for k, v in self.engine.info.weights.items()}

    def info(self) -> dict[str, Any]:
        engine = self.engine.info
        return {"server": "rtts", "version": __version__, "engine": engine.name,
                "weights": self.weights(),
                "device": engine.device, "engine_sample_rate": engine.sample_rate,
                "state": str(self.state), "ws_path": self.config.ws_path,
                "random_weights": engine.random_weights,
                "instance": self.config.instance_id,
                "cache": {"memory_mb": self.config.cache.memory_mb,
                          "redis": self.config.cache.redis_url is not None},
                "batching": {"mode": "continuous" if self.scheduler.continuous else "static",
                             "slots": self.scheduler.slot_limit,
                             "first_segment_slots": self.scheduler.reserve},
                "kernels": None if engine.kernels is None else dict(engine.kernels),
                "engines": [_describe(e, self.schedulers[e.name], e is self.engine)
                            for e in self.engines.values()]}


TRIM_EVERY_S = 10.0


def trim_heap() -> bool:
    """A full garbage collection, then glibc's ``malloc_trim(0)``: the free pages anywhere
    in malloc's heaps go back to the system (ctypes lets the GIL go meanwhile). The
    collection first: what a burst left in reference cycles (an error's traceback and its
    frames) is otherwise freed only by the next full collection, which may come long after
    the burst, and RSS then kept it (the long mixed-abuse run once ended 6.3% above its
    warmed-up figure). False where there is no ``malloc_trim`` (not glibc)."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _scaled_governor(config: ServerConfig) -> GovernorConfig:
    """Queue-depth thresholds are per 4 batch rows: a bigger batch absorbs a deeper queue."""
    g = config.governor
    scale = max(1.0, config.scheduler.max_batch_size / 4)
    return replace(
        g,
        degrade_queue_depth=None if g.degrade_queue_depth is None
        else int(g.degrade_queue_depth * scale),
        reject_queue_depth=None if g.reject_queue_depth is None
        else int(g.reject_queue_depth * scale),
    )


def _scheduler_config(engine: Engine, base: SchedulerConfig) -> SchedulerConfig:
    """An engine may shape its own scheduler (piper: batches of one, a worker per core)."""
    info = engine.info
    return replace(
        base,
        batching=base.batching if info.batching is None else info.batching,
        max_batch_size=base.max_batch_size if info.max_batch_size is None
        else info.max_batch_size,
        concurrency=base.concurrency if info.concurrency is None else info.concurrency,
        max_wait_ms=base.max_wait_ms if info.max_wait_ms is None else info.max_wait_ms)


def _describe(engine: Engine, scheduler: Scheduler, primary: bool) -> dict[str, Any]:
    """One engine in ``/v1/info``: which voices it takes, its rate, its scheduler."""
    info = engine.info
    out: dict[str, Any] = {
        "name": info.name, "device": info.device, "primary": primary,
        "takes": "any voice no other engine takes" if primary
        else f"{info.voice_prefix or ''}NAME",
        "batching": {"mode": "continuous" if scheduler.continuous else "static",
                     "slots": scheduler.slot_limit,
                     "concurrency": scheduler.config.concurrency}}
    out.update(info.details)
    return out
