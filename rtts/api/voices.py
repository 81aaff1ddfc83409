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

**Voices from a clip.** ``POST /v1/voices`` also takes ``{"name", "audio": <base64>,
"transcript"}`` (JSON) or a ``multipart/form-data`` form with ``name``, ``transcript`` and
an ``audio`` file; ``POST /v1/voices/add`` is ElevenLabs' form (``name``, ``files``,
``description``, ``labels``; rtts adds ``transcript``) and answers ``{"voice_id"}``. The
clip (any format PyAV decodes, at most ``MAX_CLIP_BYTES`` and ``MAX_SAMPLE_SECONDS``) is
decoded, resampled to 24 kHz and encoded by the engine (ChatTTS's DVAE encoder) off the
event loop; the voice stores the codes and the transcript. Bad audio is a 400 and nothing
is stored.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtts.api.auth import Authenticator
from rtts.api.http.common import ApiError, authorize, read_body
from rtts.core.params import MAX_SAMPLE_TEXT_CHARS, SynthParams
from rtts.core.service import MAX_CLIP_BYTES, Service
from rtts.core.voicenames import OPENAI_VOICES
from rtts.core.voices import Voice, VoiceError, check_name, parse_params, sample_json

# an upload's body: the clip (base64 in JSON: 4/3 of it) and a few small fields
MAX_UPLOAD_BYTES: Final = MAX_CLIP_BYTES * 4 // 3 + 65536

__all__ = ["VOICES_OPENAPI", "VoiceEndpoints"]


class VoiceEndpoints:
    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth

    def routes(self) -> list[Route]:
        return [
            Route("/v1/voices", self.collection, methods=["GET", "POST"]),
            Route("/v1/voices/add", self.add, methods=["POST"]),
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
        if _is_form(request):
            form = await _form(request, self.service.config.http_read_timeout_s)
            voice = await self._from_clip(owner, form.get("name"), _file(form, "audio"),
                                          form.get("transcript", ""), None)
            return _created(voice)
        raw = await read_body(request, MAX_UPLOAD_BYTES,
                              self.service.config.http_read_timeout_s)
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ApiError(400, "the request body is not valid JSON",
                           code="invalid_json") from None
        if isinstance(body, dict) and "audio" in body:
            extra = set(body) - {"name", "audio", "transcript", "params"}
            if extra:
                raise ApiError(400, f"unknown fields {', '.join(sorted(map(str, extra)))}",
                               code="invalid_value")
            audio = body["audio"]
            if not isinstance(audio, str):
                raise ApiError(400, "audio must be a base64 string", param="audio",
                               code="invalid_value")
            try:
                clip = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, "audio is not valid base64", param="audio",
                               code="invalid_value") from None
            voice = await self._from_clip(owner, body.get("name"), clip,
                                          body.get("transcript", ""), body.get("params"))
            return _created(voice)
        if len(raw) > self.service.config.max_message_bytes:
            raise ApiError(413, "request body larger than "
                           f"{self.service.config.max_message_bytes} bytes",
                           code="body_too_large")
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
        return _created(voice)

    async def add(self, request: Request) -> Response:
        """ElevenLabs' ``POST /v1/voices/add`` (instant voice cloning): ``name``, ``files``
        (the first is used), ``description`` and ``labels`` (accepted), and rtts's
        ``transcript`` (what the clip says: the sample conditions far better with it)."""
        owner = self._owner(self._admit(request))
        if not _is_form(request):
            raise ApiError(400, "send a multipart/form-data form", code="invalid_value")
        form = await _form(request, self.service.config.http_read_timeout_s)
        title = form.get("name")
        if not isinstance(title, str) or not title.strip():
            raise ApiError(400, "name is required", param="name", code="invalid_value")
        slug = re.sub(r"[^a-z0-9_-]+", "-", title.strip().lower()).strip("-_")[:48] or "voice"
        name = f"{slug}-{uuid.uuid4().hex[:8]}"
        voice = await self._from_clip(owner, name, _file(form, "files"),
                                      form.get("transcript", ""), None)
        return JSONResponse({"voice_id": voice.name, "requires_verification": False})

    async def _from_clip(self, owner: str | None, name: Any, clip: bytes, transcript: Any,
                         params: Any) -> Voice:
        store = self.service.voices
        try:
            name = check_name(name)
            if name in OPENAI_VOICES:
                raise VoiceError(f"{name!r} is a built-in (OpenAI) voice name", status=409,
                                 param="name", api_code="voice_exists")
            if not isinstance(transcript, str) or len(transcript) > MAX_SAMPLE_TEXT_CHARS:
                raise VoiceError(f"transcript must be a string of at most "
                                 f"{MAX_SAMPLE_TEXT_CHARS} characters", param="transcript")
            parsed = parse_params(params)
            store.check_new(name, owner)  # before the costly decode and encode
            sample = await self.service.sample_from_clip(clip, transcript.strip())
            return store.create({"name": name, "sample": sample_json(sample),
                                 "params": parsed}, owner=owner)
        except VoiceError as exc:
            raise _api_error(exc) from None

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


def _created(voice: Voice) -> Response:
    return Response(orjson.dumps(voice.describe()), status_code=201,
                    media_type="application/json",
                    headers={"Location": f"/v1/voices/{voice.name}"})


def _is_form(request: Request) -> bool:
    return request.headers.get("content-type", "").startswith("multipart/form-data")


async def _form(request: Request, timeout_s: float) -> dict[str, Any]:
    """A multipart form read with its whole body bounded first (:data:`MAX_UPLOAD_BYTES`):
    text fields as str, files as bytes (the first of each name)."""
    from starlette.datastructures import UploadFile

    raw = await read_body(request, MAX_UPLOAD_BYTES, timeout_s)
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    replay = Request(request.scope, receive)
    try:
        form = await replay.form(max_files=8, max_fields=32)
    except Exception as exc:  # malformed multipart: python-multipart's or starlette's error
        raise ApiError(400, f"the form could not be read: {exc}"[:200],
                       code="invalid_value") from None
    out: dict[str, Any] = {}
    try:
        for key, value in form.multi_items():
            if key in out:
                continue
            out[key] = await value.read() if isinstance(value, UploadFile) else value
    finally:
        await form.close()
    return out


def _file(form: dict[str, Any], key: str) -> bytes:
    value = form.get(key)
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or not value:
        raise ApiError(400, f"{key} must be an audio file", param=key, code="invalid_value")
    return value


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
        "post": {"summary": "create a named voice from a seed, a ChatTTS speaker string, a "
                            "sample, or an audio clip and its transcript",
                 "requestBody": {"required": True, "content": {
                     "application/json": {"schema": {
                         "type": "object", "required": ["name"], "properties": {
                             "name": {"type": "string",
                                      "pattern": "^[a-z0-9][a-z0-9_-]{0,63}$"},
                             "seed": {"type": "integer", "minimum": 0},
                             "speaker": {"type": "string"},
                             "sample": {"type": "object", "properties": {
                                 "codes": {"type": "string"}, "text": {"type": "string"}}},
                             "audio": {"type": "string", "format": "byte",
                                       "description": "a clip (any common format), base64"},
                             "transcript": {"type": "string", "maxLength": 400},
                             "params": {"type": "object"}}}},
                     "multipart/form-data": {"schema": {
                         "type": "object", "required": ["name", "audio"], "properties": {
                             "name": {"type": "string"},
                             "transcript": {"type": "string"},
                             "audio": {"type": "string", "format": "binary"}}}}}},
                 "responses": {"201": {"description": "created"}, "400": _ERR,
                               "409": _ERR, "413": _ERR}}},
    "/v1/voices/add": {
        "post": {"summary": "ElevenLabs' instant voice cloning: a voice from a clip",
                 "requestBody": {"required": True, "content": {"multipart/form-data": {
                     "schema": {"type": "object", "required": ["name", "files"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "files": {"type": "array", "items": {
                                        "type": "string", "format": "binary"}},
                                    "description": {"type": "string"},
                                    "labels": {"type": "string"},
                                    "transcript": {"type": "string"}}}}}},
                 "responses": {"200": {"description": "{voice_id}"}, "400": _ERR,
                               "409": _ERR, "413": _ERR}}},
    "/v1/voices/{name}": {
        "parameters": [{"name": "name", "in": "path", "required": True,
                        "schema": {"type": "string"}}],
        "get": {"summary": "one named voice", "responses": {"200": {"description": "voice"},
                                                             "404": _ERR}},
        "delete": {"summary": "delete a stored voice",
                   "responses": {"204": {"description": "deleted"}, "403": _ERR,
                                 "404": _ERR}}},
}
