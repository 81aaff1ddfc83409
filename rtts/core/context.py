"""One speech context on the core: feed text, flush, end, cancel; iterate segment events.

The request/response front-ends (REST, OpenAI) use this directly::

    ctx = service.open_context(params)
    ctx.feed(text)
    ctx.end()
    async for event in ctx.events():
        ...  # SegmentStarted, Audio, SegmentDone / SegmentFailed, then Done

Audio is float32 mono at the engine's sample rate, yielded as soon as the engine (or the
cache) produces it; up to ``lookahead`` segments are submitted ahead of the one playing.
Leaving the ``async for`` early (or :meth:`SpeechContext.cancel`) cancels the in-flight
requests, which frees their batch rows.

**Speaker anchoring** (``params.anchor``; when unset, where the engine has real-time
headroom: :meth:`Service.anchor_fits`; for an engine with samples): once the context's
first generated segment ends, every later segment is conditioned on that segment's codes
and text (its :attr:`~rtts.core.params.SynthParams.sample`, bounded to
:data:`ANCHOR_SECONDS`), ChatTTS's own long-text recipe, so the voice holds across
segments. Until then no later segment is submitted (the lookahead waits for the anchor).
A voice that has its own sample is conditioned on it throughout, and needs no anchor.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from rtts.core.cache import CachedStream
from rtts.core.params import MAX_SAMPLE_SECONDS, SpeakerSample, SynthParams, trim_sample
from rtts.core.scheduler import RequestStream
from rtts.errors import RttsError
from rtts.text import SpokenText
from rtts.text.segmenter import DEFAULT_MAX_CHARS, DEFAULT_SCHEDULE, Chunk, Segmenter
from rtts.text.ssml import Piece, speed_for
from rtts.text.timings import CharTimings, estimate

if TYPE_CHECKING:
    from rtts.core.service import Service, Source

__all__ = ["ANCHOR_SECONDS", "Audio", "Done", "Event", "SegmentDone", "SegmentFailed",
           "SegmentStarted", "SpeechContext"]

# the most of a context's first segment its later segments are conditioned on
ANCHOR_SECONDS: Final = MAX_SAMPLE_SECONDS
_INLINE_CHARS = 64  # chunks up to this long are normalized on the loop (well under 1 ms)


@dataclass(frozen=True, slots=True)
class SegmentStarted:
    index: int
    text: str  # as written (``start``/``end`` index the context's input)
    start: int  # character offsets of the segment in the context's input
    end: int
    cached: bool
    ready: bool = False  # its audio (or its end) is already here: nothing is late
    submitted_at: float = 0.0  # monotonic time its request was made (for time to first audio)
    spoken: str = ""  # what is synthesized for ``text`` (normalized: numbers as words, ...)


@dataclass(frozen=True, slots=True)
class Audio:
    index: int
    samples: npt.NDArray[np.float32]  # at the engine's sample rate
    produced_at: float  # monotonic time the engine produced it (0 for cached audio)


@dataclass(frozen=True, slots=True)
class SegmentDone:
    index: int
    samples: int  # engine-rate samples in the segment
    # estimated character timings of the segment's written text, ms from the segment's start
    timings: CharTimings = CharTimings((), (), ())


@dataclass(frozen=True, slots=True)
class SegmentFailed:
    index: int
    error: RttsError


@dataclass(frozen=True, slots=True)
class Done:
    segments: int
    samples: int  # engine-rate samples in the whole context
    failed: int


Event = SegmentStarted | Audio | SegmentDone | SegmentFailed | Done


class SpeechContext:
    """Text in, segment events out, on one :class:`~rtts.core.service.Service`."""

    def __init__(self, service: Service, params: SynthParams, *,
                 schedule: tuple[int, ...] = DEFAULT_SCHEDULE,
                 max_chunk_chars: int = DEFAULT_MAX_CHARS,
                 lookahead: int = 2, use_cache: bool = True, normalize: bool = True,
                 background: bool = False, account: str | None = None) -> None:
        self.service = service
        self.params = params
        self.sample_rate = service.engine.sample_rate
        self._schedule = schedule
        self._max_chunk_chars = max_chunk_chars
        self._segmenter: Segmenter | None = None  # made on first feed (add_segment needs none)
        self.lookahead = max(1, lookahead)
        self.use_cache = use_cache
        self.background = background  # lowest priority, preemptible (job segments)
        self._spoken_text = SpokenText(enabled=normalize)  # chunk -> spoken, in order
        # (spoken None: normalized when it is submitted, off the event loop; params: the
        # context's, or with the speed of an SSML prosody rate)
        self._pending: deque[tuple[int, Chunk, str | None, SynthParams]] = deque()
        self._params = params  # of the text being fed now
        self._inflight: deque[tuple[int, Chunk, str, Source | RttsError, str | None]] = deque()
        self._next_index = 0
        self._ended = False
        self._cancelled = False
        self.finished = False  # Done was yielded
        self._wakeup = asyncio.Event()
        engine = service.engine_for(params)
        self.engine = engine.name  # who speaks it (metrics per engine)
        # speaker anchoring (see the module doc): the sample later segments carry
        anchor = params.anchor if params.anchor is not None else service.anchor_fits(engine)
        self.anchoring = anchor and params.sample is None and engine.info.samples
        self.anchor: SpeakerSample | None = None
        self._anchor_source: RequestStream | None = None  # the segment it will come from
        self._submitting = asyncio.Lock()  # one submitter at a time: segments stay in order
        self._kick: asyncio.Task[None] | None = None  # submits once the anchor exists
        service.stats.contexts_total += 1
        # usage per key (rtts.core.usage): the key's owner id, None = anonymous; job
        # contexts (background) are not counted
        self.account = account
        self._counted_to = 0  # input characters counted so far (offsets of the input)
        self._usage = None if background else service.usage
        if self._usage is not None:
            self._usage.context(account)

    # -- input -------------------------------------------------------------------------

    def feed(self, text: str, speed: int | None = None) -> None:
        """More input text (any size piece); complete segments are queued at once.

        ``speed`` (0..9, e.g. from an SSML ``<prosody rate>``) is the speed this text is
        said at, else the context's own: where it changes, what is buffered is queued
        first, so no segment spans two speeds."""
        if self._segmenter is None:
            self._segmenter = Segmenter(self._schedule, self._max_chunk_chars)
        wanted = self.params if speed is None else replace(self.params, speed=speed)
        if wanted != self._params:
            self.flush()
            self._params = wanted
        self._queue(self._segmenter.push(text))

    def feed_pieces(self, pieces: Iterable[Piece]) -> None:
        """Text read from SSML (:mod:`rtts.text.ssml`): each piece at the speed its prosody
        rate gives around the context's own speed."""
        for piece in pieces:
            self.feed(piece.text, None if piece.rate == 1.0
                      else speed_for(piece.rate, self.params.speed))

    def flush(self) -> None:
        """Queue whatever is buffered, without waiting for punctuation."""
        if self._segmenter is not None:
            self._queue(self._segmenter.flush())

    def end(self) -> None:
        """No more text: the events end with :class:`Done` after the last segment."""
        self.flush()
        self._ended = True
        self._wakeup.set()

    def add_segment(self, chunk: Chunk, spoken: str | None = None,
                    speed: int | None = None) -> None:
        """Queue a segment the caller cut itself (the native protocol's session does its own
        segmentation, timers included, and its own normalization: ``spoken``); its index is
        the next one. ``speed``: as in :meth:`feed`."""
        self._queue([chunk], spoken,
                    self.params if speed is None else replace(self.params, speed=speed))

    def cancel(self) -> None:
        """Stop now: in-flight requests are cancelled and :meth:`events` returns. Counted
        in ``stats.cancels`` unless the context had finished."""
        if not self._cancelled and not self.finished:
            self.service.stats.cancels += 1
        self.close()

    def close(self) -> None:
        """Like :meth:`cancel`, for a caller that counts its own cancels (or none)."""
        self._cancelled = True
        self._release()
        self.service.stream_ended(id(self))
        self._wakeup.set()

    def _queue(self, chunks: list[Chunk], spoken: str | None = None,
               params: SynthParams | None = None) -> None:
        for chunk in chunks:
            self._pending.append((self._next_index, chunk, spoken, params or self._params))
            self._next_index += 1
        if chunks:
            if self._usage is not None:
                # the input up to the end of the last segment, as written: what the client
                # sent, the whitespace between segments included, trailing space not
                end = max(c.end for c in chunks)
                if end > self._counted_to:
                    self._usage.characters(self.account, end - self._counted_to)
                    self._counted_to = end
            self._wakeup.set()

    def _release(self) -> None:
        if self._anchor_source is not None:
            self._anchor_source.on_finish = None  # cancelled below: nothing to submit after
            self._anchor_source = None
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None
        for _, _, _, source, _ in self._inflight:
            if not isinstance(source, RttsError):
                source.cancel()
        self._inflight.clear()
        self._pending.clear()

    # -- output ------------------------------------------------------------------------

    async def _submit_ahead(self) -> None:
        async with self._submitting:
            await self._submit_locked()

    def _anchor_finished(self) -> None:
        """The anchor's source segment ended (on the loop): submit what waited for it now,
        not when the consumer next reads (it may be pacing the first segment's audio)."""
        if self._cancelled or (self._kick is not None and not self._kick.done()):
            return
        self._kick = asyncio.get_running_loop().create_task(
            self._submit_kicked(), name="rtts-context-anchor")

    async def _submit_kicked(self) -> None:
        await self._submit_ahead()
        self._wakeup.set()

    async def _submit_locked(self) -> None:
        while self._pending and len(self._inflight) < self.lookahead and not self._cancelled:
            if not self._anchor_ready():
                return
            index, chunk, say, params = self._pending.popleft()
            spoken = say if say is not None else await self._speak(chunk.text)
            if self._cancelled:
                return
            if self.anchor is not None:
                params = replace(params, sample=self.anchor)
            # The spoken text is what is synthesized and what the phrase cache is keyed on.
            source, key = await self.service.open_segment(
                spoken, params, first=index == 0, use_cache=self.use_cache,
                background=self.background, stream=id(self))
            if self.anchoring and self.anchor is None:
                if isinstance(source, RequestStream):
                    self._anchor_source = source
                    source.on_finish = self._anchor_finished
                elif isinstance(source, CachedStream) and source.sample is not None:
                    self.anchor = trim_sample(source.sample, ANCHOR_SECONDS)
            self._inflight.append((index, chunk, spoken, source, key))

    def _anchor_ready(self) -> bool:
        """False while a later segment must wait for the anchor: its source segment is
        still being generated. Takes the anchor when that segment has ended; a segment
        that failed or was cancelled leaves none (the next generated one is the source)."""
        source = self._anchor_source
        if source is None:
            return True
        if not source.finished:
            # Under load (the governor degraded) a later segment does not wait: the wait
            # is silence when the engine is behind real time. It goes unanchored, as refine
            # is skipped then; segments after the anchor exists still carry it.
            return self.service.degraded
        self._anchor_source = None
        produced = source.request.produced
        if not source.request.cancelled.is_set() and produced is not None \
                and produced.frames > 0 and produced.text:
            self.anchor = trim_sample(produced, ANCHOR_SECONDS)
        return True

    async def _speak(self, text: str) -> str:
        """The spoken form of the next chunk (in order: it carries the language so far).
        Normalizing costs a few microseconds a character: a long chunk is normalized in a
        worker thread, so no client's text holds up the event loop (one chunk at a time
        per context, so one context never has more than one in the pool)."""
        if not self._spoken_text.enabled or len(text) <= _INLINE_CHARS:
            return self._spoken_text(text)
        return await asyncio.to_thread(self._spoken_text, text)

    async def events(self) -> AsyncGenerator[Event, None]:
        """Segment events in order until :class:`Done` (or the context is cancelled)."""
        stats = self.service.stats
        segments = samples_total = failed = 0
        # Time to first audio and audio seconds are recorded here, once for every protocol
        # (job contexts, in the background, are not live audio and count in neither).
        live = not self.background
        first_audio = live
        usage, account, rate = self._usage, self.account, self.sample_rate
        if live:
            self.service.speaking += 1  # streams speaking now, every protocol (capacity)
        try:
            while not self._cancelled:
                await self._submit_ahead()
                if not self._inflight:
                    if self._ended and not self._pending:
                        self.finished = True
                        self.service.stream_ended(id(self))
                        yield Done(segments, samples_total, failed)
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                index, chunk, spoken, source, key = self._inflight[0]
                stats.segments_total += 1
                segments += 1
                if isinstance(source, RttsError):
                    stats.segment_errors += 1
                    failed += 1
                    self._inflight.popleft()
                    yield SegmentFailed(index, source)
                    continue
                yield SegmentStarted(index, chunk.text, chunk.start, chunk.end,
                                     getattr(source, "cached", False), source.ready,
                                     source.submitted_at, spoken)
                recorder = self.service.segment_recorder(key)
                n = 0
                try:
                    async for samples in source:
                        recorder.add(samples)
                        await self._submit_ahead()
                        n += len(samples)
                        if first_audio:
                            first_audio = False
                            stats.record_ttfa(self.engine,
                                              time.monotonic() - source.submitted_at)
                        if usage is not None:
                            usage.audio(account, len(samples) / rate)
                        yield Audio(index, samples, source.produced_at)
                except RttsError as exc:
                    stats.segment_errors += 1
                    failed += 1
                    if self._inflight and self._inflight[0][3] is source:
                        self._inflight.popleft()
                    yield SegmentFailed(index, exc)
                    continue
                recorder.commit(source)
                if self._inflight and self._inflight[0][3] is source:
                    self._inflight.popleft()
                samples_total += n
                if live:
                    stats.record_audio(self.engine, n / self.sample_rate)
                yield SegmentDone(index, n, estimate(chunk.text, n * 1000 / self.sample_rate))
        finally:
            if live:
                self.service.speaking -= 1
            self._release()
