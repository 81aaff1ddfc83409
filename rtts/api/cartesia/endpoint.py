"""The Cartesia-compatible socket ``/tts/websocket`` and ``POST /tts/bytes`` on the core.

HTTP: ``POST /tts/bytes`` (raw, wav or mp3) and ``POST /tts/sse`` (the socket's messages as
Server-Sent Events), the same request object without ``continue``.

Handshake: the same checks as every socket on the port (:class:`WsAdmission`: readiness,
connection caps, origin, key, quotas), the key read from ``X-API-Key`` or the
``api_key`` / ``access_token`` query parameter (``Authorization: Bearer`` and rtts
``?token=`` work too); ``Cartesia-Version`` / ``cartesia_version`` is accepted, any value.

Each ``context_id`` is one :class:`~rtts.core.context.SpeechContext` (up to
``max_contexts`` at once per socket), opened by its first request: that request must carry
``voice`` and ``output_format``; later ones add ``transcript``. ``continue: false`` ends the
context's input (its audio still comes, then ``done``); ``flush: true`` cuts what is
buffered now and answers ``flush_done`` once that audio is sent; ``max_buffer_delay_ms: 0``
synthesizes every request's transcript at once (LiveKit and pipecat send sentences so), a
larger value cuts what is buffered after that long without new text. ``cancel`` stops a
context at once: nothing more is sent for it.

Errors are Cartesia ``error`` messages (``status_code``, ``title``, ``message``,
``error_code``, ``context_id``); a bad request fails only its context and the socket stays
open (a bug in rtts fails only its context too: an ``internal_error`` naming an incident id
the server logs). The socket closes 1013 when the server is overloaded, 1001 on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from rtts.api.admission import WsAdmission
from rtts.api.auth import Authenticator
from rtts.api.cartesia.protocol import (
    CartesiaError,
    Generation,
    OutputFormat,
    chunk,
    done,
    flush_done,
    parse_message,
    parse_request,
    timestamps,
)
from rtts.api.compat import FlushMarks, RawEncoder, compat_voice, word_times
from rtts.api.handshake import respond
from rtts.api.http.common import ApiError, b64, read_body
from rtts.api.http.speech import SpeechBody, SpeechRequest, speak
from rtts.api.sockets import OpenSockets, close_within, receive_unless_idle, send_within
from rtts.api.tasks import OwnedTasks
from rtts.audio.codecs import Encoder, codec_for, open_encoder
from rtts.core.context import Audio, Done, SegmentDone, SegmentFailed, SegmentStarted
from rtts.core.params import SynthParams
from rtts.core.service import Service
from rtts.core.voicenames import speed_from_factor
from rtts.errors import (
    CLOSE_NORMAL,
    CLOSE_TRY_AGAIN_LATER,
    InternalError,
    ProtocolError,
    RttsError,
)

__all__ = ["PATH", "CartesiaEndpoints"]

logger = logging.getLogger("rtts.cartesia")

PATH: Final = "/tts/websocket"
MAX_HTTP_CHARS: Final = 40_960
MAX_PENDING_FLUSHES: Final = 256


def params_for(gen: Generation, service: Service, owner: str | None = None) -> SynthParams:
    """The synthesis params of a context's first request, else :class:`CartesiaError`;
    named voices are ``owner``'s (the caller's key's owner id) and the shared ones."""
    if gen.embedding:
        raise CartesiaError("voice embeddings are not supported here; use voice.mode \"id\" "
                            "with a voice id (GET /v1/voices)", "voice_embedding_unsupported")
    if gen.voice_id is None:
        raise CartesiaError("voice is required: {\"mode\": \"id\", \"id\": ...}",
                            "voice_required")
    speed = 5 if gen.speed is None else speed_from_factor(gen.speed)
    try:
        voice = compat_voice(gen.voice_id, service, owner)
        if voice is None:
            raise CartesiaError(f"unknown voice {gen.voice_id[:64]!r}: use a voice name "
                                "(GET /v1/voices), seed:N or a Cartesia voice id (UUID)",
                                "voice_not_found", status=404, title="Voice not found")
        params = SynthParams(voice=voice, speed=speed)
        service.validate_params(params, owner)
    except ProtocolError as exc:
        raise CartesiaError(exc.message, str(exc.code)) from None
    return params


def encoder_for(fmt: OutputFormat, input_rate: int) -> Encoder:
    if fmt.container == "raw":
        return RawEncoder(fmt.encoding, input_rate, fmt.sample_rate)
    return open_encoder("wav" if fmt.container == "wav" else "mp3", input_rate,
                        fmt.sample_rate, fmt.bit_rate)


def _overloaded(message: str) -> CartesiaError:
    return CartesiaError(message, "overloaded", status=429, title="Too many requests")


# -- WebSocket ------------------------------------------------------------------------------


class _Context:
    """One ``context_id``: its speech context, encoder, flushes and the task sending it."""

    def __init__(self, sock: _Socket, cid: str, gen: Generation, params: SynthParams) -> None:
        service = sock.endpoint.service
        assert gen.output_format is not None
        self.sock = sock
        self.cid = cid
        self.speech = service.open_context(params, owner=sock.owner)
        self.encoder = encoder_for(gen.output_format, service.sample_rate)
        self.add_timestamps = gen.add_timestamps
        self.delay_ms = gen.max_buffer_delay_ms
        self.marks = FlushMarks()
        self.flushes = 0  # flush requests so far (ids start at 1)
        self.flushed = 0  # flush_done sent
        self.chars = 0
        self.ended = False
        self.task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def apply(self, gen: Generation) -> list[int]:
        """Add a request's transcript; the flush ids complete at once."""
        if gen.max_buffer_delay_ms is not None:
            self.delay_ms = gen.max_buffer_delay_ms
        if gen.add_timestamps:
            self.add_timestamps = True
        text = gen.transcript
        if text:
            limit = self.sock.endpoint.service.config.limits.max_text_chars_per_context
            if self.chars + len(text) > limit:
                raise CartesiaError(f"more than {limit} characters in one context",
                                    "transcript_too_long")
            self.chars += len(text)
            self.marks.feed(text)
            self.speech.feed(text)
        complete: list[int] = []
        if gen.flush:
            if self.marks.pending >= MAX_PENDING_FLUSHES:
                raise CartesiaError(f"more than {MAX_PENDING_FLUSHES} flushes waiting for "
                                    "their audio", "too_many_flushes", status=429,
                                    title="Too many requests")
            self.flushes += 1
            self.speech.flush()
            complete = self.marks.flush(self.flushes)
        elif text and self.delay_ms == 0:
            self.speech.flush()
        elif text and self.delay_ms:
            self._arm(self.delay_ms / 1000)
        if not gen.cont:
            self.end()
        return complete

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self.speech.flush)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.speech.end()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.speech.close()

    def _flush_id(self) -> int | None:
        return self.flushed + 1 if self.flushes else None

    async def send_flushes(self, ids: list[int]) -> None:
        for fid in ids:
            self.flushed = max(self.flushed, fid)
            await self.sock.send(flush_done(self.cid, fid))

    async def run(self) -> None:
        sock, rate = self.sock, self.speech.sample_rate
        spans: dict[int, tuple[int, str]] = {}
        offset_ms = 0.0
        last = time.monotonic()
        events = self.speech.events()
        try:
            async for event in events:
                if isinstance(event, Audio):
                    data = self.encoder.encode(event.samples)
                    if data:
                        now = time.monotonic()
                        await sock.send(chunk(self.cid, b64(data), (now - last) * 1000,
                                              self._flush_id()))
                        last = now
                elif isinstance(event, SegmentStarted):
                    spans[event.index] = (event.end, event.text)
                elif isinstance(event, SegmentDone):
                    end, text = spans.pop(event.index, (0, ""))
                    if self.add_timestamps:
                        words, start, stop = word_times(text, event.timings, offset_ms)
                        if words:
                            await sock.send(timestamps(self.cid, words, start, stop,
                                                       self._flush_id()))
                    offset_ms += event.samples * 1000 / rate
                    await self.send_flushes(self.marks.segment_done(end))
                elif isinstance(event, SegmentFailed):
                    err = event.error
                    await sock.send(CartesiaError(err.message, str(err.code), status=500,
                                                  title="Generation failed").event(self.cid))
                    return
                elif isinstance(event, Done):
                    tail = self.encoder.finish()
                    if tail:
                        await sock.send(chunk(self.cid, b64(tail), 0.0, self._flush_id()))
                    await self.send_flushes(self.marks.all())
                    await sock.send(done(self.cid))
                    return
        finally:
            self.stop()
            await events.aclose()
            sock.forget(self)


class _Socket:
    """One ``/tts/websocket`` connection: the reader, and one task per context."""

    def __init__(self, endpoint: CartesiaEndpoints, ws: ServerConnection,
                 owner: str | None = None) -> None:
        self.endpoint = endpoint
        self.ws = ws
        self.owner = owner  # whose named voices this socket may use (None: shared only)
        self.account = owner  # whose usage its contexts count as (the key's owner id)
        self.contexts: dict[str, _Context] = {}
        self._tasks = OwnedTasks()
        self._closing = False

    async def run(self) -> None:
        try:
            service = self.endpoint.service
            if service.rejecting:
                service.stats.rejected += 1
                raise _overloaded(f"server overloaded ({service.governor.reason}); retry later")
            await self._reader()
        except CartesiaError as exc:
            with contextlib.suppress(ConnectionClosed):
                await self.send(exc.event(None))
            await self.close(CLOSE_TRY_AGAIN_LATER, exc.error_code)
        except ConnectionClosed:
            pass
        finally:
            for ctx in list(self.contexts.values()):
                ctx.stop()
            await self._tasks.cancel_all()
            self.contexts.clear()

    async def close(self, code: int, reason: str = "") -> None:
        if self._closing:
            return
        self._closing = True
        await close_within(self.ws, code, reason,
                           self.endpoint.service.config.close_timeout_s)

    async def send(self, message: dict[str, Any]) -> None:
        await send_within(self.ws, orjson.dumps(message).decode(),
                          self.endpoint.service.config.slow_client_timeout_s, logger,
                          "cartesia socket")
        if message.get("type") == "chunk":
            self.endpoint.service.stats.frames_sent += 1

    async def _reader(self) -> None:
        limits = self.endpoint.service.config.limits
        while not self._closing:
            idle = self.endpoint.service.config.idle_timeout_s
            raw = await receive_unless_idle(self.ws, None if self.contexts else idle)
            if raw is None:  # nothing sent and nothing playing: free the slot
                await self.close(CLOSE_NORMAL, "idle")
                return
            try:
                gen = parse_message(raw, max_text_chars=limits.max_text_chars_per_message)
            except CartesiaError as exc:
                self.endpoint.service.stats.protocol_errors += 1
                await self.send(exc.event(_peek_context(raw)))
                continue
            cid = gen.context_id
            try:
                await self._apply(gen)
            except CartesiaError as exc:
                self.endpoint.service.stats.protocol_errors += 1
                ctx = self.contexts.pop(cid, None) if cid is not None else None
                if ctx is not None:  # the context is failed: nothing more comes for it
                    ctx.stop()
                    if ctx.task is not None:
                        ctx.task.cancel()
                await self.send(exc.event(cid))

    async def _apply(self, gen: Generation) -> None:
        if gen.cancel:
            assert gen.context_id is not None
            ctx = self.contexts.pop(gen.context_id, None)
            if ctx is not None:
                self.endpoint.service.stats.cancels += 1
                ctx.stop()
                if ctx.task is not None:
                    ctx.task.cancel()
            return
        cid = gen.context_id or uuid.uuid4().hex
        ctx = self.contexts.get(cid)
        if ctx is None:
            if not gen.transcript.strip() and not gen.cont:
                # nothing to say and nothing to follow (pipecat's flush of an idle context)
                await self.send(done(cid))
                return
            ctx = self._open(cid, gen)
        elif ctx.ended:
            raise CartesiaError(f"context {cid[:64]!r} has ended (continue was false); use a "
                                "new context_id", "context_closed")
        await ctx.send_flushes(ctx.apply(gen))

    def _open(self, cid: str, gen: Generation) -> _Context:
        service = self.endpoint.service
        limit = service.config.limits.max_contexts
        if len(self.contexts) >= limit:
            raise CartesiaError(f"at most {limit} contexts at once on one socket; wait for a "
                                "context's done or cancel one", "too_many_contexts",
                                status=429, title="Too many requests")
        if gen.output_format is None:
            raise CartesiaError("output_format is required in a context's first request",
                                "output_format_required")
        try:
            service.check_admission()
        except RttsError as exc:
            raise _overloaded(exc.message) from None
        params = params_for(gen, service, self.owner)
        ctx = _Context(self, cid, gen, params)
        self.contexts[cid] = ctx
        ctx.task = self._tasks.spawn(self._run_context(ctx), f"rtts-cartesia-{cid[:32]}")
        return ctx

    async def _run_context(self, ctx: _Context) -> None:
        try:
            await ctx.run()
        except ConnectionClosed:
            pass
        except Exception as exc:  # a bug ends this context only; the socket goes on
            error = InternalError.incident(logger, f"cartesia context {ctx.cid[:64]!r}", exc)
            with contextlib.suppress(ConnectionClosed):
                await self.send(CartesiaError(error.message, "internal_error", status=500,
                                              title="Internal error").event(ctx.cid))
        finally:
            self.endpoint.service.activity.set()

    def forget(self, ctx: _Context) -> None:
        if self.contexts.get(ctx.cid) is ctx:
            del self.contexts[ctx.cid]


def _peek_context(raw: str | bytes) -> str | None:
    if isinstance(raw, bytes):
        return None
    with contextlib.suppress(orjson.JSONDecodeError):
        obj = orjson.loads(raw)
        if isinstance(obj, dict) and isinstance(obj.get("context_id"), str):
            return str(obj["context_id"])[:256]
    return None


class CartesiaEndpoints:
    """The Cartesia-compatible socket (handshake + handler) and HTTP route."""

    def __init__(self, service: Service, auth: Authenticator,
                 admission: WsAdmission | None = None) -> None:
        self.service = service
        self.auth = auth
        self.admission = admission  # None on an HTTP-only instance
        self.sockets: OpenSockets[_Socket] = OpenSockets()

    # -- WebSocket

    def process_request(self, connection: ServerConnection, request: WsRequest
                        ) -> WsResponse | None:
        if request.path.split("?", 1)[0] != PATH:
            return respond(404, f"not found: the Cartesia socket is {PATH}\n")
        assert self.admission is not None
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
        key = (request.headers.get("X-API-Key") or _first(query, "api_key")
               or _first(query, "access_token"))
        return self.admission.handshake(connection, request, key=key)

    async def handle(self, ws: ServerConnection) -> None:
        assert self.admission is not None
        async with self.admission.session(ws) as principal:
            if principal is None:
                return
            owner = self.auth.owner(principal.kid) if principal.kid else None
            await self.sockets.serve(_Socket(self, ws, owner), self.service)

    def busy(self) -> int:
        return sum(1 for s in self.sockets if s.contexts)

    async def close_all(self) -> None:
        await self.sockets.close_all()

    # -- HTTP

    def routes(self) -> list[Route]:
        return [Route("/tts/bytes", self.bytes, methods=["POST"]),
                Route("/tts/sse", self.sse, methods=["POST"])]

    async def bytes(self, request: Request) -> Response:
        return await self._answer(request, sse=False)

    async def sse(self, request: Request) -> Response:
        return await self._answer(request, sse=True)

    async def _answer(self, request: Request, sse: bool) -> Response:
        try:
            return await self._bytes(request, sse)
        except ApiError as exc:
            err = CartesiaError(exc.message, exc.code or "error", status=exc.status,
                                title="Request failed")
            return _http_error(err, exc.headers)
        except CartesiaError as exc:
            return _http_error(exc, {})

    async def _bytes(self, request: Request, sse: bool) -> Response:
        service = self.service
        requests: list[Generation] = []

        async def parse(owner: str | None) -> SpeechRequest:
            raw = await read_body(request, service.config.max_message_bytes,
                                  service.config.http_read_timeout_s)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise CartesiaError("the request body is not valid JSON") from None
            gen = parse_request(body, max_text_chars=MAX_HTTP_CHARS, http=True)
            if gen.cancel or not gen.transcript.strip():
                raise CartesiaError("transcript is required: a non-empty string",
                                    "transcript_required")
            fmt = gen.output_format
            if fmt is None:
                raise CartesiaError("output_format is required", "output_format_required")
            if sse and fmt.container != "raw":
                raise CartesiaError("/tts/sse sends raw audio: output_format.container raw",
                                    "invalid_output_format")
            requests.append(gen)
            return SpeechRequest(gen.transcript, params_for(gen, service, owner), fmt.container,
                                 fmt.sample_rate, fmt.bit_rate,
                                 encoder=lambda rate: encoder_for(fmt, rate))

        body = await speak(service, self.auth, request, parse,
                           key=request.headers.get("x-api-key"))
        gen = requests[0]
        if sse:
            return body.response(_sse(body, gen), media_type="text/event-stream")
        assert gen.output_format is not None
        container = gen.output_format.container
        codec = codec_for("mp3" if container == "mp3" else "wav")
        media = (codec.media_type if codec is not None and container != "raw"
                 else "application/octet-stream")
        return body.response(media_type=media)


async def _sse(stream: SpeechBody, gen: Generation) -> AsyncIterator[bytes]:
    """``/tts/sse``: the socket's messages for one context, as Server-Sent Events."""
    cid = gen.context_id or uuid.uuid4().hex
    rate = stream.ctx.sample_rate
    texts: dict[int, str] = {}
    offset_ms = 0.0
    last = time.monotonic()
    try:
        async for event in stream.events():
            if isinstance(event, Audio):
                data = stream.encoder.encode(event.samples)
                if data:
                    now = time.monotonic()
                    yield _event(chunk(cid, b64(data), (now - last) * 1000, None))
                    last = now
            elif isinstance(event, SegmentStarted):
                texts[event.index] = event.text
            elif isinstance(event, SegmentDone):
                text = texts.pop(event.index, "")
                if gen.add_timestamps:
                    words, start, stop = word_times(text, event.timings, offset_ms)
                    if words:
                        yield _event(timestamps(cid, words, start, stop, None))
                offset_ms += event.samples * 1000 / rate
            elif isinstance(event, SegmentFailed):
                err = event.error
                yield _event(CartesiaError(err.message, str(err.code), status=500,
                                           title="Generation failed").event(cid))
                return
        tail = stream.encoder.finish()
        if tail:
            yield _event(chunk(cid, b64(tail), 0.0, None))
        yield _event(done(cid))
    finally:
        await stream.aclose()


def _event(message: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(message) + b"\n\n"


def _first(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[0] if values else None


def _http_error(exc: CartesiaError, headers: dict[str, str]) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status,
                        headers={"Cache-Control": "no-store", **headers})
