"""The asyncio WebSocket server: thin I/O around :mod:`rtts.session` and the scheduler.

One :class:`Connection` per client runs three kinds of owned tasks: the reader (this
handler), one writer draining a bounded send queue, one idle-flush timer, and one
pipeline task per open context. Every task is cancelled when the connection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import secrets
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson
import psutil
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from . import __version__
from .audio import StreamingResampler, float_to_pcm16, wav_bytes
from .auth import Authenticator, AuthError
from .cache import CachedStream, PhraseCache
from .config import ServerConfig
from .engines import build_engine
from .engines.base import Engine, SynthRequest
from .errors import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SLOW_CLIENT,
    CLOSE_TRY_AGAIN_LATER,
    ErrorCode,
    ProtocolError,
    RttsError,
)
from .governor import Governor, GovernorConfig, Level, LoadSignals
from .http import respond, static_file
from .pacing import LeadPacer
from .protocol import FrameHeader, StartMessage, pack_frame, parse_client_message
from .scheduler import RequestStream, Scheduler
from .segmenter import Segmenter
from .session import (
    Action,
    CancelContext,
    ContextState,
    SendEvent,
    Session,
    StartContext,
    Synthesize,
)

__all__ = ["App", "Connection", "run_server"]

logger = logging.getLogger("rtts.server")


@dataclass
class Stats:
    connections_total: int = 0
    contexts_total: int = 0
    segments_total: int = 0
    segment_errors: int = 0
    cancels: int = 0
    protocol_errors: int = 0
    rejected: int = 0
    auth_rejected: int = 0
    frames_sent: int = 0
    audio_seconds_sent: float = 0.0
    ttfa_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    # engine output -> frame handed to the socket, per live frame (server-added latency)
    frame_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=20000))


class App:
    """Owns the engine, the scheduler and the server state (loading/ready/draining)."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None,
                 own_engine: bool = True) -> None:
        self.config = config
        self.own_engine = own_engine  # close the engine at shutdown
        self.engine: Engine = engine or build_engine(config.engine)
        self.scheduler = Scheduler(self.engine, config.scheduler)
        self.state = "loading"
        self.state_reason = "model loading"
        self.connections: set[Connection] = set()
        self.stats = Stats()
        self.started_at = time.monotonic()
        self.server: Server | None = None
        self.activity = asyncio.Event()  # set when a context or connection ends (for drain)
        self.governor = Governor(_scaled_governor(config))
        self._sampler: asyncio.Task[None] | None = None
        self._process = psutil.Process()
        self.auth = Authenticator(config.auth)
        self._principals: dict[int, str] = {}  # connection id -> key id, handshake to handler
        self.cache = PhraseCache(config.cache, self.engine.name, self.engine.sample_rate)

    # -- lifecycle -------------------------------------------------------------------

    async def load(self) -> None:
        """Load and warm up the engine off the event loop; /readyz turns 200 after this."""
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self.engine.load)
            self.state_reason = "warming up"
            await asyncio.to_thread(self.engine.warmup)
            if self.config.freeze_gc:
                # Everything alive now (modules, the model) lives as long as the process:
                # take it out of the collector's sight, before the first client, so full
                # collections walk only per-session objects.
                gc.collect()
                gc.freeze()
        except Exception as exc:
            self.state = "failed"
            self.state_reason = f"model load failed: {type(exc).__name__}: {exc}"
            logger.exception("engine %s failed to load", self.engine.name)
            raise
        await self.start_serving()
        logger.info("engine %s ready on %s in %.1fs", self.engine.name, self.engine.device,
                    time.monotonic() - t0)

    # -- load governor -----------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self.governor.level >= Level.DEGRADED

    @property
    def rejecting(self) -> bool:
        return self.governor.level >= Level.REJECTING

    def load_signals(self) -> LoadSignals:
        gpu = 0.0
        if self.engine.device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info()
            gpu = 1.0 - free / total
        return LoadSignals(
            queue_depth=self.scheduler.queue_depth,
            rss_mb=self._process.memory_info().rss / 2**20,
            cpu_percent=psutil.cpu_percent(None),
            gpu_mem_fraction=gpu,
        )

    async def _sample_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.governor.interval_s)
            before = self.governor.level
            level = self.governor.update(self.load_signals(), time.monotonic())
            if level != before:
                self.apply_level(level)

    def apply_level(self, level: Level) -> None:
        """Propagate a governor level to the scheduler, sessions and clients."""
        self.scheduler.degraded = level >= Level.DEGRADED
        event = {"type": "server_state", "level": level.name.lower(),
                 "degraded": level >= Level.DEGRADED, "reason": self.governor.reason}
        for conn in self.connections:
            conn.session.degraded = level >= Level.DEGRADED
            conn.notify(event)

    async def start_serving(self) -> None:
        """With a loaded engine: start the scheduler and the governor; /readyz turns 200."""
        await self.scheduler.start()
        # Known only once loaded (the weights' identity names the cache namespace).
        self.cache.engine_id = getattr(self.engine, "identity", self.engine.name)
        await self.cache.start()
        self._sampler = asyncio.create_task(self._sample_load(), name="rtts-governor")
        self.state, self.state_reason = "ready", "ready"

    def busy_connections(self) -> int:
        return sum(1 for c in self.connections if c.session.contexts)

    async def drain_and_close(self) -> None:
        """Graceful shutdown: stop accepting, let contexts finish until the grace deadline,
        then close remaining connections with 1001 and stop the engine."""
        self.state, self.state_reason = "draining", "shutting down"
        logger.info("draining %d connections (grace %.1fs)", len(self.connections),
                    self.config.shutdown_grace_s)
        if self.server is not None:
            self.server.close(close_connections=False)
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.busy_connections() and (left := deadline - time.monotonic()) > 0:
            self.activity.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.activity.wait()
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        for conn in list(self.connections):
            await conn.close(CLOSE_GOING_AWAY, "server shutting down")
        if self.server is not None:
            await self.server.wait_closed()
        await self.scheduler.stop()
        await self.cache.close()
        if self.own_engine:
            await asyncio.to_thread(self.engine.close)
        logger.info("shutdown complete")

    # -- HTTP --------------------------------------------------------------------------

    async def process_request(self, connection: ServerConnection,
                              request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == self.config.ws_path:
            if request.headers.get("Upgrade", "").lower() != "websocket":
                return respond(400, "this path speaks WebSocket\n")
            if self.state != "ready":
                return respond(503, f"not ready: {self.state_reason}\n",
                               extra=[("Retry-After", "1")])
            if len(self.connections) >= self.config.max_connections:
                return respond(503, "too many connections\n", extra=[("Retry-After", "1")])
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
            try:
                self.auth.check_origin(request.headers.get("Origin"))
                token = query["token"][0] if query.get("token") else None
                kid = self.auth.identify(request.headers.get("Authorization"), token,
                                         time.time())
                self.auth.admit(kid, time.monotonic())
            except AuthError as exc:
                self.stats.auth_rejected += 1
                extra = [("Retry-After", "10")] if exc.status == 429 else []
                if exc.status == 401:
                    extra.append(("WWW-Authenticate", "Bearer"))
                return respond(exc.status, f"{exc.reason}\n", extra=extra)
            self._principals[id(connection)] = kid
            return None
        if path == "/v1/token":
            return self._token(request)
        if path == "/healthz":
            return respond(200, "ok\n")
        if path == "/readyz":
            ok = self.state == "ready"
            return respond(200 if ok else 503, f"{self.state_reason}\n")
        if path == "/metrics":
            from .metrics import render_metrics

            return respond(200, render_metrics(self), "text/plain; version=0.0.4")
        if path == "/v1/info":
            return respond(200, orjson.dumps(self.info()), "application/json")
        if path == "/v1/tts":
            return await self._tts(request)
        resp = static_file(self.config.web_dir, path)
        return resp or respond(404, "not found\n")

    def _token(self, request: Request) -> Response:
        """``GET /v1/token`` with ``Authorization: Bearer <key>``: a short-lived browser token."""
        if not self.auth.enabled:
            return respond(404, "auth is off: no token needed\n")
        kid = self.auth.key_from_header(request.headers.get("Authorization"))
        if kid is None:
            return respond(401, "missing or invalid API key\n",
                           extra=[("WWW-Authenticate", "Bearer")])
        body = {"token": self.auth.issue_token(kid, time.time()),
                "expires_in": self.auth.config.token_ttl_s}
        return respond(200, orjson.dumps(body), "application/json")

    def validate_params(self, msg: StartMessage) -> None:
        """Reject params the engine cannot use (e.g. a malformed voice) before queueing."""
        validate = getattr(self.engine, "validate", None)
        if validate is not None:
            try:
                validate(msg.params)
            except ValueError as exc:
                raise ProtocolError(str(exc), code=ErrorCode.INVALID_PARAMS) from None

    def info(self) -> dict[str, Any]:
        return {"server": "rtts", "version": __version__, "engine": self.engine.name,
                "device": self.engine.device, "engine_sample_rate": self.engine.sample_rate,
                "state": self.state, "ws_path": self.config.ws_path,
                "instance": self.config.instance_id,
                "cache": {"memory_mb": self.config.cache.memory_mb,
                          "redis": self.config.cache.redis_url is not None}}

    async def _tts(self, request: Request) -> Response:
        """``GET /v1/tts?text=...&voice=...&seed=...&sample_rate=...`` -> a whole WAV file."""
        if self.state != "ready":
            return respond(503, f"not ready: {self.state_reason}\n")
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
        text = (query.get("text") or [""])[0]
        if not text.strip() or len(text) > 5000:
            return respond(400, "text must be 1-5000 characters\n")
        start: dict[str, Any] = {"type": "start"}
        for key, value in query.items():
            if key in ("voice",):
                start[key] = value[0]
            elif key in ("seed", "top_K", "speed", "sample_rate"):
                with contextlib.suppress(ValueError):
                    start[key] = int(value[0])
            elif key in ("temperature", "top_P"):
                with contextlib.suppress(ValueError):
                    start[key] = float(value[0])
        try:
            msg = parse_client_message(orjson.dumps(start))
            assert isinstance(msg, StartMessage)
            self.validate_params(msg)
        except ProtocolError as exc:
            return respond(400, f"{exc.message}\n")
        seg = Segmenter(max_chars=self.config.limits.default_max_chunk_chars)
        chunks = seg.push(text) + seg.flush()
        parts: list[np.ndarray] = []
        try:
            for i, chunk in enumerate(chunks):
                resampler = StreamingResampler(self.engine.sample_rate, msg.sample_rate)
                ckey = self.cache.key(chunk.text, msg.params, self.degraded)
                hit = await self.cache.get(ckey) if ckey is not None else None
                if hit is not None:
                    parts.append(resampler.process(hit))
                else:
                    stream = self.scheduler.submit(SynthRequest(chunk.text, msg.params,
                                                                priority=i))
                    raw = [samples async for samples in stream]
                    parts.extend(resampler.process(r) for r in raw)
                    if ckey is not None and raw:
                        self.cache.put(ckey, np.concatenate(raw))
                parts.append(resampler.flush())
        except RttsError as exc:
            return respond(503 if exc.code == ErrorCode.OVERLOADED else 500, f"{exc.message}\n")
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return respond(200, wav_bytes(audio, msg.sample_rate), "audio/wav")

    # -- WebSocket -----------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        kid = self._principals.pop(id(ws), "anonymous")
        try:
            await self._handle(ws)
        finally:
            self.auth.release(kid)

    async def _handle(self, ws: ServerConnection) -> None:
        if self.rejecting:
            self.stats.rejected += 1
            with contextlib.suppress(ConnectionClosed):
                reason = f"server overloaded ({self.governor.reason}); retry later"
                await ws.send(orjson.dumps({"type": "error", "code": str(ErrorCode.OVERLOADED),
                                            "message": reason}).decode())
                await ws.close(CLOSE_TRY_AGAIN_LATER, "server overloaded")
            return
        conn = Connection(self, ws)
        conn.session.degraded = self.degraded
        self.connections.add(conn)
        self.stats.connections_total += 1
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self.activity.set()


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

    def __init__(self, app: App, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.cfg = app.config
        self.session = Session(app.config.limits, session_id=secrets.token_hex(8))
        self.out: asyncio.Queue[tuple[int, str | bytes | _Close, float]] = asyncio.Queue(
            maxsize=app.config.send_queue_frames)
        self.pipelines: dict[str, ContextPipeline] = {}
        self.dead_streams: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer_wakeup = asyncio.Event()
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        self._writer_task: asyncio.Task[None] | None = None

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self) -> None:
        self._writer_task = self._spawn(self._writer(), "rtts-writer")
        self._spawn(self._timer(), "rtts-idle-flush")
        try:
            await self.send(0, self.session.hello(
                engine=self.app.engine.name, sample_rate=self.app.engine.sample_rate,
                degraded=self.app.degraded, instance=self.cfg.instance_id).event)
            await self._reader()
        except ConnectionClosed:
            pass
        finally:
            for pipeline in self.pipelines.values():
                pipeline.cancel()
            if self._close_task is not None:
                # Let our own close (behind queued events, or 4008) reach the client.
                await asyncio.wait({self._close_task}, timeout=self.cfg.close_timeout_s + 1)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            # A cancelled task keeps its CancelledError, whose traceback holds the frames
            # that hold ``self``: drop our references to the tasks so the connection is
            # freed by reference counting, not left to a full garbage collection.
            self._writer_task = self._close_task = None
            self._tasks.clear()
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

    async def send(self, stream: int, item: dict[str, Any] | bytes,
                   produced_at: float = 0.0) -> None:
        """Queue an event or frame; wait for space (pacing); close 4008 if it never comes."""
        payload = orjson.dumps(item).decode() if isinstance(item, dict) else item
        if self._can_write_now():
            # Nothing queued ahead and the socket takes it at once: write it here, without
            # a hop through the writer task (about a third of a frame's cost on the loop).
            await self._write(stream, payload, produced_at)
            return
        try:
            self.out.put_nowait((stream, payload, produced_at))
            return  # no timer to arm and cancel
        except asyncio.QueueFull:
            pass
        try:
            async with asyncio.timeout(self.cfg.slow_client_timeout_s):
                await self.out.put((stream, payload, produced_at))
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

    async def _write(self, stream: int, payload: str | bytes, produced_at: float) -> None:
        if stream and stream in self.dead_streams and isinstance(payload, bytes):
            return  # late frame of a cancelled context
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
            stream, payload, produced_at = await self.out.get()
            if isinstance(payload, _Close):
                await self.close(payload.code, payload.reason)
                return
            await self._write(stream, payload, produced_at)

    # -- inbound -------------------------------------------------------------------

    async def _reader(self) -> None:
        async for message in self.ws:
            if isinstance(message, bytes):
                await self._protocol_error(ProtocolError(
                    "binary messages are not accepted; send JSON text",
                    code=ErrorCode.BINARY_NOT_ACCEPTED))
                continue
            try:
                msg = parse_client_message(
                    message, max_text_chars=self.cfg.limits.max_text_chars_per_message)
                if isinstance(msg, StartMessage):
                    self._check_start(msg)
                actions = self.session.receive(msg)
            except ProtocolError as exc:
                await self._protocol_error(exc, _peek_context(message))
                continue
            await self._apply(actions)
            self._timer_wakeup.set()

    def _check_start(self, msg: StartMessage) -> None:
        if self.app.rejecting:
            self.app.stats.rejected += 1
            raise ProtocolError("server overloaded; retry later", code=ErrorCode.OVERLOADED)
        self.app.validate_params(msg)

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
                self.app.stats.contexts_total += 1
                cid = action.context.context_id
                pipeline = ContextPipeline(self, action.context)
                self.pipelines[cid] = pipeline
                pipeline.task = self._spawn(pipeline.run(), f"rtts-context-{cid}")
                pipeline.task.add_done_callback(functools.partial(self._forget, cid, pipeline))
            elif isinstance(action, Synthesize):
                target = self.pipelines.get(action.context_id)
                if target is not None:
                    target.add(action)
            elif isinstance(action, CancelContext):
                self.app.stats.cancels += 1
                self.dead_streams.add(action.stream)
                cancelled = self.pipelines.pop(action.context_id, None)
                if cancelled is not None:
                    cancelled.cancel()
        for cid, pipeline in self.pipelines.items():
            if cid not in self.session.contexts:
                pipeline.wakeup.set()  # finished: let its task see that and return

    def _forget(self, cid: str, pipeline: ContextPipeline, task: asyncio.Task[None]) -> None:
        pipeline.task = None  # break pipeline -> task -> exception -> frame -> pipeline
        if self.pipelines.get(cid) is pipeline:
            del self.pipelines[cid]
        self.app.activity.set()
        if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(
                exc, ConnectionClosed):
            logger.error("context %s pipeline failed", cid, exc_info=exc)

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
    """Submits a context's segments ahead of playback and sends their audio in order."""

    def __init__(self, conn: Connection, ctx: ContextState) -> None:
        self.conn = conn
        self.ctx = ctx
        self.app = conn.app
        self.pending: deque[Synthesize] = deque()
        # (job, its audio source or the error submitting it, its cache key or None)
        self.inflight: deque[tuple[Synthesize, Source | RttsError, str | None]] = deque()
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.first_audio_sent = False
        self.pacer = LeadPacer(conn.cfg.max_lead_s)

    def add(self, job: Synthesize) -> None:
        self.pending.append(job)
        self.wakeup.set()

    def cancel(self) -> None:
        for _, stream, _ in self.inflight:
            if not isinstance(stream, RttsError):
                stream.cancel()
        self.inflight.clear()
        self.pending.clear()
        if self.task is not None:
            self.task.cancel()

    async def _submit_ahead(self) -> None:
        cache = self.app.cache
        while self.pending and len(self.inflight) < self.conn.cfg.lookahead_segments:
            job = self.pending.popleft()
            degraded = self.app.degraded
            key = cache.key(job.chunk.text, self.ctx.params, degraded) if self.ctx.cache else None
            if key is not None and (hit := await cache.get(key)) is not None:
                self.inflight.append((job, CachedStream(hit), None))
                continue
            request = SynthRequest(job.chunk.text, self.ctx.params,
                                   priority=0 if job.index == 0 else 1, degraded=degraded)
            try:
                self.inflight.append((job, self.app.scheduler.submit(request), key))
            except RttsError as exc:
                self.inflight.append((job, exc, None))

    async def run(self) -> None:
        try:
            while True:
                await self._submit_ahead()
                if not self.inflight:
                    if self.ctx.context_id not in self.conn.session.contexts:
                        return  # done or cancelled
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                job, stream, key = self.inflight[0]
                if job.index and not isinstance(stream, RttsError) and stream.ready:
                    # A segment boundary with the next audio already made (prefetched or
                    # cached): nothing is late here, so let frames that are queued behind
                    # us go first. Many streams crossing a boundary together otherwise hold
                    # up every live frame behind their events and first frames.
                    await asyncio.sleep(0)
                await self._play(job, stream, key)
                self.inflight.popleft()
        finally:
            for _, stream, _ in self.inflight:
                if not isinstance(stream, RttsError):
                    stream.cancel()

    async def _play(self, job: Synthesize, stream: Source | RttsError,
                    key: str | None) -> None:
        conn, ctx, stats = self.conn, self.ctx, self.app.stats
        stats.segments_total += 1
        if isinstance(stream, RttsError):
            stats.segment_errors += 1
            await conn._apply(conn.session.segment_failed(ctx.context_id, job.index, stream))
            return
        cached = isinstance(stream, CachedStream)
        started = conn.session.segment_started(ctx.context_id, job.index, job.chunk, cached)
        if started is not None:
            await conn.send(0, started.event)
        # Frame latency (engine output -> socket) is recorded for live audio only: audio
        # prefetched before its segment's turn is ahead of playback by design.
        play_start = time.monotonic()
        resampler = StreamingResampler(self.app.engine.sample_rate, ctx.sample_rate)
        frame_len = max(1, ctx.sample_rate * conn.cfg.frame_ms // 1000)
        seq = 0
        total = 0

        async def emit(samples: np.ndarray, produced_at: float) -> None:
            nonlocal seq, total
            for i in range(0, len(samples), frame_len):
                piece = samples[i:i + frame_len]
                wait = self.pacer.delay(time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)
                    if produced_at:  # pacing is not latency: count from the end of the wait
                        produced_at = time.monotonic()
                header = FrameHeader(ctx.stream, job.index, seq)
                await conn.send(ctx.stream, pack_frame(header, float_to_pcm16(piece)),
                                produced_at)
                seq += 1
                total += len(piece)
                self.pacer.sent(len(piece) / ctx.sample_rate, time.monotonic())
                if not self.first_audio_sent:
                    self.first_audio_sent = True
                    stats.ttfa_s.append(time.monotonic() - stream.submitted_at)

        keep: list[np.ndarray] | None = [] if key is not None else None
        kept = 0
        try:
            async for samples in stream:
                if keep is not None:
                    kept += len(samples)
                    if kept > self.app.cache.max_entry_samples:
                        keep = None  # too long to store
                    else:
                        keep.append(samples)
                await self._submit_ahead()
                live = stream.produced_at if stream.produced_at >= play_start else 0.0
                await emit(resampler.process(samples), live)
            await emit(resampler.flush(), 0.0)
        except RttsError as exc:
            stats.segment_errors += 1
            await conn._apply(conn.session.segment_failed(ctx.context_id, job.index, exc))
            return
        if keep and key is not None and not (isinstance(stream, RequestStream)
                                             and stream.request.cancelled.is_set()):
            self.app.cache.put(key, np.concatenate(keep))
        stats.audio_seconds_sent += total / ctx.sample_rate
        await conn._apply(conn.session.segment_done(ctx.context_id, job.index, job.chunk,
                                                    total, seq))


Source = RequestStream | CachedStream


def _peek_context(message: str) -> str | None:
    try:
        obj = orjson.loads(message)
    except orjson.JSONDecodeError:
        return None
    cid = obj.get("context_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and len(cid) <= 64 else None


@contextlib.asynccontextmanager
async def run_server(config: ServerConfig, engine: Engine | None = None,
                     load: bool = True, own_engine: bool = True) -> AsyncIterator[App]:
    """Start listening at once (``/healthz`` up, ``/readyz`` 503), load the engine, yield.

    On exit the server drains gracefully (see :meth:`App.drain_and_close`).
    """
    app = App(config, engine, own_engine)
    app.server = await serve(
        app.handle, config.host, config.port,
        process_request=app.process_request,
        max_size=config.max_message_bytes,
        max_queue=16,
        # permessage-deflate on PCM costs ~200 us a frame (measured) and saves little;
        # events are tiny. Off.
        compression=None,
        write_limit=256 * 1024,
        ping_interval=config.ping_interval_s,
        close_timeout=config.close_timeout_s,
        server_header=f"rtts/{__version__}",
    )
    try:
        if load:
            with contextlib.suppress(Exception):  # logged; /readyz reports the reason
                await app.load()
        yield app
    finally:
        if app.state != "stopped":
            await app.drain_and_close()
            app.state = "stopped"


def bound_port(app: App) -> int:
    assert app.server is not None
    sock = next(iter(app.server.sockets))
    return int(sock.getsockname()[1])

