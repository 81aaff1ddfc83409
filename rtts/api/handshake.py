"""HTTP responses of a refused WebSocket handshake (every socket front-end's).

A refusal's body is JSON in the shape the HTTP API answers with,
``{"error": {"message", "type", "param", "code"}}``, unless a front-end gives its own body
and type (ElevenLabs' ``detail``, Deepgram's ``err_code``). Everything else on the port is
the ASGI app in :mod:`rtts.api.http.app`.
"""

from __future__ import annotations

import orjson
from websockets.datastructures import Headers
from websockets.http11 import Response

__all__ = ["respond"]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
            429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}


_CODES = {400: "bad_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
          405: "method_not_allowed", 413: "body_too_large", 429: "rate_limit_exceeded",
          500: "internal_error", 503: "unavailable"}


def respond(status: int, body: bytes | str, content_type: str | None = None,
            extra: list[tuple[str, str]] | None = None) -> Response:
    """``body`` as given with ``content_type``; a plain message (a str, no type) becomes the
    JSON error shape."""
    if content_type is None and isinstance(body, str):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        data = orjson.dumps({"error": {"message": body.strip(), "type": kind, "param": None,
                                       "code": _CODES.get(status)}})
        content_type = "application/json"
    else:
        data = body.encode() if isinstance(body, str) else body
        content_type = content_type or "application/octet-stream"
    headers = Headers([
        ("Content-Type", content_type),
        ("Content-Length", str(len(data))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        *(extra or []),
    ])
    return Response(status, _REASONS.get(status, "OK"), headers, data)
