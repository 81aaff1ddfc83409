"""The native protocol, version 1, on ``/v1/stream`` (see :mod:`rtts.api.native.protocol`).

Translates WebSocket messages to the core and the core's audio to binary frames. One
:class:`Connection` per client runs three kinds of owned tasks: the reader (the handler),
one writer draining a bounded send queue, one idle-flush timer, and one pipeline task per
open context. Every task is cancelled when the connection ends.

The socket is the ``websockets`` library's: its send path is what keeps per-frame
latency low with thousands of connections (see the README's benchmark), so WebSocket
upgrades are handed to it by :mod:`rtts.api.listener` while plain HTTP goes to the ASGI app.

Audio frames carry PCM16 by default; a context started with another ``format`` (see
:mod:`rtts.audio.codecs`) gets the encoder's bytes instead, in the same 12-byte-header frames:
each frame holds the bytes the encoder produced for that piece of audio (possibly none,
then no frame), and a segment's last frame holds the encoder's tail. Every segment is a
complete stream of that format (its own header, e.g. Ogg/WebM/WAV), so a client can
decode segment by segment or concatenate them per the format's rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from rtts.api.admission import WsAdmission
from rtts.api.auth import Authenticator
from rtts.api.handshake import respond
from rtts.api.native.pacing import LeadPacer
from rtts.api.native.protocol import (
    SUPPORTED_FORMATS,
    CancelMessage,
    FrameHeader,
    SaveVoiceMessage,
    StartMessage,
    pack_frame,
    parse_client_message,
)
from rtts.api.native.session import (
    Action,
    CancelContext,
    ContextState,
    Playback,
    SendEvent,
    Session,
    StartContext,
    Synthesize,
)
from rtts.api.tasks import OwnedTasks
from rtts.audio.codecs import Encoder, open_encoder
from rtts.audio.pcm import StreamingResampler, float_to_pcm16
from rtts.core.context import Audio, Done, SegmentDone, SegmentFailed, SegmentStarted
from rtts.core.governor import Level
from rtts.core.params import NO_SPEAKER, SpeakerSample
from rtts.core.service import Service
from rtts.core.voices import VoiceError, sample_json
from rtts.errors import (
    CLOSE_IDLE,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SLOW_CLIENT,
    CLOSE_TRY_AGAIN_LATER,
    ErrorCode,
    InternalError,
    ProtocolError,
)
from rtts.text.segmenter import Chunk

__all__ = ["Connection", "ContextPipeline", "NativeEndpoint"]

logger = logging.getLogger("rtts.api.native")


class NativeEndpoint:
    """The handshake checks and the per-connection handler of ``/v1/stream``."""

    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth
        self.config = service.config
        self.stats = service.stats
        self.connections: set[Connection] = set()
        self.admission = WsAdmission(service, auth)

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """The WebSocket handshake: the path, then :meth:`WsAdmission.handshake`."""
        path = request.path.split("?", 1)[0]
        if path != self.config.ws_path:
            return respond(404, "not found\n")
        return self.admission.handshake(connection, request)

    async def handle(self, ws: ServerConnection) -> None:
        async with self.admission.session(ws) as principal:
            if principal is not None:
                owner = self.auth.owner(principal.kid) if principal.kid else None
                await self._handle(ws, owner)

    async def _handle(self, ws: ServerConnection, owner: str | None = None) -> None:
        service = self.service
        if service.rejecting:
            self.stats.rejected += 1
            with contextlib.suppress(ConnectionClosed):
                reason = f"server overloaded ({service.governor.reason}); retry later"
                await ws.send(orjson.dumps({"type": "error", "code": str(ErrorCode.OVERLOADED),
                                            "message": reason}).decode())
                await ws.close(CLOSE_TRY_AGAIN_LATER, "server overloaded")
            return
        conn = Connection(self, ws, owner)
        conn.session.degraded = service.degraded
        self.connections.add(conn)
        self.stats.connections_total += 1
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            service.activity.set()

    def apply_level(self, level: Level) -> None:
        event = {"type": "server_state", "level": level.name.lower(),
                 "degraded": level >= Level.DEGRADED, "reason": self.service.governor.reason}
        for conn in self.connections:
            conn.session.degraded = level >= Level.DEGRADED
            conn.notify(event)

    def busy_connections(self) -> int:
        return sum(1 for c in self.connections if c.session.contexts)

    def active_contexts(self) -> int:
        return sum(len(c.session.contexts) for c in self.connections)


_DEAD_SERIALS_KEPT = 1024
_SPOKEN_KEPT = 16  # ended contexts whose voice save_voice may still store
_MAX_SAVES = 32  # save_voice messages per connection

# Below this many bytes waiting in the transport, ws.send() writes without waiting
# (websockets pauses writers above its write_limit, 256 KiB here).
_DIRECT_WRITE_BYTES = 64 * 1024


@dataclass(frozen=True)
class _Close:
    """Writer-queue marker: close the connection once what is queued before it is sent."""

    code: int
    reason: str


class Connection:
    """One client: reader loop, bounded writer queue, timer, one pipeline task per context."""

    def __init__(self, endpoint: NativeEndpoint, ws: ServerConnection,
                 owner: str | None = None) -> None:
        app = endpoint.service
        self.app = app
        self.owner = owner  # whose named voices this connection may use (None: shared)
        self.ws = ws
        self.cfg = app.config
        self.session = Session(app.config.limits, session_id=secrets.token_hex(8),
                               normalize_later=True)  # by the core context, off the loop
        self.out: asyncio.Queue[tuple[int, str | bytes | _Close, float]] = asyncio.Queue(
            maxsize=app.config.send_queue_frames)
        self.pipelines: dict[str, ContextPipeline] = {}
        self.endpoint = endpoint
        # the voice and anchor sample of the last contexts that ended (save_voice)
        self.spoken: OrderedDict[str, tuple[str | None, SpeakerSample]] = OrderedDict()
        self.saves = 0
        # serials of cancelled contexts whose queued frames must not be sent; bounded: the
        # send queue is FIFO and shorter than this, so older ones have no frames left
        self.dead_serials: OrderedDict[int, None] = OrderedDict()
        self._tasks = OwnedTasks()
        self._timer_wakeup = asyncio.Event()
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        self._writer_task: asyncio.Task[None] | None = None
        self.last_activity = time.monotonic()  # last client message or open context

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        return self._tasks.spawn(coro, name)

    async def run(self) -> None:
        self._writer_task = self._spawn(self._writer(), "rtts-writer")
        self._spawn(self._timer(), "rtts-idle-flush")
        if self.cfg.idle_timeout_s:
            self._spawn(self._idle_watch(self.cfg.idle_timeout_s), "rtts-idle-timeout")
        try:
            await self.send(0, self.session.hello(
                engine=self.app.engine_name, weights=self.app.weights(),
                sample_rate=self.app.sample_rate,
                degraded=self.app.degraded, instance=self.cfg.instance_id,
                formats=list(SUPPORTED_FORMATS)).event)
            await self._reader()
        except ConnectionClosed:
            pass
        finally:
            for pipeline in self.pipelines.values():
                pipeline.cancel()
            if self._close_task is not None:
                # Let our own close (behind queued events, or 4008) reach the client.
                await asyncio.wait({self._close_task}, timeout=self.cfg.close_timeout_s + 1)
            await self._tasks.cancel_all()
            # Drop our references to the tasks too (see rtts.api.tasks).
            self._writer_task = self._close_task = None
            self.pipelines.clear()

    async def close(self, code: int, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            # websockets' close() waits for its buffered writes to drain, unbounded when
            # the client stopped reading; so bound it here and drop the TCP connection.
            async with asyncio.timeout(self.cfg.close_timeout_s):
                await self.ws.close(code, reason)
        except TimeoutError:
            logger.info("session %s: close handshake timed out; aborting",
                        self.session.session_id)
            self.ws.transport.abort()
        except ConnectionClosed:
            pass

    # -- outbound ------------------------------------------------------------------

    async def send(self, serial: int, item: dict[str, Any] | bytes,
                   produced_at: float = 0.0) -> None:
        """Queue an event or frame; wait for space (pacing); close 4008 if it never comes."""
        payload = orjson.dumps(item).decode() if isinstance(item, dict) else item
        if self._can_write_now():
            # Nothing queued ahead and the socket takes it at once: write it here, without
            # a hop through the writer task (about a third of a frame's cost on the loop).
            await self._write(serial, payload, produced_at)
            return
        try:
            self.out.put_nowait((serial, payload, produced_at))
            return  # no timer to arm and cancel
        except asyncio.QueueFull:
            pass
        try:
            async with asyncio.timeout(self.cfg.slow_client_timeout_s):
                await self.out.put((serial, payload, produced_at))
        except TimeoutError:
            if self._close_task is None:
                logger.warning("session %s: client too slow, closing",
                               self.session.session_id)
                self._close_task = self._spawn(
                    self.close(CLOSE_SLOW_CLIENT, "client too slow to receive audio"),
                    "rtts-close")
            raise ConnectionClosed(None, None) from None

    def _can_write_now(self) -> bool:
        """True when a message can go straight to the socket in order and without waiting:
        the writer has nothing queued, we are not closing, and the transport's buffer is
        far below websockets' high-water mark (so ``ws.send`` will not wait to drain)."""
        if self._closing or not self.out.empty():
            return False
        transport = self.ws.transport
        return transport is not None and transport.get_write_buffer_size() < _DIRECT_WRITE_BYTES

    async def _write(self, serial: int, payload: str | bytes, produced_at: float) -> None:
        if serial and serial in self.dead_serials and isinstance(payload, bytes):
            return  # late frame of a cancelled context (by serial)
        await self.ws.send(payload)
        if isinstance(payload, bytes):
            stats = self.app.stats
            stats.frames_sent += 1
            if produced_at:
                stats.frame_latency_s.append(time.monotonic() - produced_at)

    async def _writer(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._write_loop()

    async def _write_loop(self) -> None:
        while True:
            serial, payload, produced_at = await self.out.get()
            if isinstance(payload, _Close):
                await self.close(payload.code, payload.reason)
                return
            await self._write(serial, payload, produced_at)

    # -- inbound -------------------------------------------------------------------

    async def _reader(self) -> None:
        async for message in self.ws:
            self.last_activity = time.monotonic()
            if isinstance(message, bytes):
                await self._protocol_error(ProtocolError(
                    "binary messages are not accepted; send JSON text",
                    code=ErrorCode.BINARY_NOT_ACCEPTED))
                continue
            try:
                msg = parse_client_message(
                    message, max_text_chars=self.cfg.limits.max_text_chars_per_message)
                if isinstance(msg, SaveVoiceMessage):
                    await self.send(0, await self._save_voice(msg))
                    continue
                if isinstance(msg, StartMessage):
                    self._check_start(msg)
                elif isinstance(msg, CancelMessage):
                    self._estimate_playback(msg.context_id)
                actions = self.session.receive(msg)
            except ProtocolError as exc:
                await self._protocol_error(exc, _peek_context(message))
                continue
            await self._apply(actions)
            self._timer_wakeup.set()

    async def _save_voice(self, msg: SaveVoiceMessage) -> dict[str, Any]:
        """Store what a context speaks as a named voice (this connection's key's own):
        ``voice_saved`` with the voice, or a ``ProtocolError``."""
        pipeline = self.pipelines.get(msg.context_id)
        spoken = pipeline.voice() if pipeline is not None else self.spoken.get(msg.context_id)
        if spoken is None:
            raise ProtocolError(f"context {msg.context_id!r} has no voice to save (it has "
                                "not spoken a segment yet, or it is too old)",
                                code=ErrorCode.UNKNOWN_CONTEXT)
        if self.saves >= _MAX_SAVES:
            raise ProtocolError(f"at most {_MAX_SAVES} save_voice per connection",
                                code=ErrorCode.RATE_LIMITED)
        if self.endpoint.auth.enabled and self.owner is None:
            raise ProtocolError("this key owns no voices", code=ErrorCode.INVALID_PARAMS)
        voice, sample = spoken
        body: dict[str, Any] = {"name": msg.name, "sample": sample_json(sample)}
        if voice is not None and voice.startswith("seed:"):
            body["seed"] = int(voice[5:])
        elif voice is not None and voice != NO_SPEAKER:
            body["speaker"] = voice
        self.saves += 1
        try:
            saved = await asyncio.to_thread(self.app.voices.create, body, owner=self.owner)
        except VoiceError as exc:
            raise ProtocolError(exc.message, code=ErrorCode.INVALID_PARAMS) from None
        return {"type": "voice_saved", "context_id": msg.context_id,
                "voice": saved.describe()}

    def _check_start(self, msg: StartMessage) -> None:
        self.app.check_admission()
        self.app.validate_params(msg.params, self.owner)

    def _estimate_playback(self, context_id: str) -> None:
        """Before a cancel: the pacer's idea of the playback position, for a context whose
        client never reported one (heard text is then estimated)."""
        ctx = self.session.contexts.get(context_id)
        pipeline = self.pipelines.get(context_id)
        if ctx is not None and pipeline is not None:
            ctx.estimated_played_ms = 1000.0 * pipeline.pacer.played(time.monotonic())

    def notify(self, event: dict[str, Any]) -> None:
        """Queue an event without waiting (server-state broadcasts); dropped if full."""
        with contextlib.suppress(asyncio.QueueFull):
            self.out.put_nowait((0, orjson.dumps(event).decode(), 0.0))

    async def _protocol_error(self, exc: ProtocolError, context_id: str | None = None) -> None:
        self.session.protocol_errors += 1
        self.app.stats.protocol_errors += 1
        await self.send(0, self.session.error(exc, context_id).event)
        if self.session.protocol_errors >= self.cfg.max_protocol_errors:
            # Close behind the queued events, so the client sees why.
            await self.out.put((0, _Close(CLOSE_POLICY_VIOLATION, "too many protocol errors"),
                                0.0))
            self._close_task = self._writer_task
            raise ConnectionClosed(None, None)

    async def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendEvent):
                await self.send(0, action.event)
            elif isinstance(action, StartContext):
                cid = action.context.context_id
                pipeline = ContextPipeline(self, action.context)
                self.pipelines[cid] = pipeline
                pipeline.task = self._spawn(pipeline.run(), f"rtts-context-{cid}")
                pipeline.task.add_done_callback(functools.partial(self._forget, cid, pipeline))
            elif isinstance(action, Synthesize):
                target = self.pipelines.get(action.context_id)
                if target is not None:
                    target.add(action)
            elif isinstance(action, Playback):
                target = self.pipelines.get(action.context_id)
                if target is not None:
                    target.pacer.report(action.played_ms / 1000.0)
            elif isinstance(action, CancelContext):
                self.app.stats.cancels += 1
                self.dead_serials[action.serial] = None
                if len(self.dead_serials) > _DEAD_SERIALS_KEPT:
                    self.dead_serials.popitem(last=False)
                cancelled = self.pipelines.pop(action.context_id, None)
                if cancelled is not None:
                    cancelled.cancel()
        for cid, pipeline in self.pipelines.items():
            if cid not in self.session.contexts:
                pipeline.finish()  # finished: let its task see that and return

    def _forget(self, cid: str, pipeline: ContextPipeline, task: asyncio.Task[None]) -> None:
        pipeline.task = None  # break pipeline -> task -> exception -> frame -> pipeline
        spoken = pipeline.voice()
        if spoken is not None:  # save_voice may still name it
            self.spoken[cid] = spoken
            self.spoken.move_to_end(cid)
            while len(self.spoken) > _SPOKEN_KEPT:
                self.spoken.popitem(last=False)
        if self.pipelines.get(cid) is pipeline:
            del self.pipelines[cid]
        self.app.activity.set()
        if task.cancelled() or (exc := task.exception()) is None or isinstance(
                exc, ConnectionClosed):
            return
        # A bug ended this context's pipeline: the client must hear about it (an error for
        # the context, which is then closed), not wait for audio or a ``done`` forever.
        error = InternalError.incident(logger, f"context {cid!r}", exc)
        ctx = self.session.contexts.get(cid)
        if ctx is not None:
            self.dead_serials[ctx.serial] = None
            if len(self.dead_serials) > _DEAD_SERIALS_KEPT:
                self.dead_serials.popitem(last=False)
        actions = self.session.context_failed(cid, error)
        if actions and not self._closing:
            self._spawn(self._apply(actions), "rtts-context-failed")

    async def _idle_watch(self, timeout_s: float) -> None:
        """Close (4000, behind anything queued) a connection that has had no open context
        and no message for ``timeout_s``: an idle socket must not hold a slot forever."""
        while True:
            now = time.monotonic()
            if self.session.contexts or self.pipelines:
                self.last_activity = now
            wait = self.last_activity + timeout_s - now
            if wait <= 0:
                break
            await asyncio.sleep(min(wait, timeout_s))
        self.app.stats.idle_closed += 1
        logger.info("session %s: idle for %.0fs, closing", self.session.session_id, timeout_s)
        await self.out.put((0, _Close(CLOSE_IDLE, "idle timeout"), 0.0))
        self._close_task = self._writer_task

    async def _timer(self) -> None:
        while True:
            deadline = self.session.next_deadline()
            self._timer_wakeup.clear()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._timer_wakeup.wait()
                    continue
            await self._apply(self.session.poll())


class ContextPipeline:
    """Plays one context's :class:`~rtts.core.context.SpeechContext` onto the socket.

    The session cuts the text; each cut is queued on the core context (which submits up to
    ``lookahead_segments`` ahead and serves cache hits), and the core's events become
    ``segment_started``, binary frames (paced, PCM16 or encoded), ``segment_done`` and
    ``error`` messages, in order.
    """

    def __init__(self, conn: Connection, ctx: ContextState) -> None:
        self.conn = conn
        self.ctx = ctx
        self.app = conn.app
        self.speech = self.app.open_context(ctx.params, lookahead=conn.cfg.lookahead_segments,
                                            use_cache=ctx.cache, normalize=ctx.normalize,
                                            owner=conn.owner)
        self.chunks: dict[int, Chunk] = {}  # queued segments by index
        self.task: asyncio.Task[None] | None = None
        self.pacer = LeadPacer(conn.cfg.max_lead_s)

    def voice(self) -> tuple[str | None, SpeakerSample] | None:
        """What this context speaks: its voice string and its sample (the anchor, or the
        voice's own), once it has one."""
        speech = self.speech
        sample = speech.anchor or speech.params.sample
        return None if sample is None else (speech.params.voice, sample)

    def add(self, job: Synthesize) -> None:
        self.chunks[job.index] = job.chunk
        self.speech.add_segment(job.chunk, job.spoken, job.speed)

    def finish(self) -> None:
        """The session is done with this context (every segment reported): end the events."""
        self.speech.end()

    def cancel(self) -> None:
        self.speech.close()  # the connection counts cancels itself
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        conn, ctx = self.conn, self.ctx
        segment: _SegmentOut | None = None
        events = self.speech.events()
        try:
            async for event in events:
                if isinstance(event, Audio):
                    assert segment is not None
                    # Frame latency (engine output -> socket) is recorded for live audio
                    # only: audio prefetched before its segment's turn is ahead of playback
                    # by design.
                    live = event.produced_at if event.produced_at >= segment.play_start else 0.0
                    if segment.encoder is None:
                        await segment.pcm(segment.resampler.process(event.samples), live)
                    else:
                        await segment.encoded(event.samples, live)
                elif isinstance(event, SegmentStarted):
                    if event.index and event.ready:
                        # A segment boundary with the next audio already made (prefetched
                        # or cached): nothing is late here, so let frames that are queued
                        # behind us go first. Many streams crossing a boundary together
                        # otherwise hold up every live frame behind their events and first
                        # frames.
                        await asyncio.sleep(0)
                    chunk = self.chunks[event.index]
                    started = conn.session.segment_started(ctx.context_id, event.index, chunk,
                                                           event.cached, event.spoken)
                    if started is not None:
                        await conn.send(0, started.event)
                    segment = _SegmentOut(self, event.index)
                elif isinstance(event, SegmentDone):
                    assert segment is not None
                    await segment.end()
                    await conn._apply(conn.session.segment_done(
                        ctx.context_id, event.index, self.chunks.pop(event.index),
                        segment.total, segment.seq, event.timings))
                    segment = None
                elif isinstance(event, SegmentFailed):
                    self.chunks.pop(event.index, None)
                    segment = None
                    await conn._apply(conn.session.segment_failed(ctx.context_id, event.index,
                                                                  event.error))
                elif isinstance(event, Done):
                    return
        finally:
            self.speech.close()
            await events.aclose()


class _SegmentOut:
    """One segment's audio on its way out: resample or encode, frame, pace, send."""

    def __init__(self, pipeline: ContextPipeline, index: int) -> None:
        self.p = pipeline
        ctx, rate = pipeline.ctx, pipeline.app.sample_rate
        self.index = index
        self.play_start = time.monotonic()
        self.resampler = StreamingResampler(rate, ctx.sample_rate)
        self.encoder: Encoder | None = None if ctx.format == "pcm16" else open_encoder(
            ctx.format, rate, ctx.sample_rate)
        self.frame_len = max(1, ctx.sample_rate * pipeline.conn.cfg.frame_ms // 1000)
        self.seq = 0
        self.total = 0  # samples at the context's rate

    async def end(self) -> None:
        if self.encoder is None:
            await self.pcm(self.resampler.flush(), 0.0)
        else:
            await self.encoded(None, 0.0)

    # The two senders below inline the frame send (one coroutine per engine chunk, as before
    # the core split): this is the hot path of every live frame.

    async def pcm(self, samples: np.ndarray, produced_at: float) -> None:
        p = self.p
        conn, ctx, pacer = p.conn, p.ctx, p.pacer
        rate = ctx.sample_rate
        for i in range(0, len(samples), self.frame_len):
            piece = samples[i:i + self.frame_len]
            wait = pacer.delay(time.monotonic())
            if wait > 0:
                await _pace(pacer, wait)
                if produced_at:  # pacing is not latency: count from the end of the wait
                    produced_at = time.monotonic()
            header = FrameHeader(ctx.stream, self.index, self.seq)
            await conn.send(ctx.serial, pack_frame(header, float_to_pcm16(piece)), produced_at)
            self.seq += 1
            self.total += len(piece)
            pacer.sent(len(piece) / rate, time.monotonic())

    async def encoded(self, samples: np.ndarray | None, produced_at: float) -> None:
        """One frame of whatever the encoder made of this audio (None: its tail)."""
        p = self.p
        encoder = self.encoder
        assert encoder is not None
        before = encoder.samples
        data = encoder.finish() if samples is None else encoder.encode(samples)
        n = encoder.samples - before
        self.total += n
        if not data:
            return
        wait = p.pacer.delay(time.monotonic())
        if wait > 0:
            await _pace(p.pacer, wait)
            if produced_at:
                produced_at = time.monotonic()
        header = FrameHeader(p.ctx.stream, self.index, self.seq)
        await p.conn.send(p.ctx.serial, pack_frame(header, data), produced_at)
        self.seq += 1
        p.pacer.sent(n / p.ctx.sample_rate, time.monotonic())


async def _pace(pacer: LeadPacer, wait: float) -> None:
    """Wait until the pacer lets the next frame go. One wait does it on the wall-clock
    estimate; on a client's reported position, ask again after each wait (a slowly playing
    client's report may not have moved), at least 10 ms apart."""
    while wait > 0:
        await asyncio.sleep(max(wait, 0.01) if pacer.reported else wait)
        if not pacer.reported:
            return
        wait = pacer.delay(time.monotonic())


def _peek_context(message: str) -> str | None:
    try:
        obj = orjson.loads(message)
    except orjson.JSONDecodeError:
        return None
    cid = obj.get("context_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and len(cid) <= 64 else None


