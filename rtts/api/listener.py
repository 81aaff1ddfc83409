"""One port, two HTTP stacks: WebSocket upgrades to ``websockets``, the rest to uvicorn.

The listening socket belongs to the ``websockets`` server (so its connection tracking,
close codes and send path stay exactly as measured), but its per-connection protocol is a
:class:`Sniffer`: it reads the request head, and only then picks the protocol that owns the
connection for good. A request with ``Upgrade: websocket`` goes to a ``websockets``
``ServerConnection`` (the native ``/v1/stream``); anything else goes to uvicorn's HTTP/1.1
protocol running the ASGI app (:mod:`rtts.api.http.app`): POST bodies, chunked streaming
responses, Server-Sent Events. Either protocol receives the bytes read so far, so the
hand-over is invisible to the client.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp
from uvicorn.config import Config
from uvicorn.server import ServerState
from websockets.asyncio.server import ServerConnection

__all__ = ["HttpSide", "Sniffer", "sniffing_connection_factory"]

logger = logging.getLogger("rtts.api.handshake")

MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 10.0


class HttpSide:
    """uvicorn's HTTP/1.1 protocol and shared state, without uvicorn's own server loop."""

    def __init__(self, app: ASGIApp, server_header: str) -> None:
        self.config = Config(
            app, lifespan="off", ws="none", http="h11", log_config=None, access_log=False,
            proxy_headers=False, server_header=False, date_header=False,
            headers=[("server", server_header)], timeout_keep_alive=5,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        )
        self.config.load()
        self.state = ServerState()
        self.state.default_headers = list(self.config.encoded_headers)
        self._app_state: dict[str, Any] = {}

    def protocol(self) -> asyncio.Protocol:
        factory: Any = self.config.http_protocol_class
        proto: asyncio.Protocol = factory(config=self.config, server_state=self.state,
                                          app_state=self._app_state)
        return proto

    @property
    def busy(self) -> int:
        """Requests being answered (a streaming body counts until it ends)."""
        return len(self.state.tasks)

    def shutdown(self) -> None:
        """Close idle keep-alive connections; let the active ones finish their response."""
        for conn in list(self.state.connections):
            conn.shutdown()

    async def close(self) -> None:
        """Cancel the responses still in flight and drop their connections."""
        self.shutdown()
        for task in list(self.state.tasks):
            task.cancel()
        if self.state.tasks:
            await asyncio.wait(set(self.state.tasks), timeout=1.0)
        for conn in list(self.state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()


class Sniffer(asyncio.Protocol):
    """Buffers a connection's request head, then hands the connection to its real protocol."""

    def __init__(self, ws_protocol: Callable[[], ServerConnection],
                 http_protocol: Callable[[], asyncio.Protocol]) -> None:
        self._ws_protocol = ws_protocol
        self._http_protocol = http_protocol
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                self._reject(b"431 Request Header Fields Too Large")
            return
        if self._timer is not None:
            self._timer.cancel()
        proto: asyncio.Protocol = (self._ws_protocol() if _is_websocket(self._buf[:end])
                                   else self._http_protocol())
        transport = self._transport
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(bytes(self._buf))
        self._buf.clear()

    def eof_received(self) -> bool | None:
        return False  # closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _reject(self, status: bytes) -> None:
        assert self._transport is not None
        self._transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n"
                              b"Connection: close\r\n\r\n")
        self._transport.close()


def _is_websocket(head: bytes | bytearray) -> bool:
    for line in bytes(head).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and b"websocket" in value.lower():
            return True
    return False


def sniffing_connection_factory(http: HttpSide) -> Callable[..., Any]:
    """A ``create_connection`` for :func:`websockets.asyncio.server.serve` that sniffs."""

    def create(protocol: Any, server: Any, **kwargs: Any) -> Sniffer:
        ws = functools.partial(ServerConnection, protocol, server, **kwargs)
        return Sniffer(ws, http.protocol)

    return create
