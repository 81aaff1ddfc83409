"""The Deepgram-compatible speak socket ``/v1/speak`` and ``POST /v1/speak`` on the core.

Handshake: the query options are checked (a bad option or an unknown ``model`` is a 400
with Deepgram's JSON error body), then the same admission as every socket on the port
(:class:`WsAdmission`: readiness, connection caps, origin, key, quotas), the key read from
``Authorization: Token KEY`` or the subprotocols ``token, KEY`` (``Bearer`` and rtts
``?token=`` work too). The server sends ``Metadata`` at once.

``/v2/speak`` (Flux, :mod:`.flux`) shares the handshake. On ``/v1/speak``, one stream per
socket: every ``Speak`` adds text to one
:class:`~rtts.core.context.SpeechContext`, cut at punctuation as it comes; ``Flush`` cuts
what is buffered and answers ``Flushed`` once that audio is sent; ``Clear`` drops
everything not yet sent (no audio of it follows) and answers ``Cleared``; ``Close`` lets the
audio of what was sent finish, then closes 1000. Audio is raw binary messages.

A bad message gets a ``Warning`` and the socket stays; overload sends an ``Error`` and
closes 1013, a failed synthesis an ``Error`` (the stream goes on; a bug in rtts ends the
stream with an ``Error`` naming an incident id the server logs, and the next ``Speak`` starts
a new one), shutdown closes 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
import uuid
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from rtts import __version__
from rtts.api.admission import WsAdmission
from rtts.api.auth import Authenticator
from rtts.api.compat import FlushMarks, RawEncoder, compat_voice
from rtts.api.deepgram.flux import FLUX_PATH, FluxSocket
from rtts.api.deepgram.protocol import (
    DeepgramError,
    SpeakOptions,
    auth_key,
    cleared,
    flushed,
    metadata,
    parse_message,
    parse_options,
)
from rtts.api.handshake import respond
from rtts.api.http.common import ApiError, read_body
from rtts.api.http.speech import SpeechRequest, speak
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

__all__ = ["FLUX_PATH", "PATH", "PATHS", "DeepgramEndpoints", "accept_subprotocol"]

logger = logging.getLogger("rtts.deepgram")

PATH: Final = "/v1/speak"
PATHS: Final = (PATH, FLUX_PATH)
MAX_HTTP_CHARS: Final = 40_960
MAX_PENDING_FLUSHES: Final = 256


def params_for(opts: SpeakOptions, service: Service, owner: str | None = None) -> SynthParams:
    """The synthesis params for ``opts``, else :class:`DeepgramError`; named voices are
    ``owner``'s (the caller's key's owner id) and the shared ones."""
    speed = 5 if opts.speed is None else speed_from_factor(opts.speed)
    try:
        voice = compat_voice(opts.model, service, owner)
        if voice is None:
            raise DeepgramError(f"unknown model {opts.model[:64]!r}: use a voice name "
                                "(GET /v1/voices), seed:N or a Deepgram model name",
                                "INVALID_MODEL")
        params = SynthParams(voice=voice, speed=speed)
        service.validate_params(params, owner)
    except ProtocolError as exc:
        raise DeepgramError(exc.message, "INVALID_MODEL") from None
    return params


def _query(path: str) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(path).query
                                                      ).items()}


def _subprotocols(value: str | None) -> list[str]:
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def accept_subprotocol(request: WsRequest, response: WsResponse) -> None:
    """Name Deepgram's ``token`` subprotocol in a ``/v1/speak`` upgrade's 101 when the
    client offered it (the key rides in the second subprotocol, as browser SDKs send it;
    a browser refuses an upgrade that does not name one of its subprotocols)."""
    if response.status_code != 101 or request.path.split("?", 1)[0] not in PATHS:
        return
    offered = _subprotocols(", ".join(request.headers.get_all("Sec-WebSocket-Protocol")))
    if offered and offered[0].lower() == "token" and "Sec-WebSocket-Protocol" not in (
            response.headers):
        response.headers["Sec-WebSocket-Protocol"] = offered[0]


def _refuse(exc: DeepgramError) -> WsResponse:
    """A refused upgrade: Deepgram's JSON error body, the reason also in ``dg-error`` (what
    pipecat reports)."""
    body = orjson.dumps(exc.body(str(uuid.uuid4())))
    reason = exc.message.encode("ascii", "replace").decode()[:200]
    return respond(exc.status, body, "application/json", extra=[("dg-error", reason)])


def _overloaded(message: str) -> DeepgramError:
    return DeepgramError(message, "TOO_MANY_REQUESTS", status=429, close=CLOSE_TRY_AGAIN_LATER,
                         fatal=True)


class _Socket:
    """One ``/v1/speak`` connection: the reader, and the task sending the stream's audio."""

    def __init__(self, endpoint: DeepgramEndpoints, ws: ServerConnection,
                 opts: SpeakOptions, params: SynthParams, owner: str | None = None) -> None:
        self.endpoint = endpoint
        self.ws = ws
        self.opts = opts
        self.params = params
        self.owner = owner  # whose named voices the stream may use (None: shared only)
        self.account = owner  # whose usage its streams count as (the key's owner id)
        self.request_id = str(uuid.uuid4())
        self.speech: Any = None  # the SpeechContext of the stream, opened by the first Speak
        self.task: asyncio.Task[None] | None = None
        self.marks = FlushMarks()
        self.flushes = 0  # Flushed sequence ids, from 0
        self.clears = 0
        self._closing = False
        self._tasks = OwnedTasks()

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    async def run(self) -> None:
        try:
            service = self.endpoint.service
            if service.rejecting:
                service.stats.rejected += 1
                raise _overloaded(f"server overloaded ({service.governor.reason}); retry later")
            model_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"rtts:{self.opts.model}"))
            await self.send(metadata(self.request_id, self.opts.model, model_uuid,
                                     __version__))
            await self._reader()
        except DeepgramError as exc:
            with contextlib.suppress(ConnectionClosed):
                await self.send(exc.event())
            await self.close(exc.close, exc.code)
        except ConnectionClosed:
            pass
        finally:
            await self._drop()
            await self._tasks.cancel_all()

    async def close(self, code: int, reason: str = "") -> None:
        if self._closing:
            return
        self._closing = True
        await close_within(self.ws, code, reason,
                           self.endpoint.service.config.close_timeout_s)

    async def send(self, message: dict[str, Any] | bytes) -> None:
        data = message if isinstance(message, bytes) else orjson.dumps(message).decode()
        await send_within(self.ws, data, self.endpoint.service.config.slow_client_timeout_s,
                          logger, "deepgram socket")
        if isinstance(message, bytes):
            self.endpoint.service.stats.frames_sent += 1

    async def _reader(self) -> None:
        limits = self.endpoint.service.config.limits
        while not self._closing:
            idle = self.endpoint.service.config.idle_timeout_s
            raw = await receive_unless_idle(self.ws, None if self.busy else idle)
            if raw is None:  # nothing sent and nothing playing: free the slot
                await self.close(CLOSE_NORMAL, "idle")
                return
            try:
                msg = parse_message(raw, max_text_chars=limits.max_text_chars_per_message)
            except DeepgramError as exc:
                self.endpoint.service.stats.protocol_errors += 1
                await self.send(exc.event())
                continue
            if msg.type == "Speak":
                self._speak(msg.text)
            elif msg.type == "Flush":
                seq = self.flushes
                self.flushes += 1
                if self.speech is None:
                    await self.send(flushed(seq))
                elif self.marks.pending >= MAX_PENDING_FLUSHES:
                    raise DeepgramError(f"more than {MAX_PENDING_FLUSHES} flushes waiting for "
                                        "their audio", "TOO_MANY_FLUSHES", fatal=True)
                else:
                    self.speech.flush()
                    for fid in self.marks.flush(seq):
                        await self.send(flushed(fid))
            elif msg.type == "Clear":
                await self._drop()
                await self.send(cleared(self.clears))
                self.clears += 1
            else:  # Close: the audio of what was sent still comes
                if self.speech is not None:
                    self.speech.end()
                    task = self.task
                    if task is not None:
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                await self.close(CLOSE_NORMAL)
                return

    def _speak(self, text: str) -> None:
        service = self.endpoint.service
        if not text:
            return
        # the cap is on text not yet spoken: a long call's stream goes on for good
        limit = service.config.limits.max_text_chars_per_context
        if self.marks.unspoken + len(text) > limit:
            raise DeepgramError(f"more than {limit} characters waiting to be spoken",
                                "TEXT_TOO_LONG", fatal=True)
        if self.speech is None:
            try:
                service.check_admission()
            except RttsError as exc:
                raise _overloaded(exc.message) from None
            self.speech = service.open_context(self.params, owner=self.owner)
            self.marks = FlushMarks()
            self.task = self._tasks.spawn(self._run_stream(self.speech), "rtts-deepgram-stream")
        self.marks.feed(text)
        self.speech.feed(text)

    async def _drop(self) -> None:
        """Stop the stream now: nothing more of it is sent."""
        speech, task = self.speech, self.task
        self.speech, self.task = None, None
        if speech is not None:
            if not speech.finished:
                self.endpoint.service.stats.cancels += 1
            speech.close()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run_stream(self, speech: Any) -> None:
        try:
            await self._stream(speech)
        except (ConnectionClosed, asyncio.CancelledError):
            pass
        except Exception as exc:  # a bug ends this stream only; a new Speak starts another
            error = InternalError.incident(logger, "deepgram stream", exc)
            if self.speech is speech:
                self.speech, self.task = None, None
            speech.close()
            with contextlib.suppress(ConnectionClosed):
                await self.send(DeepgramError(error.message, "INTERNAL_SERVER_ERROR",
                                              fatal=True).event())
        finally:
            self.endpoint.service.activity.set()

    async def _stream(self, speech: Any) -> None:
        service = self.endpoint.service
        encoder = RawEncoder(self.opts.encoding, service.sample_rate, self.opts.sample_rate)
        ends: dict[int, int] = {}
        events = speech.events()
        try:
            async for event in events:
                if isinstance(event, Audio):
                    data = encoder.encode(event.samples)
                    if data:
                        await self.send(data)
                elif isinstance(event, SegmentStarted):
                    ends[event.index] = event.end
                elif isinstance(event, SegmentDone | SegmentFailed):
                    if isinstance(event, SegmentFailed):
                        err = event.error
                        await self.send(DeepgramError(err.message, "SYNTHESIS_FAILED",
                                                      fatal=True).event())
                    for fid in self.marks.segment_done(ends.pop(event.index, 0)):
                        await self.send(flushed(fid))
                elif isinstance(event, Done):
                    tail = encoder.finish()
                    if tail:
                        await self.send(tail)
                    for fid in self.marks.all():
                        await self.send(flushed(fid))
                    return
        finally:
            speech.close()
            await events.aclose()


class DeepgramEndpoints:
    """The Deepgram-compatible socket (handshake + handler) and HTTP route."""

    def __init__(self, service: Service, auth: Authenticator,
                 admission: WsAdmission | None = None) -> None:
        self.service = service
        self.auth = auth
        self.admission = admission  # None on an HTTP-only instance
        self.sockets: OpenSockets[_Socket | FluxSocket] = OpenSockets()

    # -- WebSocket

    def process_request(self, connection: ServerConnection, request: WsRequest
                        ) -> WsResponse | None:
        if request.path.split("?", 1)[0] not in PATHS:
            return respond(404, f"not found: the Deepgram sockets are {PATH} and "
                                f"{FLUX_PATH}\n")
        assert self.admission is not None
        try:
            opts = parse_options(_query(request.path))
        except DeepgramError as exc:
            self.service.stats.protocol_errors += 1
            return _refuse(exc)
        authorization = request.headers.get("Authorization")
        protocols = _subprotocols(", ".join(request.headers.get_all("Sec-WebSocket-Protocol")))
        key = auth_key(authorization, protocols)
        token_header = bool(authorization) and authorization is not None and (
            authorization[:6].lower() == "token ")
        refused = self.admission.handshake(connection, request, key=key,
                                           header=not token_header)
        if refused is not None:
            return refused
        try:  # the model may be the key's own voice: checked once the key is known
            params_for(opts, self.service, self.admission.owner_of(connection))
        except DeepgramError as exc:
            self.service.stats.protocol_errors += 1
            return _refuse(exc)
        return None

    async def handle(self, ws: ServerConnection) -> None:
        assert self.admission is not None
        async with self.admission.session(ws) as principal:
            if principal is None:
                return
            path = ws.request.path if ws.request is not None else ""
            opts = parse_options(_query(path))
            owner = self.auth.owner(principal.kid) if principal.kid else None
            params = params_for(opts, self.service, owner)
            sock: _Socket | FluxSocket = (
                FluxSocket(self, ws, opts, params, owner) if path.split("?", 1)[0] == FLUX_PATH
                else _Socket(self, ws, opts, params, owner))
            await self.sockets.serve(sock, self.service)

    def busy(self) -> int:
        return sum(1 for s in self.sockets if s.busy)

    async def close_all(self) -> None:
        await self.sockets.close_all()

    # -- HTTP

    def routes(self) -> list[Route]:
        return [Route(PATH, self.speak, methods=["POST"]),
                Route(FLUX_PATH, self.speak, methods=["POST"])]

    async def speak(self, request: Request) -> Response:
        request_id = str(uuid.uuid4())
        try:
            return await self._speak(request, request_id)
        except ApiError as exc:
            err = DeepgramError(exc.message, (exc.code or "error").upper(), status=exc.status)
            return _http_error(err, request_id, exc.headers)
        except DeepgramError as exc:
            return _http_error(exc, request_id, {})

    async def _speak(self, request: Request, request_id: str) -> Response:
        service = self.service
        authorization = request.headers.get("authorization")
        token_header = authorization is not None and authorization[:6].lower() == "token "
        options: list[SpeakOptions] = []
        texts: list[str] = []

        async def parse(owner: str | None) -> SpeechRequest:
            opts = parse_options(dict(request.query_params), http=True)
            raw = await read_body(request, service.config.max_message_bytes,
                                  service.config.http_read_timeout_s)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise DeepgramError("the request body is not valid JSON: send {\"text\": ...}",
                                    "INVALID_BODY") from None
            text = body.get("text") if isinstance(body, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise DeepgramError("text is required: {\"text\": \"...\"}", "INVALID_BODY")
            if len(text) > MAX_HTTP_CHARS:
                raise DeepgramError(f"text is longer than {MAX_HTTP_CHARS} characters",
                                    "INVALID_BODY", status=413)
            options.append(opts)
            texts.append(text)
            return SpeechRequest(text, params_for(opts, service, owner), opts.encoding,
                                 opts.sample_rate, opts.bit_rate,
                                 encoder=lambda rate: _http_encoder(opts, rate))

        body = await speak(service, self.auth, request, parse,
                           key=auth_key(authorization, []), header=not token_header)
        opts = options[0]
        media = (body.encoder.codec.media_type if opts.container == "wav"
                 or opts.encoding != "s16" else "audio/l16")
        headers = {"dg-request-id": request_id, "dg-model-name": opts.model,
                   "dg-char-count": str(len(texts[0]))}
        return body.response(media_type=media, headers=headers)


def _http_encoder(opts: SpeakOptions, input_rate: int) -> Encoder:
    if opts.encoding in ("s16", "mulaw", "alaw"):
        if opts.encoding == "s16" and opts.container == "wav":
            return open_encoder("wav", input_rate, opts.sample_rate)
        return RawEncoder(opts.encoding, input_rate, opts.sample_rate)
    assert codec_for(opts.encoding) is not None
    return open_encoder(opts.encoding, input_rate, opts.sample_rate, opts.bit_rate)


def _http_error(exc: DeepgramError, request_id: str, headers: dict[str, str]) -> Response:
    return JSONResponse(exc.body(request_id), status_code=exc.status,
                        headers={"Cache-Control": "no-store", "dg-request-id": request_id,
                                 **headers})
