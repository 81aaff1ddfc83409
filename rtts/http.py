"""Plain HTTP responses served on the WebSocket port: health, metrics, static files, WAV."""

from __future__ import annotations

import mimetypes
from pathlib import Path

from websockets.datastructures import Headers
from websockets.http11 import Response

__all__ = ["respond", "static_file"]

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


def static_file(web_dir: Path | None, path: str) -> Response | None:
    """Serve ``path`` from ``web_dir``; None when it is not a file there (no traversal)."""
    if web_dir is None:
        return None
    rel = path.split("?", 1)[0].lstrip("/") or "index.html"
    root = web_dir.resolve()
    target = (root / rel).resolve()
    if root not in target.parents and target != root:
        return None
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return None
    ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    if target.suffix in (".js", ".mjs"):
        ctype = "text/javascript"
    if ctype.startswith("text/"):
        ctype += "; charset=utf-8"
    return respond(200, target.read_bytes(), ctype)
