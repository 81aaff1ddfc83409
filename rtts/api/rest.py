"""rtts's own REST endpoints: ``/v1/tts``, ``/v1/token``, ``/v1/info``, ``/v1/formats``.

``GET /v1/tts?text=...&voice=...&seed=...&sample_rate=...&format=wav`` streams the audio of
``text`` (1-5000 characters) in any :mod:`rtts.audio.codecs` format (``wav`` by default, with a
streaming header), through the same core context as every other protocol. ``ssml=true``:
``text`` is SSML (:mod:`rtts.text.ssml`; bad SSML is a 400 with code ``invalid_ssml``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtts.api.auth import Authenticator, AuthError
from rtts.api.http.common import ApiError, api_error_response, auth_api_error, speech_options
from rtts.api.http.speech import SpeechRequest, speak
from rtts.audio.codecs import CODECS, Codec, codec_for
from rtts.core.params import SpeechOptions
from rtts.core.service import Service
from rtts.text.ssml import INLINE_CHARS as SSML_INLINE_CHARS
from rtts.text.ssml import Piece, SsmlError
from rtts.text.ssml import parse as parse_ssml

__all__ = ["RestEndpoints"]

MAX_TTS_CHARS: Final = 5000


class RestEndpoints:
    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth

    def routes(self) -> list[Route]:
        return [
            Route("/v1/tts", self.tts, methods=["GET"]),
            Route("/v1/token", self.token, methods=["GET", "POST"]),
            Route("/v1/info", self.info, methods=["GET"]),
            Route("/v1/formats", self.formats, methods=["GET"]),
        ]

    async def info(self, request: Request) -> Response:
        # `auth`: whether a key or token is needed (the demo asks for one)
        return JSONResponse({**self.service.info(), "auth": self.auth.enabled})

    async def formats(self, request: Request) -> Response:
        return JSONResponse({"formats": [
            {"id": c.name, "media_type": c.media_type, "sample_rate": c.fixed_rate}
            for c in CODECS.values()]})

    async def _parse_tts(self, request: Request
                         ) -> tuple[SpeechOptions, Codec, str, tuple[Piece, ...] | None]:
        query = request.query_params
        text = query.get("text") or ""
        if not text.strip() or len(text) > MAX_TTS_CHARS:
            raise ApiError(400, f"text must be 1-{MAX_TTS_CHARS} characters", param="text")
        fmt = query.get("format") or "wav"
        codec = codec_for(fmt)
        if codec is None:
            raise ApiError(400, f"format must be one of {', '.join(CODECS)}", param="format")
        msg = speech_options(self.service, query)
        ssml = (query.get("ssml") or "false").lower()
        if ssml not in ("true", "false", "1", "0"):
            raise ApiError(400, "ssml must be true or false", param="ssml")
        if ssml in ("false", "0"):
            return msg, codec, text, None
        try:
            pieces = tuple(parse_ssml(text) if len(text) <= SSML_INLINE_CHARS
                           else await asyncio.to_thread(parse_ssml, text))
        except SsmlError as exc:
            raise ApiError(400, f"invalid SSML: {exc}", param="text",
                           code="invalid_ssml") from None
        if not "".join(p.text for p in pieces).strip():
            raise ApiError(400, "the SSML says nothing", param="text", code="invalid_ssml")
        return msg, codec, "".join(p.text for p in pieces), pieces

    async def token(self, request: Request) -> Response:
        """``GET /v1/token`` with ``Authorization: Bearer <key>``: a short-lived browser token."""
        if not self.auth.enabled:
            return api_error_response(ApiError(
                404, "auth is off: no token needed (connect without one)",
                code="auth_disabled"))
        try:  # as every other HTTP endpoint: a page of a disallowed origin gets nothing
            self.auth.check_origin(request.headers.get("origin"))
        except AuthError as exc:
            self.service.stats.auth_rejected_by[exc.kind] += 1
            return api_error_response(auth_api_error(exc))
        kid = self.auth.key_from_header(request.headers.get("authorization"))
        if kid is None:
            return api_error_response(ApiError(
                401, "missing or invalid API key: send Authorization: Bearer <key>",
                type="authentication_error", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"}))
        body = {"token": self.auth.issue_token(kid, time.time()),
                "expires_in": self.auth.config.token_ttl_s}
        return Response(orjson.dumps(body), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def tts(self, request: Request) -> Response:
        fmt: list[Codec] = []

        async def parse(owner: str | None) -> SpeechRequest:
            msg, codec, text, pieces = await self._parse_tts(request)
            fmt.append(codec)
            return SpeechRequest(text, msg.params, codec.name, msg.sample_rate,
                                 normalize=msg.normalize, pieces=pieces)

        body = await speak(self.service, self.auth, request, parse)
        return body.response(media_type=fmt[0].media_type,
                             headers={"X-Sample-Rate": str(body.encoder.sample_rate)})
