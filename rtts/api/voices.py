"""Named voices over HTTP: ``GET /v1/voices``, ``POST /v1/voices``, ``GET`` and
``DELETE /v1/voices/{name}`` (the registry itself is :mod:`rtts.core.voices`).

``POST`` takes ``{"name", "seed": N}`` or ``{"name", "speaker": "<ChatTTS speaker string>"}``
and optional ``"params"`` (``temperature``, ``top_P``, ``top_K``, ``speed``, ``seed``,
``refine``: defaults for requests using the voice); 201 with the voice, 409 when the name
exists or is built in, 400 (OpenAI-shaped error body) on bad input. Auth as every other
API route: a key or token when the server has keys.

With keys, voices are the key's own (see :mod:`rtts.core.voices`): a key lists, uses and
deletes its voices and the shared ones, never another key's; the shared namespace is
read-only over the API (403). ``POST`` and ``DELETE`` count against the key's per-minute
session quota (``--sessions-per-minute``), and a key holds at most ``max_voices_per_key``.
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtts.api.auth import Authenticator
from rtts.api.http.common import ApiError, authorize, read_body
from rtts.core.params import SynthParams
from rtts.core.service import Service
from rtts.core.voicenames import OPENAI_VOICES
from rtts.core.voices import VoiceError

__all__ = ["VOICES_OPENAPI", "VoiceEndpoints"]


class VoiceEndpoints:
    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth

    def routes(self) -> list[Route]:
        return [
            Route("/v1/voices", self.collection, methods=["GET", "POST"]),
            Route("/v1/voices/{name}", self.item, methods=["GET", "DELETE"]),
        ]

    async def collection(self, request: Request) -> Response:
        return await (self.create(request) if request.method == "POST" else self.list(request))

    async def item(self, request: Request) -> Response:
        return await (self.delete(request) if request.method == "DELETE" else self.get(request))

    def _auth(self, request: Request) -> str | None:
        """Authorize a read; the key's owner id (None: auth is off, all voices shared)."""
        if self.auth.enabled:
            return self._owner(authorize(self.auth, self.service, request, admit=False))
        return None

    def _owner(self, kid: str) -> str | None:
        owner = self.auth.owner(kid)
        if self.auth.enabled and owner is None:  # never write the shared namespace by accident
            raise ApiError(403, "this key owns no voices", code="forbidden")
        return owner

    def _admit(self, request: Request) -> str:
        """Authorize a write: counted in the key's per-minute quota (released at once)."""
        kid = authorize(self.auth, self.service, request)
        self.auth.release(kid)
        return kid

    async def list(self, request: Request) -> Response:
        owner = self._auth(request)
        return JSONResponse({"voices": [v.describe() for v in self.service.voices.list(owner)]})

    async def get(self, request: Request) -> Response:
        owner = self._auth(request)
        name = request.path_params["name"]
        voice = self.service.voices.get(name, owner)
        if voice is None:
            raise ApiError(404, f"no voice named {name[:64]!r}", param="name",
                           code="voice_not_found")
        return JSONResponse(voice.describe())

    async def create(self, request: Request) -> Response:
        owner = self._owner(self._admit(request))
        raw = await read_body(request, self.service.config.max_message_bytes)
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ApiError(400, "the request body is not valid JSON",
                           code="invalid_json") from None
        if isinstance(body, dict) and isinstance(body.get("name"), str) and \
                body["name"] in OPENAI_VOICES:
            raise ApiError(409, f"{body['name']!r} is a built-in (OpenAI) voice name",
                           param="name", code="voice_exists")
        try:
            voice = self.service.voices.create(
                body, validate=lambda speaker: self._validate_speaker(speaker, owner),
                owner=owner)
        except VoiceError as exc:
            raise _api_error(exc) from None
        return Response(orjson.dumps(voice.describe()), status_code=201,
                        media_type="application/json",
                        headers={"Location": f"/v1/voices/{voice.name}"})

    async def delete(self, request: Request) -> Response:
        owner = self._owner(self._admit(request))
        name = request.path_params["name"]
        if name in OPENAI_VOICES:
            raise ApiError(403, f"{name!r} is a built-in (OpenAI) voice; it cannot be deleted",
                           param="name", code="builtin_voice")
        try:
            self.service.voices.delete(name, owner)
        except VoiceError as exc:
            raise _api_error(exc) from None
        return Response(status_code=204)

    def _validate_speaker(self, speaker: str, owner: str | None) -> None:
        """The engine's own check (decodable, the model's dimension)."""
        self.service.validate_params(SynthParams(voice=speaker), owner)


def _api_error(exc: VoiceError) -> ApiError:
    code = exc.api_code or {400: "invalid_value", 403: "builtin_voice", 404: "voice_not_found",
                            409: "voice_exists"}.get(exc.status)
    if exc.status >= 500:
        return ApiError(exc.status, exc.message, type="server_error", code="storage_error")
    return ApiError(exc.status, exc.message, param=exc.param, code=code)


_ERR: Final = {"description": "error", "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/Error"}}}}
VOICES_OPENAPI: Final[dict[str, Any]] = {
    "/v1/voices": {
        "get": {"summary": "named voices (built-in and stored)",
                "responses": {"200": {"description": "voices"}}},
        "post": {"summary": "create a named voice from a seed or a ChatTTS speaker string",
                 "requestBody": {"required": True, "content": {"application/json": {
                     "schema": {"type": "object", "required": ["name"], "properties": {
                         "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,63}$"},
                         "seed": {"type": "integer", "minimum": 0},
                         "speaker": {"type": "string"},
                         "params": {"type": "object"}}}}}},
                 "responses": {"201": {"description": "created"}, "400": _ERR,
                               "409": _ERR}}},
    "/v1/voices/{name}": {
        "parameters": [{"name": "name", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "get": {"summary": "one named voice", "responses": {"200": {"description": "voice"},
                                                             "404": _ERR}},
        "delete": {"summary": "delete a stored voice",
                   "responses": {"204": {"description": "deleted"}, "403": _ERR,
                                 "404": _ERR}}},
}
