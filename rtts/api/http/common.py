"""What the HTTP front-ends share: OpenAI-shaped errors, auth, bodies and options.

Streaming a context as a response body is :mod:`rtts.api.http.speech`.

Every new HTTP surface answers bad input with the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}`` and a 4xx/5xx status, so the clients
people already run (the ``openai`` SDK, Open WebUI, pipecat) show the server's message.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Send

from rtts.api.auth import Authenticator, AuthError
from rtts.core.params import SpeechOptions, parse_options
from rtts.core.service import Service, State
from rtts.errors import ProtocolError, RttsError

__all__ = ["ApiError", "DeadlineStreamingResponse", "JsonCommas", "api_error_response",
           "auth_api_error", "authorize", "authorize_listing", "b64", "check_ready",
           "number_param", "read_body", "read_timeout_error", "speech_options", "sse"]


class ApiError(RttsError):
    """An error answered as ``{"error": {...}}`` with ``status`` (and optional headers)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def api_error_response(exc: ApiError) -> Response:
    return Response(orjson.dumps(exc.body()), status_code=exc.status,
                    media_type="application/json",
                    headers={"Cache-Control": "no-store", **exc.headers})


def overloaded(message: str, status: int = 503) -> ApiError:
    return ApiError(status, message, type="server_error" if status == 503 else "requests",
                    code="overloaded" if status == 503 else "rate_limit_exceeded",
                    headers={"Retry-After": "1"})


def check_ready(service: Service) -> None:
    if service.state != State.READY:
        raise ApiError(503, f"not ready: {service.state_reason}", type="server_error",
                       code="unavailable", headers={"Retry-After": "1"})
    try:
        service.check_admission()
    except RttsError as exc:
        raise overloaded(exc.message) from None


def authorize(auth: Authenticator, service: Service, request: Request, *,
              admit: bool = True, key: str | None = None, header: bool = True) -> str:
    """Check origin, key (``Authorization: Bearer``, ``key`` from a protocol's own header,
    or ``?token=``) and, with ``admit``, the per-key quota; returns the key id, to
    :meth:`Authenticator.release` (after an admit) when the response ends. Every HTTP
    surface that synthesizes or reveals server data calls this. With ``header`` False the
    ``Authorization`` header is the protocol's own (Deepgram's ``Token``), read by the
    caller into ``key``."""
    try:
        auth.check_origin(request.headers.get("origin"))
        kid = auth.identify(request.headers.get("authorization") if header else None,
                            request.query_params.get("token"), time.time(), key=key)
        if admit:
            auth.admit(kid, time.monotonic())
    except AuthError as exc:
        service.stats.auth_rejected_by[exc.kind] += 1
        raise auth_api_error(exc) from None
    return kid


def authorize_listing(auth: Authenticator, service: Service, request: Request, *,
                      key: str | None = None) -> str | None:
    """The check of a model or voice *name* list: none with auth off; with keys, a key (or
    token), unless ``--public-listing`` is on and the request presents no credentials at
    all (the origin is still checked). A presented key is always verified. Returns the
    key id when one was presented (whose own voices a listing includes), else None."""
    if not auth.enabled:
        return None
    presented = (key or request.headers.get("authorization")
                 or request.query_params.get("token"))
    if auth.config.public_listing and not presented:
        try:
            auth.check_origin(request.headers.get("origin"))
        except AuthError as exc:
            service.stats.auth_rejected_by[exc.kind] += 1
            raise auth_api_error(exc) from None
        return None
    return authorize(auth, service, request, admit=False, key=key)


def auth_api_error(exc: AuthError) -> ApiError:
    """The OpenAI-shaped HTTP error for an :class:`AuthError`."""
    if exc.status == 401:
        return ApiError(401, exc.reason, code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    if exc.status == 429:
        return ApiError(429, exc.reason, type="requests", code="rate_limit_exceeded",
                        headers={"Retry-After": str(exc.retry_after_s or 1)})
    return ApiError(exc.status, exc.reason, code="forbidden")


_MAX_INT = 2**31 - 1


def number_param(name: str, value: object, *, integer: bool) -> int | float:
    """A numeric request parameter (a query string, or a JSON number), or a 400 naming the
    parameter: never a 500 on absurd values (huge, NaN, a boolean, a list)."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ApiError(400, f"{name} must be {kind}", param=name, code="invalid_params")
    try:
        number: int | float = int(value) if integer else float(value)
    except (ValueError, OverflowError):
        raise ApiError(400, f"{name} must be {kind}", param=name,
                       code="invalid_params") from None
    if number != number or abs(number) > _MAX_INT:
        raise ApiError(400, f"{name} is out of range", param=name, code="invalid_params")
    return number


# The synthesis parameters a request may carry as plain options (a query string, a JSON
# object), by type (:func:`speech_options`).
START_OPTIONS: Final = {"voice": str, "seed": int, "temperature": float, "top_P": float,
                        "top_K": int, "speed": int, "sample_rate": int, "anchor": bool,
                        "oral": int, "laugh": int, "breaks": int,
                        "repetition_penalty": float}


def speech_options(service: Service, options: Mapping[str, object],
                   **fixed: object) -> SpeechOptions:
    """Validated :class:`~rtts.core.params.SpeechOptions` from the :data:`START_OPTIONS`
    present in ``options`` (and ``fixed`` fields), or a 400 naming what is wrong."""
    given: dict[str, object] = dict(fixed)
    for key, kind in START_OPTIONS.items():
        if key not in options:
            continue
        value = options[key]
        if kind is str:
            if not isinstance(value, str):
                raise ApiError(400, f"{key} must be a string", param=key)
            given[key] = value
        elif kind is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                value = value.lower() in ("true", "1")
            if not isinstance(value, bool):
                raise ApiError(400, f"{key} must be true or false", param=key,
                               code="invalid_params")
            given[key] = value
        else:
            given[key] = number_param(key, value, integer=kind is int)
    try:
        parsed = parse_options(given)
        service.validate_params(parsed.params)
    except ProtocolError as exc:
        raise ApiError(400, exc.message, code=str(exc.code)) from None
    return parsed


def read_timeout_error(seconds: float) -> ApiError:
    """The 408 for a request body that did not arrive in time (the connection closes)."""
    return ApiError(408, f"the request body did not arrive within {seconds:g} s",
                    code="request_timeout", headers={"Connection": "close"})


async def read_body(request: Request, limit: int, timeout_s: float,
                    scan: Callable[[bytes], None] | None = None) -> bytes:
    """The request body, or a 413 :class:`ApiError` past ``limit`` bytes, or a 408 when the
    whole body has not arrived within ``timeout_s`` (``http_read_timeout_s``): a body
    announced by its Content-Length that never comes, or one dripped a byte at a time, no
    longer holds the request (and the key's session) forever.

    ``scan`` sees each piece as it arrives and may raise an :class:`ApiError` to refuse
    the body before it is whole (and before anything parses it): the rest of the body is
    then read and dropped, neither kept nor parsed (so the client, which is still sending
    it, reads the error instead of a reset connection), and the error raised."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="body_too_large")
    body = bytearray()
    refused: ApiError | None = None
    received = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                received += len(chunk)
                if refused is not None:
                    if received > limit:  # (no more of it is read: the connection closes)
                        raise _closing(refused)
                    continue  # (dropped)
                if received > limit:
                    raise ApiError(413, f"request body larger than {limit} bytes",
                                   code="body_too_large")
                if scan is not None:
                    try:
                        scan(chunk)
                    except ApiError as exc:
                        refused = exc
                        body = bytearray()
                        continue
                body += chunk
    except TimeoutError:
        if refused is not None:  # (the rest never came: the connection closes)
            raise _closing(refused) from None
        raise read_timeout_error(timeout_s) from None
    if refused is not None:
        raise refused
    return bytes(body)


def _closing(exc: ApiError) -> ApiError:
    """``exc``, sent with ``Connection: close`` (the rest of its body is not read)."""
    exc.headers = {**exc.headers, "Connection": "close"}
    return exc


class JsonCommas:
    """Counts the commas outside strings of a JSON document fed in pieces, which bounds how
    many values (array items, object members) parsing it would make: a bounded, linear
    scan that runs in C (``bytes.find``/``count`` and one regular expression), a piece at a
    time, so a body can be refused for holding too many values before it is whole and
    without parsing it (:func:`read_body`'s ``scan``). Invalid JSON is counted all the
    same (the parser refuses it later)."""

    # the rest of a string's body: up to its closing quote, or a backslash that ends the
    # piece (its escaped character is in the next piece), or the piece's end
    _STRING_BODY = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)

    __slots__ = ("commas", "_in_string", "_escaped")

    def __init__(self) -> None:
        self.commas = 0
        self._in_string = False
        self._escaped = False  # a piece ended on a backslash inside a string

    def feed(self, data: bytes) -> int:
        """Count ``data``, the next piece of the document; the commas so far."""
        i, n = 0, len(data)
        if self._escaped and n:
            i, self._escaped = 1, False
        while i < n:
            if self._in_string:
                match = self._STRING_BODY.match(data, i)
                assert match is not None  # (it matches the empty string)
                end = match.end()
                if end >= n:
                    break
                if data[end] == 0x5C:  # a backslash, the piece's last byte
                    self._escaped = True
                    break
                self._in_string = False  # the closing quote
                i = end + 1
            else:
                quote = data.find(b'"', i)
                self.commas += data.count(b",", i, n if quote < 0 else quote)
                if quote < 0:
                    break
                self._in_string = True
                i = quote + 1
        return self.commas


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


_log = logging.getLogger("rtts.api.http")


class DeadlineStreamingResponse(StreamingResponse):
    """A streamed body with a write deadline: a client that stops reading (the send waits
    on flow control) for ``write_timeout_s`` gets the connection closed, and the body's
    ``background`` task still runs, so what the body holds (the key's session, the
    context) is released. Without it, a never-read body was held forever."""

    def __init__(self, *args: Any, write_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def send_by_deadline(message: Message) -> None:
            async with asyncio.timeout(self.write_timeout_s):
                await send(message)

        try:
            await super().stream_response(send_by_deadline)
        except TimeoutError:
            # (the server closes a connection whose response did not complete)
            _log.info("client stopped reading a response for %g s: closed",
                      self.write_timeout_s)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
