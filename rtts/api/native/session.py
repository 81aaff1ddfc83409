"""Per-connection protocol state machine, sans I/O.

The server feeds it parsed client messages and audio progress; it answers with
actions for the I/O layer to carry out. It owns each context's segmenter, numbering
and offsets, and enforces the per-connection limits. Nothing here awaits or sends.

Context lifecycle::

    start -> OPEN --text/flush--> OPEN --end--> ENDING --last segment done--> (done, removed)
               \\--cancel--> (cancelled, removed)

``playback`` reports (the client's real position in a context's audio) may arrive in any
state while the context is open, and are ignored for a context that finished recently
(they cross the ``done`` on the wire). On ``cancel`` the session answers with what was
heard: ``heard_ms`` and the input split into ``text_spoken`` / ``text_remaining`` at the
last heard character (estimated character timings of finished segments; a segment still
being made counts as not heard, since its length is not known yet).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rtts.api.native.protocol import (
    PROTOCOL_VERSION,
    CancelMessage,
    ClientMessage,
    EndMessage,
    FlushMessage,
    PlaybackMessage,
    StartMessage,
    TextMessage,
)
from rtts.core.params import SynthParams
from rtts.errors import ErrorCode, ProtocolError
from rtts.text import SpokenText
from rtts.text.segmenter import DEFAULT_MAX_CHARS, DEFAULT_SCHEDULE, Chunk, Segmenter
from rtts.text.ssml import Piece, SsmlError, SsmlReader, speed_for
from rtts.text.timings import CharTimings

__all__ = [
    "CancelContext",
    "ContextState",
    "Playback",
    "SendEvent",
    "Session",
    "SessionLimits",
    "StartContext",
    "Synthesize",
]


@dataclass(frozen=True)
class SessionLimits:
    max_contexts: int = 8
    max_text_chars_per_message: int = 20_000
    max_text_chars_per_context: int = 100_000
    # a context started with ssml: true reads each message on the event loop: bounded
    # (SSML may be split anywhere, so a client sends longer SSML in more messages)
    max_ssml_chars_per_message: int = 4000
    default_idle_flush_ms: int = 1500
    default_schedule: tuple[int, ...] = DEFAULT_SCHEDULE
    default_max_chunk_chars: int = DEFAULT_MAX_CHARS
    degraded_max_chunk_chars: int = 80  # shorter segments while the server is degraded
    # playback reports per context: a burst of this many, refilled at this rate per second
    playback_burst: int = 20
    playback_per_s: float = 20.0


# -- actions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendEvent:
    """Send this JSON event to the client."""

    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StartContext:
    """A context was opened: the I/O layer starts its audio pipeline."""

    context: ContextState


@dataclass(frozen=True, slots=True)
class Synthesize:
    """Synthesize segment ``index`` of a context; audio must be sent in index order.

    ``spoken`` is what to synthesize (and to key the phrase cache on): ``chunk.text`` with
    numbers, dates, money and symbols spelled out by :mod:`rtts.text`, or ``chunk.text``
    itself when the context was started with ``normalize: false``. The session always
    fills it; ``None`` (other constructors) means ``chunk.text``. ``speed``: the speed of
    an SSML ``<prosody rate>`` this segment is in (None: the context's own).
    """

    context_id: str
    index: int
    chunk: Chunk
    spoken: str | None = None
    speed: int | None = None


@dataclass(frozen=True, slots=True)
class CancelContext:
    """Stop the context's pipeline now and drop its undelivered audio."""

    context_id: str
    stream: int
    serial: int  # the context's never-reused number on this connection


@dataclass(frozen=True, slots=True)
class Playback:
    """The client reported its playback position: pace the context on it."""

    context_id: str
    played_ms: float


Action = SendEvent | StartContext | Synthesize | CancelContext | Playback


@dataclass(frozen=True, slots=True)
class _HeardSegment:
    """A finished segment's place in the context's audio and input text."""

    start_ms: float
    duration_ms: float
    text_start: int
    text_end: int
    timings: CharTimings | None  # ms from the segment's start


@dataclass
class ContextState:
    context_id: str
    stream: int  # the frame header's stream number: 1..65535, reused after wrapping
    params: SynthParams
    sample_rate: int
    segmenter: Segmenter
    idle_flush_ms: int
    segments_queued: int = 0
    segments_done: int = 0
    audio_samples: int = 0  # at sample_rate, of finished segments
    ended: bool = False
    serial: int = 0  # counts contexts on the connection; never wraps (unlike ``stream``)
    last_text_at: float = 0.0
    cache: bool = True
    format: str = "pcm16"  # of the binary frames (see rtts.audio.codecs)
    flush_marks: list[int] = field(default_factory=list)  # segment counts awaited by flushes
    normalize: bool = True
    # chunk text -> spoken text, in order (it carries the language of the text so far)
    spoken_text: SpokenText = field(default_factory=SpokenText)
    spoken: dict[int, str] = field(default_factory=dict)  # by segment, until it is done
    timings: bool = False  # character timings on segment_done
    # ssml: true: the reader of the context's SSML, and the speed of the text being cut
    ssml: SsmlReader | None = None
    speed: int | None = None
    # what heard text is computed from (bounded by max_text_chars_per_context)
    input: list[str] = field(default_factory=list)
    finished: list[_HeardSegment] = field(default_factory=list)
    played_ms: float | None = None  # reported by the client (playback messages)
    estimated_played_ms: float | None = None  # the server's estimate, set before a cancel
    playback_tokens: float = 0.0
    playback_at: float = 0.0

    @property
    def audio_ms(self) -> float:
        return 1000.0 * self.audio_samples / self.sample_rate


class Session:
    """State of one WebSocket connection."""

    def __init__(self, limits: SessionLimits | None = None, session_id: str = "", *,
                 normalize_later: bool = False) -> None:
        self.limits = limits or SessionLimits()
        self.session_id = session_id
        # True: Synthesize carries spoken=None and whoever synthesizes normalizes the chunks,
        # in order (the server does it off its event loop); segment_started is then told
        # the spoken text
        self.normalize_later = normalize_later
        self.contexts: dict[str, ContextState] = {}
        self._next_stream = 1
        self._serial = 0
        self.protocol_errors = 0
        self.degraded = False  # set by the server from its load governor
        # contexts that just finished: their in-flight playback reports are not errors
        self._recent: deque[str] = deque(maxlen=64)

    def hello(self, **info: Any) -> SendEvent:
        return SendEvent({"type": "ready", "protocol": PROTOCOL_VERSION,
                          "session_id": self.session_id, **info})

    def error(self, exc: ProtocolError | Exception, context_id: str | None = None,
              **extra: Any) -> SendEvent:
        code = getattr(exc, "code", ErrorCode.INVALID_MESSAGE)
        message = getattr(exc, "message", str(exc))
        event: dict[str, Any] = {"type": "error", "code": str(code), "message": message}
        if context_id is not None:
            event["context_id"] = context_id
        event.update(extra)
        return SendEvent(event)

    # -- client messages -----------------------------------------------------------

    def receive(self, msg: ClientMessage, now: float | None = None) -> list[Action]:
        """Apply one parsed client message. Raises :class:`ProtocolError` for misuse."""
        now = time.monotonic() if now is None else now
        if isinstance(msg, StartMessage):
            return self._start(msg, now)
        ctx = self.contexts.get(msg.context_id)
        if ctx is None:
            if isinstance(msg, PlaybackMessage) and msg.context_id in self._recent:
                return []  # crossed the context's done/cancelled on the wire
            raise ProtocolError(
                f"context {msg.context_id!r} is not open; send 'start' first",
                code=ErrorCode.UNKNOWN_CONTEXT,
            )
        if isinstance(msg, PlaybackMessage):
            return self._playback(ctx, msg, now)
        if isinstance(msg, CancelMessage):
            self._forget(ctx)
            return [CancelContext(ctx.context_id, ctx.stream, ctx.serial),
                    SendEvent({"type": "cancelled", "context_id": ctx.context_id,
                               **self.heard(ctx)})]
        if ctx.ended:
            raise ProtocolError(f"context {ctx.context_id!r} has ended; no more input",
                                code=ErrorCode.INVALID_MESSAGE)
        if isinstance(msg, TextMessage):
            total = ctx.segmenter.total_chars + len(msg.text)
            if total > self.limits.max_text_chars_per_context:
                raise ProtocolError(
                    f"context text limit is {self.limits.max_text_chars_per_context} characters",
                    code=ErrorCode.TEXT_TOO_LONG,
                )
            ctx.last_text_at = now
            if ctx.ssml is not None:
                if len(msg.text) > self.limits.max_ssml_chars_per_message:
                    raise ProtocolError(
                        f"SSML text messages are at most "
                        f"{self.limits.max_ssml_chars_per_message} characters; send longer "
                        "SSML in more messages (it may be split anywhere)",
                        code=ErrorCode.TEXT_TOO_LONG)
                try:
                    return self._pieces(ctx, ctx.ssml.feed(msg.text))
                except SsmlError as exc:
                    return self._bad_ssml(ctx, exc)
            return self._text(ctx, msg.text)
        if isinstance(msg, FlushMessage):
            actions = self._queue(ctx, ctx.segmenter.flush())
            ctx.flush_marks.append(ctx.segments_queued)
            return actions + self._check_marks(ctx)
        if isinstance(msg, EndMessage):
            actions = []
            if ctx.ssml is not None:
                try:
                    actions = self._pieces(ctx, ctx.ssml.end())
                except SsmlError as exc:
                    return self._bad_ssml(ctx, exc)
            actions += self._queue(ctx, ctx.segmenter.flush())
            ctx.ended = True
            return actions + self._check_marks(ctx)
        # SaveVoiceMessage is the connection's (it needs the core context), never here
        raise ProtocolError("unsupported message", code=ErrorCode.UNKNOWN_TYPE)  # pragma: no cover

    def _text(self, ctx: ContextState, text: str) -> list[Action]:
        ctx.input.append(text)
        if len(ctx.input) > 256:  # one-character messages: keep one string, not 100k
            ctx.input[:] = ["".join(ctx.input)]
        return self._queue(ctx, ctx.segmenter.push(text))

    def _pieces(self, ctx: ContextState, pieces: list[Piece]) -> list[Action]:
        """Text read from SSML: where the speed changes, what is buffered is cut first, so
        no segment spans two prosody rates. Offsets index the text the SSML reads out."""
        actions: list[Action] = []
        for piece in pieces:
            speed: int | None = speed_for(piece.rate, ctx.params.speed)
            if speed == ctx.params.speed:
                speed = None
            if speed != ctx.speed:
                actions += self._queue(ctx, ctx.segmenter.flush())
                ctx.speed = speed
            actions += self._text(ctx, piece.text)
        return actions

    def _bad_ssml(self, ctx: ContextState, exc: SsmlError) -> list[Action]:
        """Bad SSML: its reader cannot go on, so the context is closed (the connection and
        its other contexts go on; the id can be started again)."""
        self.protocol_errors += 1
        self._forget(ctx)
        error = ProtocolError(f"invalid SSML: {exc}", code=ErrorCode.INVALID_SSML)
        return [CancelContext(ctx.context_id, ctx.stream, ctx.serial),
                self.error(error, ctx.context_id, context_closed=True)]

    def _start(self, msg: StartMessage, now: float) -> list[Action]:
        if msg.context_id in self.contexts:
            raise ProtocolError(f"context {msg.context_id!r} is already open",
                                code=ErrorCode.CONTEXT_EXISTS)
        if len(self.contexts) >= self.limits.max_contexts:
            raise ProtocolError(
                f"at most {self.limits.max_contexts} open contexts per connection",
                code=ErrorCode.TOO_MANY_CONTEXTS,
            )
        max_chars = msg.max_chunk_chars or self.limits.default_max_chunk_chars
        if self.degraded:
            max_chars = min(max_chars, self.limits.degraded_max_chunk_chars)
        in_use = {c.stream for c in self.contexts.values()}
        while self._next_stream in in_use:  # after wrapping, skip numbers still open
            self._next_stream = self._next_stream % 65535 + 1
        self._serial += 1
        ctx = ContextState(
            context_id=msg.context_id,
            serial=self._serial,
            stream=self._next_stream,
            params=msg.params,
            sample_rate=msg.sample_rate,
            segmenter=Segmenter(msg.chunk_schedule or self.limits.default_schedule, max_chars),
            idle_flush_ms=(self.limits.default_idle_flush_ms if msg.idle_flush_ms is None
                           else msg.idle_flush_ms),
            last_text_at=now,
            cache=msg.cache,
            normalize=msg.normalize,
            spoken_text=SpokenText(enabled=msg.normalize),
            format=msg.format,
            timings=msg.timings,
            ssml=SsmlReader() if msg.ssml else None,
            playback_tokens=float(self.limits.playback_burst),
            playback_at=now,
        )
        self._next_stream = self._next_stream % 65535 + 1
        self.contexts[ctx.context_id] = ctx
        return [StartContext(ctx)]

    def _forget(self, ctx: ContextState) -> None:
        del self.contexts[ctx.context_id]
        self._recent.append(ctx.context_id)

    def _playback(self, ctx: ContextState, msg: PlaybackMessage, now: float) -> list[Action]:
        limits = self.limits
        ctx.playback_tokens = min(float(limits.playback_burst), ctx.playback_tokens
                                  + (now - ctx.playback_at) * limits.playback_per_s)
        ctx.playback_at = now
        if ctx.playback_tokens < 1.0:
            raise ProtocolError(
                f"at most {limits.playback_per_s:g} playback reports a second per context",
                code=ErrorCode.RATE_LIMITED)
        ctx.playback_tokens -= 1.0
        if ctx.played_ms is not None and msg.played_ms <= ctx.played_ms:
            return []  # positions only move forward; a late, older report changes nothing
        ctx.played_ms = msg.played_ms
        return [Playback(ctx.context_id, msg.played_ms)]

    def heard(self, ctx: ContextState) -> dict[str, Any]:
        """What the listener heard of a context: ``heard_ms`` (reported by the client, else
        the server's estimate), ``heard_source``, and its input split at the last heard
        character into ``text_spoken`` and ``text_remaining``."""
        reported = ctx.played_ms is not None
        played = (ctx.played_ms if ctx.played_ms is not None
                  else ctx.estimated_played_ms or 0.0)
        offset = 0
        for seg in ctx.finished:
            if played >= seg.start_ms + seg.duration_ms:
                offset = seg.text_end
                continue
            if played > seg.start_ms and seg.timings is not None:
                offset = seg.text_start + seg.timings.heard(played - seg.start_ms)
            break
        text = "".join(ctx.input)
        return {"heard_ms": round(played, 3), "heard_source":
                "reported" if reported else "estimated",
                "text_spoken": text[:offset], "text_remaining": text[offset:]}

    def _queue(self, ctx: ContextState, chunks: list[Chunk]) -> list[Action]:
        actions: list[Action] = []
        for chunk in chunks:
            spoken: str | None
            if self.normalize_later and ctx.normalize:
                spoken = None
            else:
                spoken = ctx.spoken_text(chunk.text)
                ctx.spoken[ctx.segments_queued] = spoken
            actions.append(Synthesize(ctx.context_id, ctx.segments_queued, chunk, spoken,
                                      ctx.speed))
            ctx.segments_queued += 1
        return actions

    # -- timers --------------------------------------------------------------------

    def poll(self, now: float | None = None) -> list[Action]:
        """Flush contexts whose buffered text has waited ``idle_flush_ms`` with no new text."""
        now = time.monotonic() if now is None else now
        actions: list[Action] = []
        for ctx in self.contexts.values():
            if (not ctx.ended and ctx.idle_flush_ms > 0 and ctx.segmenter.buffered.strip()
                    and (now - ctx.last_text_at) * 1000.0 >= ctx.idle_flush_ms):
                actions += self._queue(ctx, ctx.segmenter.flush())
        return actions

    def next_deadline(self) -> float | None:
        """When :meth:`poll` next has work, in ``time.monotonic()`` seconds; None if never."""
        times = [ctx.last_text_at + ctx.idle_flush_ms / 1000.0
                 for ctx in self.contexts.values()
                 if not ctx.ended and ctx.idle_flush_ms > 0 and ctx.segmenter.buffered.strip()]
        return min(times) if times else None

    # -- audio progress --------------------------------------------------------------

    def segment_started(self, context_id: str, index: int, chunk: Chunk,
                        cached: bool = False, spoken: str | None = None) -> SendEvent | None:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            return None
        if spoken is None:
            spoken = ctx.spoken.get(index, chunk.text)
        return SendEvent({
            "type": "segment_started", "context_id": context_id, "stream": ctx.stream,
            "segment": index, "text": chunk.text,
            "spoken": spoken, "text_start": chunk.start,
            "text_end": chunk.end, "audio_start_ms": round(ctx.audio_ms, 3),
            "sample_rate": ctx.sample_rate, "cached": cached,
        })

    def segment_done(self, context_id: str, index: int, chunk: Chunk, samples: int,
                     frames: int, timings: CharTimings | None = None) -> list[Action]:
        """Record a finished segment; may also complete flushes and the context.

        ``timings``: the segment's estimated character timings (ms from its own start),
        used for heard text on cancel and, for a context started with ``timings``, sent
        in ``segment_done`` shifted to the context's audio."""
        ctx = self.contexts.get(context_id)
        if ctx is None:
            return []
        start_ms = ctx.audio_ms
        duration_ms = 1000.0 * samples / ctx.sample_rate
        ctx.audio_samples += samples
        ctx.segments_done += 1
        ctx.spoken.pop(index, None)
        if timings is not None and timings.text != chunk.text:
            timings = None  # not this segment's text: segment granularity instead
        ctx.finished.append(_HeardSegment(start_ms, duration_ms, chunk.start, chunk.end,
                                          timings))
        event: dict[str, Any] = {
            "type": "segment_done", "context_id": context_id, "stream": ctx.stream,
            "segment": index, "text": chunk.text, "text_start": chunk.start,
            "text_end": chunk.end, "audio_start_ms": round(start_ms, 3),
            "duration_ms": round(duration_ms, 3),
            "samples": samples, "frames": frames,
        }
        if ctx.timings and timings is not None:
            placed = timings.shifted(round(start_ms))
            event.update(chars=list(placed.chars), char_start_ms=list(placed.start_ms),
                         char_duration_ms=list(placed.duration_ms), timings_estimated=True)
        actions: list[Action] = [SendEvent(event)]
        return actions + self._check_marks(ctx)

    def segment_failed(self, context_id: str, index: int, exc: Exception) -> list[Action]:
        """A segment produced an error instead of audio; the context goes on."""
        ctx = self.contexts.get(context_id)
        if ctx is None:
            return []
        ctx.segments_done += 1
        ctx.spoken.pop(index, None)
        return [self.error(exc, context_id, segment=index), *self._check_marks(ctx)]

    def context_failed(self, context_id: str, exc: Exception) -> list[Action]:
        """The server could not go on with this context (a bug in its pipeline): forget it
        and tell the client, once, with ``context_closed: true``. The connection and its
        other contexts go on; the id can be started again."""
        ctx = self.contexts.get(context_id)
        if ctx is None:
            return []
        self._forget(ctx)
        return [self.error(exc, context_id, context_closed=True)]

    def _check_marks(self, ctx: ContextState) -> list[Action]:
        actions: list[Action] = []
        while ctx.flush_marks and ctx.flush_marks[0] <= ctx.segments_done:
            ctx.flush_marks.pop(0)
            actions.append(SendEvent({"type": "flushed", "context_id": ctx.context_id,
                                      "segments": ctx.segments_done}))
        if ctx.ended and ctx.segments_done >= ctx.segments_queued:
            self._forget(ctx)
            actions.append(SendEvent({
                "type": "done", "context_id": ctx.context_id, "segments": ctx.segments_done,
                "audio_ms": round(ctx.audio_ms, 3),
            }))
        return actions
