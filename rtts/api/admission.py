"""Who may open a WebSocket, counted only for sessions that really open.

Every WebSocket front-end (the native ``/v1/stream``, and any other socket protocol on the
port) goes through one :class:`WsAdmission`:

* :meth:`WsAdmission.handshake` runs in the ``websockets`` handshake (``process_request``):
  readiness, the server-wide and per-client connection caps, origin, key or token, and the
  key's quotas, **checked without counting anything**. A refusal is an HTTP status.
* :meth:`WsAdmission.session` wraps the handler, which ``websockets`` runs only once the
  handshake has completed: there the session is counted (key quota, client connections)
  and released on every path out. A handshake that fails or a client that drops before
  the handler runs therefore costs nothing, so nobody can lock a key out by starting
  upgrades and abandoning them.

The principal found at the handshake travels to the handler in a
:class:`weakref.WeakKeyDictionary` keyed by the connection object: an abandoned handshake
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import time
import urllib.parse
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from rtts.api.auth import Authenticator, AuthError
from rtts.api.handshake import respond
from rtts.core.service import Service, State
from rtts.errors import CLOSE_TRY_AGAIN_LATER, ErrorCode

__all__ = ["ConnectionCounts", "Principal", "WsAdmission", "client_address", "refusal",
           "trusted_peer"]

logger = logging.getLogger("rtts.api.auth")

UNIDENTIFIED_PER_CLIENT = 8  # open sockets of one address that have not sent a key yet


@dataclass(slots=True)
class Principal:
    # key id ("anonymous" with auth off); None until a protocol that carries its key in
    # the first message has called :meth:`WsAdmission.identify_later`
    kid: str | None
    client: str  # client address (see client_address)
    unidentified: bool = False  # counted in WsAdmission.unidentified until identified


def client_address(peer: str | None, forwarded_for: str | None,
                   trusted_proxies: tuple[str, ...]) -> str:
    """The client's IP address: the socket's peer, or, when the peer is a trusted proxy,
    the right-most ``X-Forwarded-For`` entry that is not itself a trusted proxy (what
    nginx's ``$proxy_add_x_forwarded_for`` appends). Pure."""
    addr = peer or "unknown"
    if not forwarded_for or not trusted_peer(addr, trusted_proxies):
        return addr
    for hop in reversed([h.strip() for h in forwarded_for.split(",") if h.strip()]):
        addr = hop
        if not trusted_peer(hop, trusted_proxies):
            break
    return addr


def trusted_peer(addr: str, trusted: tuple[str, ...]) -> bool:
    """Whether ``addr`` is one of the trusted proxies (addresses or networks; ``*``: any)."""
    if "*" in trusted:
        return True
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    for net in trusted:
        with contextlib.suppress(ValueError):
            if ip in ipaddress.ip_network(net, strict=False):
                return True
    return False


class ConnectionCounts:
    """Open connections, all together and per client address, against their caps (one
    listener's: the main port's WebSocket sessions and its other connections, HTTP or not
    yet known, share one; the Wyoming listener has its own). A connection counted with
    client None (from a trusted proxy, whose clients share its address) counts only in
    the total."""

    def __init__(self) -> None:
        self.total = 0
        self.per_client: dict[str, int] = {}

    def refusal(self, client: str | None, max_total: int, per_client: int | None
                ) -> tuple[int, str] | None:
        """The HTTP status and reason if one more connection of ``client`` would go over a
        cap (503: all clients together; 429: this client), else None."""
        if self.total >= max_total:
            return 503, "too many connections"
        if (client is not None and per_client is not None
                and self.per_client.get(client, 0) >= per_client):
            return 429, f"at most {per_client} connections per client"
        return None

    def add(self, client: str | None) -> None:
        self.total += 1
        if client is not None:
            self.per_client[client] = self.per_client.get(client, 0) + 1

    def remove(self, client: str | None) -> None:
        self.total -= 1
        if client is None:
            return
        left = self.per_client.get(client, 1) - 1
        if left > 0:
            self.per_client[client] = left
        else:
            self.per_client.pop(client, None)


def refusal(exc: AuthError) -> Response:
    """The handshake's HTTP answer to an :class:`AuthError`."""
    extra: list[tuple[str, str]] = []
    if exc.retry_after_s is not None:
        extra.append(("Retry-After", str(exc.retry_after_s)))
    if exc.status == 401:
        extra.append(("WWW-Authenticate", "Bearer"))
    return respond(exc.status, f"{exc.reason}\n", extra=extra)


class WsAdmission:
    """The handshake checks and the session accounting of every WebSocket on the port."""

    def __init__(self, service: Service, auth: Authenticator) -> None:
        self.service = service
        self.auth = auth
        self.config = service.config
        self.counts = ConnectionCounts()  # open sessions, counted by session()
        # sessions with no key yet (ElevenLabs: the key comes in the first message): few
        # per address and a quarter of --max-connections in all, so keyless sockets cannot
        # fill every slot before anyone has been asked for a key
        self.unidentified = ConnectionCounts()
        self._principals: weakref.WeakKeyDictionary[ServerConnection, Principal] = (
            weakref.WeakKeyDictionary())

    def _peer(self, connection: ServerConnection, request: Request) -> str:
        remote = connection.remote_address
        peer = str(remote[0]) if isinstance(remote, tuple) and remote else None
        return client_address(peer, request.headers.get("X-Forwarded-For"),
                              self.config.trusted_proxies)

    def handshake(self, connection: ServerConnection, request: Request, *,
                  key: str | None = None, key_later: bool = False,
                  header: bool = True) -> Response | None:
        """Check a WebSocket upgrade; None to accept it, else the refusal. ``key`` is a key
        the protocol carries elsewhere (e.g. ElevenLabs' ``xi-api-key`` header); with
        ``header`` False the ``Authorization`` header is the protocol's own (Deepgram's
        ``Token``) and the caller passes what it holds as ``key``. With
        ``key_later``, an upgrade that presents no credentials at all is accepted
        unidentified: the handler must call :meth:`identify_later` before any work."""
        service = self.service
        cfg = self.config
        if service.state != State.READY:
            return respond(503, f"not ready: {service.state_reason}\n",
                           extra=[("Retry-After", "1")])
        client = self._peer(connection, request)
        full = self.counts.refusal(client, cfg.max_connections, cfg.max_connections_per_client)
        if full is not None:
            status, reason = full
            if status == 429:
                service.stats.auth_rejected_by["client_connections"] += 1
            return respond(status, f"{reason}\n",
                           extra=[("Retry-After", "5" if status == 429 else "1")])
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query)
        authorization = request.headers.get("Authorization") if header else None
        try:
            self.auth.check_origin(request.headers.get("Origin"))
            token = query["token"][0] if query.get("token") else None
            kid = self.auth.identify(authorization, token, time.time(), key=key)
            self.auth.check(kid, time.monotonic())
        except AuthError as exc:
            presented = key or authorization or query.get("token")
            if exc.status == 401 and key_later and not presented:
                full = self.unidentified.refusal(client, max(1, cfg.max_connections // 4),
                                                 UNIDENTIFIED_PER_CLIENT)
                if full is not None:
                    service.stats.auth_rejected_by["client_connections"] += 1
                    return respond(429, f"{full[1]} without a key\n",
                                   extra=[("Retry-After", "5")])
                self._principals[connection] = Principal(None, client)
                return None
            service.stats.auth_rejected_by[exc.kind] += 1
            return refusal(exc)
        self._principals[connection] = Principal(kid, client)
        return None

    def owner_of(self, connection: ServerConnection) -> str | None:
        """After :meth:`handshake` accepted ``connection``: the owner id of its key (whose
        named voices it may use), None without one (yet)."""
        principal = self._principals.get(connection)
        kid = principal.kid if principal is not None else None
        return self.auth.owner(kid) if kid else None

    def identify_later(self, principal: Principal, authorization: str | None,
                       key: str | None) -> None:
        """Identify and admit a session whose key came after the handshake (in its first
        message); raises :class:`AuthError`. :meth:`session` releases it at the end."""
        if principal.kid is not None:
            return
        try:
            kid = self.auth.identify(authorization, None, time.time(), key=key)
            self.auth.admit(kid, time.monotonic())
        except AuthError as exc:
            self.service.stats.auth_rejected_by[exc.kind] += 1
            raise
        principal.kid = kid
        if principal.unidentified:
            principal.unidentified = False
            self.unidentified.remove(principal.client)

    @contextlib.asynccontextmanager
    async def session(self, ws: ServerConnection) -> AsyncIterator[Principal | None]:
        """Count the session for the handler's lifetime; yields None (after telling the
        client, close 1013) if a quota filled up since the handshake."""
        principal = self._principals.pop(ws, None) or Principal("anonymous",
                                                                self._peer_of(ws))
        try:
            if principal.kid is not None:
                self.auth.admit(principal.kid, time.monotonic())
        except AuthError as exc:
            self.service.stats.auth_rejected_by[exc.kind] += 1
            with contextlib.suppress(ConnectionClosed):
                await ws.send(orjson.dumps({"type": "error", "code": str(ErrorCode.OVERLOADED),
                                            "message": exc.reason}).decode())
                await ws.close(CLOSE_TRY_AGAIN_LATER, exc.reason[:120])
            yield None
            return
        self.counts.add(principal.client)
        if principal.kid is None:
            principal.unidentified = True
            self.unidentified.add(principal.client)
        try:
            yield principal
        finally:
            self.counts.remove(principal.client)
            if principal.unidentified:
                principal.unidentified = False
                self.unidentified.remove(principal.client)
            if principal.kid is not None:
                self.auth.release(principal.kid)

    @staticmethod
    def _peer_of(ws: ServerConnection) -> str:
        remote = ws.remote_address
        return str(remote[0]) if isinstance(remote, tuple) and remote else "unknown"
