"""One port, two HTTP stacks: WebSocket upgrades to ``websockets``, the rest to uvicorn.

The listening socket belongs to the ``websockets`` server (so its connection tracking,
close codes and send path stay exactly as measured), but its per-connection protocol is a
:class:`Sniffer`: it reads the first request head and hands the connection to the protocol
that serves it. A request with ``Upgrade: websocket`` goes to a ``websockets``
``ServerConnection`` (the native ``/v1/stream``, the ElevenLabs sockets); anything else goes
to uvicorn's HTTP/1.1 protocol running the ASGI app (:mod:`rtts.api.http.app`): POST bodies,
chunked streaming responses, Server-Sent Events. Either protocol receives the bytes read so
far, so the hand-over is invisible to the client.

The protocol is chosen **per request**, not per connection: an HTTP keep-alive connection
whose next request is a WebSocket upgrade is handed to ``websockets`` at that request
(:class:`HttpConnection`). aiohttp does exactly this: it reuses a kept-alive connection for
``ws_connect``, so LiveKit's ElevenLabs plugin upgrades on the connection its
``synthesize()`` or ``list_voices()`` just used.

Bounds on every connection, whatever it speaks:

* a request head must arrive whole within :data:`HEAD_TIMEOUT_S` of its first byte, on the
  first request and on every later keep-alive request (a connection that trickles a second
  head is dropped); an idle keep-alive connection closes after uvicorn's 5 s;
* every connection on the port counts in the listener's :class:`ConnectionCounts` (the
  same counts the WebSocket admission uses) from ``accept`` until it closes or becomes a
  WebSocket session (counted by the admission from then on). Over ``max_connections``
  (clamped below the process's open-file limit) a new connection gets ``503`` and is
  closed at once; over ``max_connections_per_client`` from one address (not a trusted
  proxy), ``429``. So idle keep-alive connections cannot exhaust file descriptors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from collections.abc import Callable
from typing import Any

import h11
from starlette.types import ASGIApp
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState
from websockets.asyncio.server import ServerConnection

from rtts.api.admission import ConnectionCounts, trusted_peer

__all__ = ["HEAD_TIMEOUT_S", "HttpConnection", "HttpSide", "Sniffer", "connection_cap",
           "sniffing_connection_factory"]

logger = logging.getLogger("rtts.api.handshake")

MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 10.0
# file descriptors kept free for everything that is not a client connection (model files,
# logs, redis, the Wyoming listener, subprocesses)
FD_RESERVE = 64


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to fit the process's open-file limit (less
    :data:`FD_RESERVE`): past the limit ``accept()`` fails and nobody, ``/healthz``
    included, is served."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - no rlimits on this platform
        return max_connections
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return max_connections
    return max(1, min(max_connections, soft - FD_RESERVE))


class _Slot:
    """One connection's place in the listener's counts, released exactly once."""

    __slots__ = ("_counts", "_client")

    def __init__(self, counts: ConnectionCounts | None, client: str | None) -> None:
        self._counts = counts
        self._client = client

    def release(self) -> None:
        if self._counts is not None:
            self._counts.remove(self._client)
            self._counts = None


class HttpSide:
    """uvicorn's HTTP/1.1 protocol and shared state, without uvicorn's own server loop, and
    the connection caps of the port."""

    def __init__(self, app: ASGIApp, server_header: str, *,
                 counts: ConnectionCounts | None = None, max_connections: int = 2000,
                 max_connections_per_client: int | None = None,
                 trusted_proxies: tuple[str, ...] = ()) -> None:
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
        self.counts = counts
        self.max_connections = connection_cap(max_connections)
        self.max_connections_per_client = max_connections_per_client
        self.trusted_proxies = trusted_proxies

    def admit(self, transport: asyncio.BaseTransport) -> _Slot | bytes:
        """Count a new connection, or the response refusing it (over a cap)."""
        if self.counts is None:
            return _Slot(None, None)
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        # behind a trusted proxy every client shares its address: only the total applies
        # (the WebSocket handshake applies the per-client cap to X-Forwarded-For)
        client = None if trusted_peer(addr, self.trusted_proxies) else addr
        full = self.counts.refusal(client, self.max_connections,
                                   self.max_connections_per_client)
        if full is not None:
            status, reason = full
            return _refusal(status, reason)
        self.counts.add(client)
        return _Slot(self.counts, client)

    def protocol(self, slot: _Slot, ws_protocol: Callable[[], ServerConnection]
                 ) -> HttpConnection:
        return HttpConnection(self.config, self.state, self._app_state, slot=slot,
                              ws_protocol=ws_protocol)

    @property
    def busy(self) -> int:
        """Requests being answered (a streaming body counts until it ends), not counting
        the one asking (a ``/metrics`` scrape does not count itself)."""
        try:
            me = asyncio.current_task()
        except RuntimeError:
            me = None
        return sum(1 for task in self.state.tasks if task is not me)

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


class HttpConnection(H11Protocol):
    """uvicorn's HTTP/1.1 protocol for one connection, plus: a head deadline on every
    keep-alive request, the connection's place in the counts, and a WebSocket upgrade on
    any request (handed to ``websockets`` at that request)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 *, slot: _Slot, ws_protocol: Callable[[], ServerConnection]) -> None:
        super().__init__(config, server_state, app_state)
        self._slot = slot
        self._ws_protocol = ws_protocol
        self._head_timer: asyncio.TimerHandle | None = None

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._idle() and self.transport is not None:
            # bytes of a new request head: it must be complete within HEAD_TIMEOUT_S
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a new request's head arrived whole
            self._cancel_head_timer()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._idle() and not self.transport.is_closing():
            logger.debug("request head not complete within %.0fs: closing", HEAD_TIMEOUT_S)
            self.transport.abort()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _should_upgrade_to_ws(self) -> bool:
        return True

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """Hand the connection to ``websockets`` with the head re-assembled from the parsed
        request (as uvicorn's own upgrade does); bytes after the head are not passed on (a
        client sends no frame before the ``101``)."""
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        self.connections.discard(self)
        self._slot.release()  # from here the WebSocket admission counts the session
        output = [event.method, b" ", event.target, b" HTTP/1.1\r\n"]
        for name, value in self.headers:
            output += [name, b": ", value, b"\r\n"]
        output.append(b"\r\n")
        protocol = self._ws_protocol()
        transport = self.transport
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(b"".join(output))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._slot.release()
        super().connection_lost(exc)


class Sniffer(asyncio.Protocol):
    """Buffers a connection's first request head, then hands the connection to its real
    protocol (see the module docstring for the caps and deadlines)."""

    def __init__(self, ws_protocol: Callable[[], ServerConnection], http: HttpSide) -> None:
        self._ws_protocol = ws_protocol
        self._http = http
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._slot = _Slot(None, None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        admitted = self._http.admit(transport)
        if isinstance(admitted, bytes):
            transport.write(admitted)
            transport.close()
            return
        self._slot = admitted
        self._timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        if self._transport.is_closing():
            return
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                self._reject(b"431 Request Header Fields Too Large")
            return
        if self._timer is not None:
            self._timer.cancel()
        proto: asyncio.Protocol
        if _is_websocket(self._buf[:end]):
            self._slot.release()  # the WebSocket admission counts the session
            proto = self._ws_protocol()
        else:
            proto = self._http.protocol(self._slot, self._ws_protocol)
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
        self._slot.release()

    def _reject(self, status: bytes) -> None:
        assert self._transport is not None
        self._transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n"
                              b"Connection: close\r\n\r\n")
        self._transport.close()


def _refusal(status: int, reason: str) -> bytes:
    body = f"{reason}\n".encode()
    phrase = b"Too Many Requests" if status == 429 else b"Service Unavailable"
    retry = b"5" if status == 429 else b"1"
    return (b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\nRetry-After: %s\r\nConnection: close\r\n\r\n%s"
            % (status, phrase, len(body), retry, body))


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
        return Sniffer(ws, http)

    return create
