"""The port's listener (rtts.api.listener): the protocol is chosen per request, so a kept-alive
HTTP connection that upgrades to a WebSocket is served (aiohttp reuses connections for
``ws_connect``); every request head has a deadline; every connection counts in the caps.

Driven with raw sockets (to control exactly which bytes go on which connection) and with the
real aiohttp client on one session, as LiveKit uses it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import time
from dataclasses import replace

import aiohttp
import pytest

from helpers import base_config, server
from rtts.api import listener
from rtts.server import bound_port


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    body = b""
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                break
    return status, headers, body


def _upgrade(path: str, extra: str = "") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n").encode()


async def test_keep_alive_connection_upgrades_on_its_second_request():
    async with server() as (app, _):
        port = bound_port(app)
        for path in ("/v1/stream", "/v1/text-to-speech/alloy/multi-stream-input"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):  # two plain requests, kept alive
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, body = await _read_response(reader)
                assert (status, body) == (200, b"ok\n")
            writer.write(_upgrade(path))  # then the same connection upgrades
            status, headers, _ = await _read_response(reader)
            assert status == 101, (path, status)
            assert headers["upgrade"].lower() == "websocket"
            writer.close()
            await writer.wait_closed()
        # a refused upgrade mid keep-alive gets the WebSocket side's own answer
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        writer.write(_upgrade("/v1/text-to-speech/alloy/not-a-socket"))
        assert (await _read_response(reader))[0] == 404
        writer.close()


async def test_aiohttp_session_reuses_the_connection_for_ws_connect():
    """aiohttp's connector hands the kept-alive connection to ``ws_connect``: with a limit of
    one connection, the HTTP requests and both sockets run over the same TCP connection."""
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            async with session.post(base + "/v1/audio/speech", json={
                    "model": "tts-1", "input": "Hi there.", "voice": "alloy",
                    "response_format": "pcm"}) as resp:
                assert resp.status == 200 and len(await resp.read()) > 1000
            async with session.get(base + "/v1/audio/voices") as resp:
                assert resp.status == 200
            url = (base.replace("http", "ws") + "/v1/text-to-speech/alloy/multi-stream-input"
                   "?output_format=pcm_24000")
            async with session.ws_connect(url) as ws:
                await ws.send_json({"text": " ", "context_id": "a"})
                await ws.send_json({"text": "Hello there.", "context_id": "a", "flush": True})
                await ws.send_json({"context_id": "a", "close_context": True})
                got_audio = False
                async with asyncio.timeout(10):
                    while True:
                        msg = json.loads((await ws.receive()).data)
                        got_audio |= bool(msg.get("audio"))
                        if msg.get("isFinal"):
                            break
                assert got_audio
        assert app.stats.connections_total == 1  # the one ElevenLabs socket


async def test_a_trickled_second_request_head_is_timed_out(monkeypatch):
    monkeypatch.setattr(listener, "HEAD_TIMEOUT_S", 0.5)
    async with server() as (app, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(app))
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        t0 = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nHo")  # part of a second head...
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            async with asyncio.timeout(5):
                for _ in range(50):  # ...and a byte now and then, less than the keep-alive
                    await asyncio.sleep(0.1)
                    writer.write(b"x")
                    await writer.drain()
                await reader.readexactly(1)
        assert time.monotonic() - t0 < 2.0
        writer.close()
        # a full second request on another connection is answered as before
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(app))
        for _ in range(2):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _read_response(reader))[0] == 200
        writer.close()


async def _open_idle(port: int, n: int) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 200  # now idle, kept alive
        writers.append(writer)
    return writers


async def _refused(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        status, headers, _ = await _read_response(reader)
        assert headers["connection"] == "close" and "retry-after" in headers
        assert await reader.read() == b""  # and closed
        return status
    finally:
        writer.close()


async def test_http_connections_count_in_the_connection_caps():
    # 127.0.0.1 is not a trusted proxy here, so the per-client cap applies to it
    cfg = base_config(max_connections_per_client=3, trusted_proxies=())
    async with server(cfg) as (app, _):
        port = bound_port(app)
        counts = app.native.admission.counts
        idle = await _open_idle(port, 3)
        assert counts.total == 3
        assert await _refused(port) == 429
        # a WebSocket upgrade from the same client is refused too (the same counts)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_upgrade("/v1/stream"))
        assert (await _read_response(reader))[0] == 429
        writer.close()
        idle.pop().close()
        await asyncio.sleep(0.1)
        assert counts.total == 2
        more = await _open_idle(port, 1)  # room again
        for w in idle + more:
            w.close()
        await asyncio.sleep(0.1)
        assert counts.total == 0 and counts.per_client == {}
    cfg = base_config(max_connections=2)  # the total, for trusted and untrusted alike
    async with server(cfg) as (app, _):
        port = bound_port(app)
        idle = await _open_idle(port, 2)
        assert await _refused(port) == 503
        for w in idle:
            w.close()


async def test_a_websocket_session_moves_from_the_listener_count_to_the_admission():
    cfg = base_config(max_connections_per_client=2, trusted_proxies=())
    async with server(cfg) as (app, url):
        port = bound_port(app)
        counts = app.native.admission.counts
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        writer.write(_upgrade("/v1/stream"))
        assert (await _read_response(reader))[0] == 101
        await asyncio.sleep(0.1)
        assert counts.total == 1  # counted once, as a session
        writer.close()
        await asyncio.sleep(0.2)
        assert counts.total == 0


def test_connection_cap_fits_under_the_open_file_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = listener.connection_cap(10**9)
    if soft != resource.RLIM_INFINITY:
        assert cap == soft - listener.FD_RESERVE
    assert listener.connection_cap(5) == 5


async def test_metrics_scrape_does_not_count_itself_and_responses_carry_a_request_id():
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/metrics") as resp:
                text = await resp.text()
            assert re.search(r"^rtts_active_http_requests 0$", text, re.M), text
            ids = set()
            for path in ("/healthz", "/v1/models", "/v1/nope"):
                async with session.get(base + path) as resp:
                    ids.add(resp.headers["x-request-id"])
            assert len(ids) == 3 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
            async with session.get(base + "/healthz",
                                   headers={"X-Request-Id": "trace-42"}) as resp:
                assert resp.headers["x-request-id"] == "trace-42"  # a client's id is kept
            async with session.get(base + "/healthz",
                                   headers={"X-Request-Id": "bad id;" * 30}) as resp:
                assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])


async def test_config_defaults_keep_loopback_clients_out_of_the_per_client_cap():
    """127.0.0.1 is a trusted proxy by default (nginx in front): its connections count only
    in the total, and a direct WebSocket client from it is still capped per client."""
    cfg = replace(base_config(), max_connections_per_client=1)
    async with server(cfg) as (app, _):
        idle = await _open_idle(bound_port(app), 3)
        assert app.native.admission.counts.per_client == {}
        for w in idle:
            w.close()
