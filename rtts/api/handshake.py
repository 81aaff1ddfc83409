"""Plain HTTP responses of the WebSocket handshake (refusals on ``/v1/stream``).

Everything else on the port is the ASGI app in :mod:`rtts.api.http.app`.
"""

from __future__ import annotations

from websockets.datastructures import Headers
from websockets.http11 import Response

__all__ = ["respond"]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
            429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}


def respond(status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
            extra: list[tuple[str, str]] | None = None) -> Response:
    data = body.encode() if isinstance(body, str) else body
    headers = Headers([
        ("Content-Type", content_type),
        ("Content-Length", str(len(data))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        *(extra or []),
    ])
    return Response(status, _REASONS.get(status, "OK"), headers, data)
