"""What the JSON-message WebSocket front-ends share (ElevenLabs, Cartesia, Deepgram): a
bounded send and close, and the set of open sockets a drain closes.

A client that stops reading must not hold a writer forever: :func:`send_within` aborts the
connection when a message cannot be handed to the socket within the slow-client timeout
(a close frame would sit behind the unread audio), and :func:`close_within` bounds the
close handshake the same way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol, TypeVar

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from rtts.errors import CLOSE_GOING_AWAY

if TYPE_CHECKING:
    from rtts.core.service import Service

__all__ = ["OpenSockets", "close_within", "receive_unless_idle", "send_within"]


async def close_within(ws: ServerConnection, code: int, reason: str, timeout_s: float) -> None:
    """Close with ``code`` (the reason cut to 100 characters); abort the TCP connection
    if the close handshake takes longer than ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await ws.close(code, reason[:100])
    except TimeoutError:
        ws.transport.abort()
    except ConnectionClosed:
        pass


async def send_within(ws: ServerConnection, data: str | bytes, timeout_s: float,
                      logger: logging.Logger, what: str) -> None:
    """Send ``data``; past ``timeout_s`` the client is too slow: abort, and raise
    ``ConnectionClosed`` as if it had gone."""
    try:
        async with asyncio.timeout(timeout_s):
            await ws.send(data)
    except TimeoutError:
        logger.warning("%s: client too slow, closing", what)
        ws.transport.abort()
        raise ConnectionClosed(None, None) from None


async def receive_unless_idle(ws: ServerConnection, idle_s: float | None
                              ) -> str | bytes | None:
    """The next message, or None once ``idle_s`` passes without one (None or 0: wait as
    long as it takes). A socket with nothing sent and nothing playing closes on None, so
    a silent client does not hold a connection slot."""
    try:
        async with asyncio.timeout(idle_s or None):
            return await ws.recv()
    except TimeoutError:
        return None


class _Socket(Protocol):
    async def run(self) -> None: ...

    async def close(self, code: int, reason: str = "") -> None: ...


S = TypeVar("S", bound=_Socket)


class OpenSockets(set[S]):
    """A front-end's open sockets: each counted while it runs, all closed by a drain."""

    async def serve(self, sock: S, service: Service) -> None:
        """Run ``sock`` to its end, counted among the open ones (and in the service's
        connection total); the service hears when it ends (a drain waits for that)."""
        self.add(sock)
        service.stats.connections_total += 1
        try:
            await sock.run()
        finally:
            self.discard(sock)
            service.activity.set()

    async def close_all(self) -> None:
        """Close every open socket with 1001 (server going away)."""
        await asyncio.gather(*(s.close(CLOSE_GOING_AWAY, "server shutting down")
                               for s in list(self)), return_exceptions=True)
