"""The HTTP app (ASGI, Starlette): routes, CORS, health/ready/metrics, static files, OpenAPI.

Protocol front-ends each live in their own module and only call the core:
:mod:`rtts.api.native.connection` (``/v1/stream``, WebSocket), :mod:`rtts.api.rest` (``/v1/tts``,
``/v1/token``, ``/v1/info``, ``/v1/formats``) and :mod:`rtts.api.openai`
(``/v1/audio/speech``, ``/v1/models``, ``/v1/audio/models``, ``/v1/audio/voices``) and
:mod:`rtts.api.elevenlabs` (``/v1/text-to-speech/{voice_id}…``), :mod:`rtts.api.cartesia`
(``/tts/bytes``, ``/tts/sse``) and :mod:`rtts.api.deepgram` (``POST /v1/speak``, ``/v2/speak``).
"""

from __future__ import annotations

import logging
import mimetypes
import re
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rtts import __version__
from rtts.api.admin import AdminEndpoints
from rtts.api.auth import Authenticator
from rtts.api.cartesia.endpoint import CartesiaEndpoints
from rtts.api.deepgram.endpoint import DeepgramEndpoints
from rtts.api.elevenlabs import ElevenLabsEndpoints
from rtts.api.http.common import ApiError, api_error_response
from rtts.api.jobs import JOBS_OPENAPI, JobEndpoints
from rtts.api.openai import MAX_INPUT_CHARS, OPENAI_FORMATS, VOICES, OpenAIEndpoints
from rtts.api.rest import RestEndpoints
from rtts.api.voices import VOICES_OPENAPI, VoiceEndpoints
from rtts.core.service import Service, State
from rtts.jobs.store import JobStore
from rtts.metrics import render_metrics

__all__ = ["build_http_app", "openapi_schema"]

logger = logging.getLogger("rtts.api.handshake")

_NO_STORE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def build_http_app(service: Service, auth: Authenticator,
                   jobs: JobStore | None = None) -> Starlette:
    config = service.config
    schema = openapi_schema(service)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n", headers=_NO_STORE)

    async def readyz(request: Request) -> Response:
        ok = service.state == State.READY
        return PlainTextResponse(f"{service.state_reason}\n", status_code=200 if ok else 503,
                                 headers=_NO_STORE)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(render_metrics(service), headers=_NO_STORE,
                                 media_type="text/plain; version=0.0.4")

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    async def stream_without_upgrade(request: Request) -> Response:
        return PlainTextResponse("this path speaks WebSocket\n", status_code=400,
                                 headers=_NO_STORE)

    async def static(request: Request) -> Response:
        allowed = api_methods.get(request.url.path)
        if allowed is not None:  # an API path asked with another method
            raise ApiError(405, f"{request.method} is not allowed here; use "
                                f"{', '.join(sorted(allowed))}", code="method_not_allowed",
                           headers={"Allow": ", ".join(sorted(allowed))})
        if request.method not in ("GET", "HEAD"):
            return PlainTextResponse("method not allowed\n", status_code=405,
                                     headers={**_NO_STORE, "Allow": "GET, HEAD"})
        resp = static_file(config.web_dir, request.url.path, head=request.method == "HEAD")
        return resp or _not_found(request)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return api_error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if request.url.path.startswith("/v1/"):
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            return api_error_response(ApiError(exc.status_code, str(exc.detail), type=kind,
                                               headers=dict(exc.headers or {})))
        return PlainTextResponse(f"{exc.detail}\n", status_code=exc.status_code,
                                 headers=dict(exc.headers or {}))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        return Response(status_code=400)  # gone while sending its body: nobody to tell

    async def on_error(request: Request, exc: Exception) -> Response:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return api_error_response(ApiError(500, "internal server error", type="server_error",
                                           code="internal_error"))

    eleven = ElevenLabsEndpoints(service, auth)
    api_routes = [*RestEndpoints(service, auth).routes(), *OpenAIEndpoints(service, auth).routes(),
                  *VoiceEndpoints(service, auth).routes(),
                  *eleven.routes(),
                  *CartesiaEndpoints(service, auth).routes(),
                  *DeepgramEndpoints(service, auth).routes(),
                  *AdminEndpoints(service, auth).routes(),
                  *(JobEndpoints(service, auth, jobs).routes() if jobs is not None else [])]
    # /v1/voices and /v1/models are rtts's (or OpenAI's) and ElevenLabs' paths: a GET with
    # ElevenLabs' key header gets ElevenLabs' shapes
    eleven_gets = eleven.listing()
    api_routes = [Route(r.path, _by_protocol(eleven_gets[r.path], r.endpoint),
                        methods=list(r.methods or ())) if r.path in eleven_gets else r
                  for r in api_routes]
    api_methods = {r.path: set(r.methods or ()) - {"HEAD"} for r in api_routes
                   if "{" not in r.path}
    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route(config.ws_path, stream_without_upgrade),
        *api_routes,
        Route("/{path:path}", static, methods=["GET", "HEAD", "POST", "PUT", "DELETE",
                                               "PATCH", "OPTIONS"]),
    ]
    origins = list(config.auth.allowed_origins) or ["*"]
    middleware = [Middleware(RequestId), Middleware(
        CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["*"], expose_headers=["X-Sample-Rate", "Retry-After", "X-Request-Id"],
        max_age=600)]
    return Starlette(routes=routes, middleware=middleware, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, ClientDisconnect: on_disconnect,
        Exception: on_error})


def _by_protocol(eleven: Any, other: Any) -> Any:
    async def endpoint(request: Request) -> Response:
        if request.method == "GET" and "xi-api-key" in request.headers:
            response: Response = await eleven(request)
        else:
            response = await other(request)
        return response

    return endpoint


_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}$")


class RequestId:
    """``X-Request-Id`` on every response: the client's own (when it is a short token), else
    a fresh one, so a client's logs and the server's name the same request (LiveKit's
    plugins log it with every error and warn when it is missing)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = b""
        for name, value in scope.get("headers") or ():
            if name == b"x-request-id":
                rid = value if _REQUEST_ID.match(value) else b""
                break
        rid = rid or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _not_found(request: Request) -> Response:
    if request.url.path.startswith("/v1/"):
        return api_error_response(ApiError(404, f"no such endpoint: {request.url.path}",
                                           code="not_found"))
    return PlainTextResponse("not found\n", status_code=404, headers=_NO_STORE)


# What the web directory publishes: the demo, the JS library and its types. Never dotfiles
# (``.env``), the library's own tests, or its npm/TypeScript build files.
_HIDDEN_PARTS = frozenset({"test", "tests", "node_modules"})
_HIDDEN_FILES = frozenset({"package.json", "package-lock.json", "tsconfig.json"})
_MEDIA_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".ts": "text/plain",
                ".map": "application/json", ".css": "text/css", ".html": "text/html",
                ".json": "application/json", ".svg": "image/svg+xml", ".wasm": "application/wasm"}
# The demo loads only its own scripts and styles and talks to any rtts server the user
# types in; nothing may frame it.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; media-src 'self' blob: data:; "
                               "connect-src 'self' ws: wss: http: https:; worker-src 'self' blob:; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_MAX_NAME = 255


def published(rel: str) -> bool:
    """Whether a path under the web directory is one it publishes (pure)."""
    parts = [p for p in rel.split("/") if p]
    if any(p.startswith(".") or p in _HIDDEN_PARTS or len(p) > _MAX_NAME for p in parts):
        return False
    return not parts or parts[-1] not in _HIDDEN_FILES


def static_file(web_dir: Path | None, path: str, head: bool = False) -> Response | None:
    """Serve ``path`` from ``web_dir``; None when it is not a published file there (no
    traversal, no dotfiles or build files; odd names are just not found, never a 500)."""
    if web_dir is None:
        return None
    rel = path.lstrip("/") or "index.html"
    if "\0" in rel or not published(rel):
        return None
    try:
        root = web_dir.resolve()
        target = (root / rel).resolve()
        if root not in target.parents and target != root:
            return None
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file() or not published(str(target.relative_to(root))):
            return None
        body = b"" if head else target.read_bytes()
        size = target.stat().st_size
    except (OSError, ValueError):
        return None
    ctype = (_MEDIA_TYPES.get(target.suffix) or mimetypes.guess_type(target.name)[0]
             or "application/octet-stream")
    if ctype.startswith("text/") or ctype == "application/json":
        ctype += "; charset=utf-8"
    headers = {**_NO_STORE, **(_PAGE_HEADERS if target.suffix == ".html" else {})}
    resp = Response(body, media_type=ctype, headers=headers)
    resp.headers["Content-Length"] = str(size)
    return resp


def openapi_schema(service: Service) -> dict[str, Any]:
    """A hand-written OpenAPI 3.1 description of the HTTP surface."""
    err = {"$ref": "#/components/schemas/Error"}
    audio = {"description": "audio, streamed as it is made",
             "content": {"audio/mpeg": {}, "audio/ogg": {}, "audio/aac": {}, "audio/flac": {},
                         "audio/wav": {}, "audio/pcm": {}, "text/event-stream": {}}}
    errors = {str(s): {"description": d, "content": {"application/json": {"schema": err}}}
              for s, d in ((400, "bad input"), (401, "missing or invalid key"),
                           (429, "quota or queue full (Retry-After)"),
                           (503, "not ready or overloaded (Retry-After)"))}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rtts", "version": __version__,
                 "description": "Real-time streaming TTS. The native protocol is a WebSocket "
                                f"on {service.config.ws_path} (see the README)."},
        "paths": {
            "/v1/audio/speech": {"post": {
                "summary": "OpenAI-compatible speech (streamed)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/SpeechRequest"}}}},
                "responses": {"200": audio, **errors}}},
            "/v1/models": {"get": {"summary": "OpenAI model list",
                                   "responses": {"200": {"description": "models"}}}},
            "/v1/audio/models": {"get": {"summary": "speech models (Open WebUI)",
                                         "responses": {"200": {"description": "models"}}}},
            "/v1/audio/voices": {"get": {"summary": "voices (Open WebUI)",
                                         "responses": {"200": {"description": "voices"}}}},
            "/v1/tts": {"get": {"summary": "text in the query, audio out (streamed)",
                                "parameters": [{"name": n, "in": "query",
                                                "required": n == "text",
                                                "schema": {"type": "string"}}
                                               for n in ("text", "voice", "seed",
                                                         "sample_rate", "format", "ssml")],
                                "responses": {"200": audio, **errors}}},
            **VOICES_OPENAPI,
            **(JOBS_OPENAPI if service.config.jobs.redis_url else {}),
            **{f"/v1/text-to-speech/{{voice_id}}{tail}": {"post": {
                "summary": f"ElevenLabs-compatible speech{what}",
                "parameters": [{"name": "voice_id", "in": "path", "required": True,
                                "schema": {"type": "string"}},
                               {"name": "output_format", "in": "query",
                                "schema": {"type": "string", "default": "mp3_44100_128"}},
                               {"name": "enable_ssml_parsing", "in": "query",
                                "schema": {"type": "boolean", "default": False}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"type": "object", "required": ["text"], "properties": {
                        "text": {"type": "string"}, "voice_settings": {"type": "object"},
                        "apply_text_normalization": {"type": "string"}}}}}},
                "responses": {"200": {"description": "streamed" + what}}}}
               for tail, what in (("", ""), ("/stream", " (streamed)"),
                                  ("/stream/with-timestamps",
                                   ": JSON lines with audio and alignment"))},
            **{path: {"post": {
                "summary": f"Cartesia-compatible speech{what} (key in X-API-Key)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"type": "object",
                               "required": ["transcript", "voice", "output_format"],
                               "properties": {
                        "model_id": {"type": "string"}, "transcript": {"type": "string"},
                        "voice": {"type": "object", "properties": {
                            "mode": {"type": "string", "enum": ["id", "embedding"]},
                            "id": {"type": "string"}}},
                        "output_format": {"type": "object", "properties": {
                            "container": {"type": "string", "enum": ["raw", "wav", "mp3"]},
                            "encoding": {"type": "string", "enum": [
                                "pcm_s16le", "pcm_f32le", "pcm_mulaw", "pcm_alaw"]},
                            "sample_rate": {"type": "integer"},
                            "bit_rate": {"type": "integer"}}},
                        "language": {"type": "string"},
                        "generation_config": {"type": "object", "properties": {
                            "speed": {"type": "number"}}}}}}}},
                "responses": {"200": {"description": "audio, streamed"},
                              "400": {"description": "bad request (Cartesia error shape)"},
                              "404": {"description": "unknown voice"}}}}
               for path, what in (("/tts/bytes", ": raw, wav or mp3"),
                                  ("/tts/sse", ": Server-Sent Events"))},
            **{path: {"post": {
                "summary": f"Deepgram-compatible speech{what} (key as Authorization: Token)",
                "parameters": [{"name": n, "in": "query", "schema": {"type": t}}
                               for n, t in (("model", "string"), ("encoding", "string"),
                                            ("sample_rate", "integer"),
                                            ("container", "string"), ("speed", "number"),
                                            ("bit_rate", "integer"))],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"type": "object", "required": ["text"],
                               "properties": {"text": {"type": "string"}}}}}},
                "responses": {"200": {"description": "audio, streamed"},
                              "400": {"description": "bad request (Deepgram error shape)"}}}}
               for path, what in (("/v1/speak", ""), ("/v2/speak", ", Flux"))},
            "/v1/formats": {"get": {"summary": "audio formats",
                                    "responses": {"200": {"description": "formats"}}}},
            "/v1/token": {"get": {"summary": "short-lived browser token for a key",
                                  "responses": {"200": {"description": "token"}}}},
            "/v1/info": {"get": {"summary": "server, engine and state",
                                 "responses": {"200": {"description": "info"}}}},
            "/v1/usage": {"get": {"summary": "the calling key's usage: characters, audio "
                                            "seconds, contexts",
                                  "responses": {"200": {"description": "usage"},
                                                "401": {"description": "no valid key"}}}},
            "/v1/admin/drain": {
                "post": {"summary": "start the graceful drain (admin key)",
                         "responses": {"202": {"description": "draining, sessions left"},
                                       "401": {"description": "no admin key"},
                                       "403": {"description": "admin API off"}}},
                "get": {"summary": "drain status: sessions left (admin key)",
                        "responses": {"200": {"description": "status"},
                                      "401": {"description": "no admin key"},
                                      "403": {"description": "admin API off"}}}},
            "/healthz": {"get": {"summary": "liveness",
                                 "responses": {"200": {"description": "ok"}}}},
            "/readyz": {"get": {"summary": "readiness (503 while loading or draining)",
                                "responses": {"200": {"description": "ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "metrics"}}}},
        },
        "components": {"schemas": {
            "SpeechRequest": {"type": "object", "required": ["model", "input", "voice"],
                              "properties": {
                "model": {"type": "string"},
                "input": {"type": "string", "maxLength": MAX_INPUT_CHARS},
                "voice": {"oneOf": [{"type": "string", "enum": list(VOICES)},
                                    {"type": "string", "pattern": "^seed:[0-9]+$"},
                                    {"type": "object", "properties": {
                                        "id": {"type": "string"}}}]},
                "response_format": {"type": "string", "default": "mp3",
                                    "enum": [*OPENAI_FORMATS, "mulaw", "alaw", "webm"]},
                "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0, "default": 1.0},
                "instructions": {"type": "string",
                                 "description": "accepted and ignored (ChatTTS has no style "
                                                "prompt)"},
                "ssml": {"type": "boolean", "default": False,
                         "description": "rtts: input is SSML (docs/ssml.md)"},
                "stream_format": {"type": "string", "enum": ["audio", "sse"],
                                  "default": "audio"}}},
            "Error": {"type": "object", "properties": {"error": {"type": "object",
                      "properties": {"message": {"type": "string"},
                                     "type": {"type": "string"},
                                     "param": {"type": ["string", "null"]},
                                     "code": {"type": ["string", "null"]}}}}},
        }},
    }
