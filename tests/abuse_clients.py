"""The abusive clients of the mixed-abuse load (tests/test_abuse.py), run as a process of
their own so that their work does not slow the well-behaved client the test measures.

``python tests/abuse_clients.py PORT WYOMING_PORT CLIENTS SECONDS BOMB_FILE`` runs
``CLIENTS`` coroutines for ``SECONDS``, each one kind of abuse in a loop (the kinds of
tests/test_security3.py: slowloris heads and bodies, idle TCP and WebSocket sockets, 20,000-
character normalization texts, speaker-string bombs, job bombs with a million chapter marks,
protocol-error floods, silent Wyoming connections), from the source addresses
127.0.0.10-13 (so the per-address caps apply to them, not to the measuring client). It prints
one JSON line: per kind, the operations done and the exceptions met.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.client import connect

HOSTILE_TEXT = "3-5 " * 5000  # 20,000 characters
SOURCES = [f"127.0.0.{i}" for i in range(10, 14)]

ops: Counter[str] = Counter()
errors: Counter[str] = Counter()


async def _open(port: int, n: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port,
                                         local_addr=(SOURCES[n % len(SOURCES)], 0))


async def _request(port: int, n: int, head: bytes, body: bytes = b"") -> None:
    reader, writer = await _open(port, n)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(15):
            await reader.read(65536)
    finally:
        writer.close()


async def slow_head(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    reader, writer = await _open(port, n)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        while not stop.is_set() and not reader.at_eof():
            await asyncio.sleep(1.0)
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
    finally:
        writer.close()


async def slow_body(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    reader, writer = await _open(port, n)
    try:
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        while not stop.is_set() and not reader.at_eof():
            await asyncio.sleep(0.5)
            writer.write(b" ")
            await writer.drain()
    finally:
        writer.close()


async def idle_tcp(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    held = [await _open(port, n) for _ in range(20)]
    try:
        while not stop.is_set() and not all(r.at_eof() for r, _ in held):
            await _wait(stop, 0.5)
    finally:
        for _, w in held:
            w.close()


async def idle_ws(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    async with connect(f"ws://127.0.0.1:{port}/v1/stream",
                       local_addr=(SOURCES[n % len(SOURCES)], 0)) as ws:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                async for _ in ws:
                    if stop.is_set():
                        return


async def normalize(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None,
                       local_addr=(SOURCES[n % len(SOURCES)], 0)) as ws:
        reader = asyncio.create_task(_drain(ws))
        try:
            for i in range(4):
                if stop.is_set():
                    return
                await ws.send(json.dumps({"type": "start", "context_id": f"h{i}"}))
                await ws.send(json.dumps({"type": "text", "context_id": f"h{i}",
                                          "text": HOSTILE_TEXT}))
                await asyncio.sleep(1.0)
                await ws.send(json.dumps({"type": "cancel", "context_id": f"h{i}"}))
        finally:
            reader.cancel()


async def _drain(ws: Any) -> None:
    with contextlib.suppress(Exception):
        async for _ in ws:
            pass


async def speaker_bomb(port: int, n: int, stop: asyncio.Event, bomb: str = "",
                       **_: Any) -> None:
    body = json.dumps({"name": f"bomb{n}", "speaker": bomb}).encode()
    await _request(port, n, b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n", body)
    await asyncio.sleep(0.5)


_CHAPTERS = json.dumps({"text": "A short text.", "chapters": list(range(1, 1_000_001))}
                       ).encode()


async def job_bomb(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    await _request(port, n, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(_CHAPTERS)).encode() + b"\r\n\r\n", _CHAPTERS)
    await asyncio.sleep(2.0)


async def error_flood(port: int, n: int, stop: asyncio.Event, **_: Any) -> None:
    async with connect(f"ws://127.0.0.1:{port}/v1/stream",
                       local_addr=(SOURCES[n % len(SOURCES)], 0)) as ws:
        for _ in range(30):  # past --max-protocol-errors: closed 1008
            await ws.send("{not json")
        await _drain(ws)
    await asyncio.sleep(0.5)


async def wyoming_silent(port: int, n: int, stop: asyncio.Event, wport: int = 0,
                         **_: Any) -> None:
    reader, writer = await _open(wport, n)
    try:
        writer.write(b'{"type": "synthesize", "data_length": 100}\n')  # data never comes
        async with asyncio.timeout(40):
            while not stop.is_set() and not reader.at_eof():
                await _wait(stop, 0.5)
    finally:
        writer.close()


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    """Until ``stop`` is set, or ``seconds``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


KINDS: list[Callable[..., Awaitable[None]]] = [
    slow_head, slow_body, idle_tcp, idle_ws, normalize, speaker_bomb, job_bomb, error_flood,
    wyoming_silent]


async def client(kind: Callable[..., Awaitable[None]], port: int, n: int,
                 stop: asyncio.Event, **kw: Any) -> None:
    while not stop.is_set():
        try:
            await kind(port, n, stop, **kw)
            ops[kind.__name__] += 1
        except Exception as exc:  # the server closing on us is the point
            errors[f"{kind.__name__}:{type(exc).__name__}"] += 1
            await asyncio.sleep(0.2)


async def main(port: int, wport: int, clients: int, seconds: float, bomb: str) -> None:
    stop = asyncio.Event()
    only = os.environ.get("RTTS_ABUSE_KINDS")  # (to look at one kind: "normalize,idle_ws")
    kinds = [k for k in KINDS if not only or k.__name__ in only.split(",")]
    tasks = [asyncio.create_task(client(kinds[i % len(kinds)], port, i, stop, bomb=bomb,
                                        wport=wport)) for i in range(clients)]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"ops": dict(ops), "errors": dict(errors),
                      "seconds": round(time.monotonic() - t0, 1)}), flush=True)


if __name__ == "__main__":
    p, w, c, s, bomb_file = sys.argv[1:6]
    with open(bomb_file) as f:
        bomb_text = f.read()
    asyncio.run(main(int(p), int(w), int(c), float(s), bomb_text))
