"""Test helpers: in-process servers on 127.0.0.1:0 and a small protocol client.

The fake engine (rtts.engines.fake.FakeEngine) is the documented test double for
server-logic tests; tests marked ``chattts`` run the real ChatTTS code on the tiny
random-weight checkpoint, generated once per test session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from rtts.api.native.protocol import FrameHeader, unpack_frame
from rtts.config import EngineConfig, ServerConfig
from rtts.core.scheduler import SchedulerConfig
from rtts.engines.fake import FakeEngine
from rtts.server import App, bound_port, run_server

TIME_UNIT = float(os.environ.get("RTTS_TEST_TIME_UNIT", "1.0"))  # scale timeouts on slow CI


def base_config(**overrides: Any) -> ServerConfig:
    cfg = ServerConfig(port=0, ping_interval_s=None, shutdown_grace_s=2.0,
                       engine=EngineConfig(name="fake"),
                       scheduler=SchedulerConfig(max_wait_ms=5.0, request_timeout_s=10.0))
    return replace(cfg, **overrides)


@contextlib.asynccontextmanager
async def server(config: ServerConfig | None = None,
                 engine: Any = None) -> AsyncIterator[tuple[App, str]]:
    cfg = config or base_config()
    async with run_server(cfg, engine or FakeEngine()) as app:
        yield app, f"ws://127.0.0.1:{bound_port(app)}{cfg.ws_path}"


@dataclass
class Received:
    events: list[dict[str, Any]] = field(default_factory=list)
    frames: list[tuple[FrameHeader, bytes]] = field(default_factory=list)

    def of(self, kind: str, context_id: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind
                and (context_id is None or e.get("context_id") == context_id)]

    def audio(self, stream: int) -> bytes:
        return b"".join(p for h, p in self.frames if h.stream == stream)


class Client:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.got = Received()

    async def send(self, **msg: Any) -> None:
        await self.ws.send(json.dumps(msg))

    async def recv_until(self, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Receive (recording everything) until an event satisfies ``pred``."""
        async with asyncio.timeout(timeout * TIME_UNIT):
            while True:
                msg = await self.ws.recv()
                if isinstance(msg, bytes):
                    self.got.frames.append(unpack_frame(msg))
                    continue
                event = json.loads(msg)
                self.got.events.append(event)
                if pred(event):
                    return event

    async def until_all(self, kind: str, context_ids: set[str],
                        timeout: float = 10.0) -> None:
        """Receive until ``kind`` has arrived for every context (in any order)."""
        seen = {e.get("context_id") for e in self.of_kind(kind)}
        if context_ids <= seen:
            return
        await self.recv_until(
            lambda e: e["type"] == kind and context_ids <= (
                seen.add(e.get("context_id")) or seen), timeout)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return self.got.of(kind)

    async def until(self, kind: str, context_id: str | None = None,
                    timeout: float = 10.0) -> dict[str, Any]:
        return await self.recv_until(
            lambda e: e["type"] == kind and (context_id is None
                                             or e.get("context_id") == context_id), timeout)


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    async with connect(url, max_size=None) as ws:
        c = Client(ws)
        hello = await c.until("ready")
        assert hello["protocol"] == 1
        yield c


class ServerThread:
    """A real rtts server on its own event loop thread, for synchronous clients (the
    browser tests' playwright API): ``with ServerThread(engine, config) as srv:`` serves
    on ``srv.port`` (``srv.app`` is the running :class:`~rtts.server.App`)."""

    def __init__(self, engine: Any, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or base_config()
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with run_server(self.config, self.engine) as app:
            self.app = app
            self.port = bound_port(app)
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
