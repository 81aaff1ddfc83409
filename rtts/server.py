"""The server: one port, the synthesis core, and the protocol front-ends wired together.

:class:`App` is the :class:`~rtts.core.service.Service` (engine, scheduler, cache,
governor) plus what serves it: the ``websockets`` listener whose connections are sniffed
by :mod:`rtts.api.listener` (WebSocket upgrades -> :mod:`rtts.api.native.connection`, plain HTTP ->
the ASGI app of :mod:`rtts.api.http.app` on uvicorn's HTTP protocol), graceful drain, and the
startup order (listen first, ``/healthz`` up, ``/readyz`` 503 until the engine is loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from rtts import __version__
from rtts.api.auth import Authenticator
from rtts.api.cartesia.endpoint import PATH as CARTESIA_PATH
from rtts.api.cartesia.endpoint import CartesiaEndpoints
from rtts.api.deepgram.endpoint import PATHS as DEEPGRAM_PATHS
from rtts.api.deepgram.endpoint import DeepgramEndpoints, accept_subprotocol
from rtts.api.elevenlabs import PATH_PREFIX, ElevenLabsEndpoints
from rtts.api.http.app import build_http_app
from rtts.api.listener import HttpSide, sniffing_connection_factory
from rtts.api.native.connection import Connection, NativeEndpoint
from rtts.api.wyoming import WyomingListener
from rtts.config import ServerConfig
from rtts.core.governor import Level
from rtts.core.service import Service, State
from rtts.engines.base import Engine
from rtts.errors import CLOSE_GOING_AWAY
from rtts.jobs.store import JobStore
from rtts.jobs.worker import JobWorker

__all__ = ["App", "bound_port", "run_server"]

logger = logging.getLogger("rtts.server")


class App(Service):
    """The service plus its front-ends and the server state (loading/ready/draining)."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None,
                 own_engine: bool = True) -> None:
        super().__init__(config, engine, own_engine)
        self.server: Server | None = None
        self.auth = Authenticator(config.auth)
        self.native = NativeEndpoint(self, self.auth)
        self.elevenlabs = ElevenLabsEndpoints(self, self.auth, self.native.admission)
        self.cartesia = CartesiaEndpoints(self, self.auth, self.native.admission)
        self.deepgram = DeepgramEndpoints(self, self.auth, self.native.admission)
        # long-text jobs: the API wherever a queue is configured, a worker with --jobs
        self.jobs = JobStore(config.jobs) if config.jobs.redis_url else None
        self.job_worker: JobWorker | None = None
        # every connection on the port counts in the admission's caps until it becomes a
        # WebSocket session (counted there): idle keep-alive connections included
        self.http = HttpSide(build_http_app(self, self.auth, self.jobs), f"rtts/{__version__}",
                             counts=self.native.admission.counts,
                             max_connections=config.max_connections,
                             max_connections_per_client=config.max_connections_per_client,
                             trusted_proxies=config.trusted_proxies)
        self.wyoming: WyomingListener | None = None
        self._drain_begun: asyncio.Task[None] | None = None

    # WebSocket upgrades by path: ElevenLabs' input-streaming sockets, Cartesia's and
    # Deepgram's speak sockets, else the native one.

    def ws_process_request(self, connection: ServerConnection, request: Request
                           ) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path.startswith(PATH_PREFIX):
            return self.elevenlabs.process_request(connection, request)
        if path == CARTESIA_PATH:
            return self.cartesia.process_request(connection, request)
        if path in DEEPGRAM_PATHS:
            return self.deepgram.process_request(connection, request)
        return self.native.process_request(connection, request)

    def ws_process_response(self, connection: ServerConnection, request: Request,
                            response: Response) -> Response | None:
        accept_subprotocol(request, response)
        return None

    async def ws_handle(self, ws: ServerConnection) -> None:
        path = ws.request.path.split("?", 1)[0] if ws.request is not None else ""
        if path.startswith(PATH_PREFIX):
            await self.elevenlabs.handle(ws)
        elif path == CARTESIA_PATH:
            await self.cartesia.handle(ws)
        elif path in DEEPGRAM_PATHS:
            await self.deepgram.handle(ws)
        else:
            await self.native.handle(ws)

    @property
    def connections(self) -> set[Connection]:
        """Open ``/v1/stream`` connections."""
        return self.native.connections

    def connections_by_protocol(self) -> dict[str, int]:
        """Open client connections by protocol: native, ElevenLabs, Cartesia and Deepgram
        sockets, Wyoming connections, HTTP requests being answered."""
        return {"native": len(self.native.connections),
                "elevenlabs": len(self.elevenlabs.sockets),
                "cartesia": len(self.cartesia.sockets),
                "deepgram": len(self.deepgram.sockets),
                "wyoming": len(self.wyoming.connections) if self.wyoming is not None else 0,
                "http": self.http.busy}

    def active_connections(self) -> int:
        return sum(self.connections_by_protocol().values())

    def active_contexts(self) -> int:
        return self.native.active_contexts()

    def active_http_requests(self) -> int:
        return self.http.busy

    def job_counters(self) -> dict[str, float]:
        if self.job_worker is None:
            return {}
        s = self.job_worker.stats
        return {"stored": s.segments, "repeated": s.repeats, "preempted": s.preempted,
                "skipped": s.skipped, "failed": s.failures, "audio_seconds": s.audio_s,
                "running": s.busy}

    def apply_level(self, level: Level) -> None:
        """Propagate a governor level to the scheduler, sessions and clients."""
        super().apply_level(level)
        self.native.apply_level(level)

    def busy_connections(self) -> int:
        wyoming = self.wyoming.busy() if self.wyoming is not None else 0
        return (self.native.busy_connections() + self.http.busy + self.elevenlabs.busy()
                + self.cartesia.busy() + self.deepgram.busy() + wyoming)

    async def start_jobs(self) -> None:
        """Start the job worker (``--jobs``): segments fill batch slots live streams leave."""
        if self.jobs is not None and self.config.jobs.worker and self.job_worker is None:
            slots = self.config.jobs.concurrency or self.config.scheduler.max_batch_size
            self.job_worker = JobWorker(self, self.jobs, self.config.instance_id, slots)
            await self.job_worker.start()

    def start_drain(self) -> None:
        """Start the drain's first half (the admin API, and SIGTERM through
        :meth:`drain_and_close`): :attr:`state` is draining from now on (``/readyz`` 503,
        new streams and requests refused); the job worker stops, Wyoming stops accepting,
        idle keep-alive connections close. Open sessions keep going."""
        if self._drain_begun is None:
            super().start_drain()
            self._drain_begun = asyncio.create_task(self._begin_drain(), name="rtts-drain")

    def sessions_left(self) -> int:
        return self.busy_connections()

    async def _begin_drain(self) -> None:
        if self.job_worker is not None:
            await self.job_worker.stop()
        logger.info("draining %d connections and %d HTTP responses (grace %.1fs); /readyz "
                    "answers 503 meanwhile", len(self.connections), self.http.busy,
                    self.config.shutdown_grace_s)
        if self.wyoming is not None:  # raw TCP: no readiness to answer, so stop accepting
            await self.wyoming.close_listener()
        self.http.shutdown()  # idle keep-alive connections reconnect (and get told)

    async def drain_and_close(self) -> None:
        """Graceful shutdown: refuse new work, let contexts and HTTP responses finish until
        the grace deadline, then close remaining connections with 1001 and stop the engine.

        The listener stays open for the whole drain, so a load balancer or kubelet sees a
        draining instance, not a dead one: ``/healthz`` answers 200, ``/readyz`` 503 with the
        reason, a new WebSocket upgrade 503 with ``Retry-After`` (the handshake checks
        :attr:`state`), and the speech endpoints 503 (``authorize`` does). The listening
        socket closes only when the drain ends. The job worker stops first: its unfinished
        segments go to other workers."""
        self.start_drain()
        assert self._drain_begun is not None
        await self._drain_begun
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.busy_connections() and (left := deadline - time.monotonic()) > 0:
            self.activity.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.1)):
                    await self.activity.wait()
        if self.server is not None:
            self.server.close(close_connections=False)
        await self.stop_sampling()
        for conn in list(self.connections):
            await conn.close(CLOSE_GOING_AWAY, "server shutting down")
        await self.elevenlabs.close_all()
        await self.cartesia.close_all()
        await self.deepgram.close_all()
        if self.wyoming is not None:
            await self.wyoming.stop()
        await self.http.close()
        if self.server is not None:
            await self.server.wait_closed()
        await self.stop_core()
        if self.jobs is not None:
            await self.jobs.aclose()
        logger.info("shutdown complete")


@contextlib.asynccontextmanager
async def run_server(config: ServerConfig, engine: Engine | None = None,
                     load: bool = True, own_engine: bool = True) -> AsyncIterator[App]:
    """Start listening at once (``/healthz`` up, ``/readyz`` 503), load the engine, yield.

    On exit the server drains gracefully (see :meth:`App.drain_and_close`).
    """
    app = App(config, engine, own_engine)
    app.server = await serve(
        app.ws_handle, config.host, config.port,
        process_request=app.ws_process_request,
        process_response=app.ws_process_response,
        # websockets types this as a ServerConnection class; any callable returning an
        # asyncio protocol works (the sniffer hands over to a ServerConnection).
        create_connection=sniffing_connection_factory(app.http),  # type: ignore[arg-type]
        max_size=config.max_message_bytes,
        max_queue=16,
        # permessage-deflate on PCM costs ~200 us a frame (measured) and saves little;
        # events are tiny. Off.
        compression=None,
        write_limit=256 * 1024,
        ping_interval=config.ping_interval_s,
        close_timeout=config.close_timeout_s,
        server_header=f"rtts/{__version__}",
    )
    try:
        if config.wyoming_port is not None:
            app.wyoming = WyomingListener(app, config.wyoming_host or config.host,
                                          config.wyoming_port)
            await app.wyoming.start()
        if load:
            with contextlib.suppress(Exception):  # logged; /readyz reports the reason
                await app.load()
                await app.start_jobs()
        yield app
    finally:
        if app.state != State.STOPPED:
            await app.drain_and_close()
            app.state = State.STOPPED


def bound_port(app: App) -> int:
    assert app.server is not None
    sock = next(iter(app.server.sockets))
    return int(sock.getsockname()[1])
