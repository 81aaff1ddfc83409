"""Regression tests for the abuse probe's findings (issue 17), over real sockets.

Each test is written against what the probe did: raw upgrades that never complete, resets,
tokens carried between instances, idle sockets, odd paths. The fake engine (the
documented test double) stands in for the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import socket
import struct
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from helpers import Client, base_config, server
from rtts.api import listener
from rtts.api.admission import client_address
from rtts.api.auth import AuthConfig, Authenticator, AuthError, key_id
from rtts.api.http.app import published
from rtts.api.native.session import Session
from rtts.errors import CLOSE_IDLE
from rtts.server import bound_port

KEY = "k1-a-long-enough-test-key"
SECRET = b"s" * 32


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET"
         ) -> tuple[int, Any, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> tuple[int, Any, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


async def _status(url: str, **kw: Any) -> int:
    try:
        async with connect(url, **kw) as ws:
            await ws.recv()
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


def _raw(port: int, request: bytes, *, read: bool = True, reset: bool = False) -> bytes:
    """Send raw bytes; read the answer (or not); close normally or with a TCP reset."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(request)
        data = b""
        if read:
            with contextlib.suppress(TimeoutError, ConnectionError):
                s.settimeout(2)
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return data
    finally:
        s.close()


def _upgrade(path: str, extra: str = "", key: bool = True) -> bytes:
    head = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n")
    if key:
        head += "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    return (head + extra + "\r\n").encode()


def _auth_cfg(**kw: Any) -> Any:
    return base_config(auth=AuthConfig(api_keys=(KEY,), token_secret=SECRET, **kw))


# -- 1. the per-key count leaked: failed, reset and dropped handshakes locked a key out -----

async def test_failed_reset_and_dropped_handshakes_do_not_lock_a_key_out() -> None:
    cfg = _auth_cfg(max_sessions_per_key=3, sessions_per_minute=20,
                    allowed_origins=("http://good.example",))
    async with server(cfg) as (app, url):
        port = bound_port(app)
        bearer = f"Authorization: Bearer {KEY}\r\n"
        # three upgrades the handshake refuses after the checks passed (no key: 400/426)
        for _ in range(3):
            answer = await asyncio.to_thread(_raw, port, _upgrade("/v1/stream", bearer,
                                                                   key=False))
            assert answer.split(b" ")[1] in (b"400", b"426"), answer[:40]
        # five valid upgrades reset at once, and five dropped before reading the answer
        for _ in range(5):
            await asyncio.to_thread(_raw, port, _upgrade("/v1/stream", bearer), read=False,
                                    reset=True)
            await asyncio.to_thread(_raw, port, _upgrade("/v1/stream", bearer), read=False)
        # the same with a browser token
        token = json.loads((await asyncio.to_thread(
            _get, f"http://127.0.0.1:{port}/v1/token", {"Authorization": f"Bearer {KEY}"}))[2]
        )["token"]
        for _ in range(3):
            await asyncio.to_thread(_raw, port, _upgrade(f"/v1/stream?token={token}"),
                                    read=False, reset=True)
        await asyncio.sleep(0.5)
        assert not app.auth.active  # nothing counted for sessions that never opened
        # a correct client still gets all three of the key's sessions
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with connect(url, additional_headers=hdr) as a, \
                connect(url, additional_headers=hdr) as b, \
                connect(f"{url}?token={token}") as c:
            for ws in (a, b, c):
                assert json.loads(await ws.recv())["type"] == "ready"
            assert sum(app.auth.active.values()) == 3
            assert await _status(url, additional_headers=hdr) == 429
        await asyncio.sleep(0.3)
        assert not app.auth.active  # released on every path out
        counts = app.native.admission.counts
        assert counts.total == 0 and not counts.per_client


# -- 2/3. every synthesis endpoint goes through auth, origin and quota --------------------

async def test_http_synthesis_endpoints_need_key_origin_and_quota() -> None:
    cfg = _auth_cfg(allowed_origins=("http://good.example",), max_sessions_per_key=1)
    async with server(cfg) as (app, url):
        base = f"http://127.0.0.1:{bound_port(app)}"
        speech = {"model": "tts-1", "voice": "alloy", "input": "Hello there."}
        tts = f"{base}/v1/tts?text=Hello%20there."
        good = {"Authorization": f"Bearer {KEY}"}
        # no key
        assert (await asyncio.to_thread(_get, tts))[0] == 401
        assert (await asyncio.to_thread(_post, f"{base}/v1/audio/speech", speech))[0] == 401
        # a page on another origin, even with a valid token (<audio src> from anywhere)
        token = json.loads((await asyncio.to_thread(_get, f"{base}/v1/token", good))[2])["token"]
        evil = {"Origin": "http://evil.example"}
        assert (await asyncio.to_thread(_get, f"{tts}&token={token}", evil))[0] == 403
        assert (await asyncio.to_thread(_post, f"{base}/v1/audio/speech", speech,
                                        {**good, **evil}))[0] == 403
        # allowed
        status, headers, body = await asyncio.to_thread(
            _get, f"{tts}&token={token}", {"Origin": "http://good.example"})
        assert status == 200 and body[:4] == b"RIFF"
        # over quota: the key's one session is held by a WebSocket
        async with connect(url, additional_headers=good) as ws:
            await ws.recv()
            status, headers, body = await asyncio.to_thread(_get, tts, good)
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
            status, _, _ = await asyncio.to_thread(_post, f"{base}/v1/audio/speech", speech,
                                                   good)
            assert status == 429
            # ElevenLabs' HTTP stream and socket: the same checks, over quota too
            eleven = f"{base}/v1/text-to-speech/alloy/stream"
            status, _, _ = await asyncio.to_thread(_post, eleven, {"text": "Hi."},
                                                   {"xi-api-key": KEY})
            assert status == 429
        el_ws = url.replace("/v1/stream", "/v1/text-to-speech/alloy/stream-input")
        assert (await asyncio.to_thread(_post, eleven, {"text": "Hi."}))[0] == 401
        assert (await asyncio.to_thread(_post, eleven, {"text": "Hi."},
                                        {"xi-api-key": KEY, **evil}))[0] == 403
        assert (await asyncio.to_thread(_post, eleven, {"text": "Hi."},
                                        {"xi-api-key": KEY}))[0] == 200
        assert await _status(el_ws, additional_headers={"xi-api-key": "wrong"}) == 401
        assert await _status(el_ws, additional_headers={"xi-api-key": KEY, **evil}) == 403
        async with connect(el_ws) as ws:  # no key at the upgrade: the first message must
            await ws.send(json.dumps({"text": " "}))  # carry one; without it, refused
            reply = json.loads(await ws.recv())
            assert "key" in reply["message"].lower()
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008
        metrics = (await asyncio.to_thread(_get, f"{base}/metrics"))[2].decode()
        assert 'rtts_auth_rejected_total{reason="unauthorized"} 5' in metrics
        assert 'rtts_auth_rejected_total{reason="forbidden_origin"} 4' in metrics
        assert 'rtts_auth_rejected_total{reason="quota"} 3' in metrics


async def test_tts_streams_past_the_head_timeout_and_stops_when_the_client_leaves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "HEAD_TIMEOUT_S", 0.5)
    from rtts.engines.fake import FakeEngine

    # ~2.4 s of audio made in real time: longer than the (shortened) head timeout
    async with server(engine=FakeEngine(rtf=1.0, ms_per_char=60.0)) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        text = quote("Twenty words of text that take a while to say.")
        status, _, body = await asyncio.to_thread(_get, f"{base}/v1/tts?text={text}&format=pcm")
        assert status == 200 and len(body) > 2 * 24000 * 1.0  # not cut short
        # a client that leaves after the first bytes: the synthesis stops with it
        long = quote("This sentence is one of many. " * 20)
        cancels = app.stats.cancels

        def leave_early() -> None:
            with urllib.request.urlopen(f"{base}/v1/tts?text={long}&format=pcm",
                                        timeout=10) as r:
                r.read(1000)

        await asyncio.to_thread(leave_early)
        for _ in range(50):
            if (app.stats.cancels > cancels and not app.scheduler.queue_depth
                    and not app.scheduler.running_batches):
                break
            await asyncio.sleep(0.1)
        assert app.stats.cancels > cancels and not app.scheduler.running_batches


# -- 4. tokens across replicas, restarts and rotation ---------------------------------------

async def test_tokens_work_across_instances_restarts_and_rotation() -> None:
    async with server(_auth_cfg()) as (a, _):
        token = json.loads((await asyncio.to_thread(
            _get, f"http://127.0.0.1:{bound_port(a)}/v1/token",
            {"Authorization": f"Bearer {KEY}"}))[2])["token"]
    # "another replica", or the same one after a restart: same secret
    async with server(_auth_cfg()) as (b, url_b):
        assert await _status(f"{url_b}?token={token}") == 101
    # a replica with another secret refuses it
    other = base_config(auth=AuthConfig(api_keys=(KEY,), token_secret=b"x" * 32))
    async with server(other) as (c, url_c):
        assert await _status(f"{url_c}?token={token}") == 401
    # rotation: the new secret, with the old one as previous, accepts old tokens
    rotated = base_config(auth=AuthConfig(api_keys=(KEY,), token_secret=b"x" * 32,
                                          previous_token_secret=SECRET))
    async with server(rotated) as (d, url_d):
        assert await _status(f"{url_d}?token={token}") == 101
        new = json.loads((await asyncio.to_thread(
            _get, f"http://127.0.0.1:{bound_port(d)}/v1/token",
            {"Authorization": f"Bearer {KEY}"}))[2])["token"]
        assert await _status(f"{url_d}?token={new}") == 101


def test_key_ids_are_hmacs_under_the_secret() -> None:
    a = Authenticator(AuthConfig(api_keys=(KEY,), token_secret=SECRET))
    kid = a.key_from_header(f"Bearer {KEY}")
    assert kid == key_id(KEY, SECRET)
    assert kid == hmac.new(SECRET, b"rtts-key-id\0" + KEY.encode(),
                           hashlib.sha256).hexdigest()[:16]
    assert kid != hashlib.sha256(KEY.encode()).hexdigest()[:12]  # not guessable offline
    assert key_id(KEY, b"y" * 32) != kid
    token = a.issue_token(kid, 1000)
    assert hashlib.sha256(KEY.encode()).hexdigest()[:12] not in token


def test_retry_after_is_computed_from_the_window() -> None:
    a = Authenticator(AuthConfig(api_keys=(KEY,), token_secret=SECRET, sessions_per_minute=2,
                                 max_sessions_per_key=5))
    kid = a.identify(f"Bearer {KEY}", None, 0)
    a.admit(kid, 100.0)
    a.admit(kid, 130.0)
    with pytest.raises(AuthError) as info:
        a.admit(kid, 135.0)
    assert info.value.status == 429 and info.value.retry_after_s == 25  # 100 + 60 - 135
    with pytest.raises(AuthError) as info:
        a.admit(kid, 159.5)
    assert info.value.retry_after_s == 1
    a.admit(kid, 160.0)  # the first start left the window


async def test_retry_after_header_on_the_handshake() -> None:
    async with server(_auth_cfg(sessions_per_minute=1)) as (app, url):
        hdr = {"Authorization": f"Bearer {KEY}"}
        assert await _status(url, additional_headers=hdr) == 101
        with pytest.raises(InvalidStatus) as info:
            async with connect(url, additional_headers=hdr):
                pass
        assert info.value.response.status_code == 429
        assert 55 <= int(info.value.response.headers["Retry-After"]) <= 60


# -- 5. one client cannot take every slot; idle sockets are closed ------------------------

async def test_per_client_connection_cap_and_forwarded_for() -> None:
    async with server(base_config(max_connections_per_client=3)) as (app, url):
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(3):
                ws = await stack.enter_async_context(connect(url))
                await ws.recv()
            assert await _status(url) == 429
            # behind a trusted proxy (loopback by default), X-Forwarded-For is the client
            for who in ("10.0.0.1", "10.0.0.2"):
                assert await _status(url, additional_headers={"X-Forwarded-For": who}) == 101
        await asyncio.sleep(0.2)
        assert await _status(url) == 101  # the slots came back
    assert client_address("10.1.1.1", "1.2.3.4", ("127.0.0.1",)) == "10.1.1.1"  # untrusted
    assert client_address("127.0.0.1", "1.2.3.4, 127.0.0.1", ("127.0.0.1",)) == "1.2.3.4"
    assert client_address("127.0.0.1", None, ("127.0.0.1",)) == "127.0.0.1"
    assert client_address("10.0.0.5", "9.9.9.9, 8.8.8.8", ("10.0.0.0/8",)) == "8.8.8.8"


async def test_idle_connection_is_closed_but_a_busy_one_is_not() -> None:
    from rtts.engines.fake import FakeEngine

    cfg = base_config(idle_timeout_s=0.6)
    async with server(cfg, engine=FakeEngine(rtf=1.0)) as (app, url):
        async with connect(url) as idle, connect(url) as busy:
            await idle.recv()
            await busy.recv()
            client = Client(busy)
            await client.send(type="start", context_id="a")
            await client.send(type="text", context_id="a",
                              text="A sentence that takes a second or two to say aloud.")
            await client.send(type="end", context_id="a")
            started = time.monotonic()
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(idle.recv(), 5)
            assert idle.close_code == CLOSE_IDLE and idle.close_reason == "idle timeout"
            assert time.monotonic() - started < 3
            await client.recv_until(lambda e: e["type"] == "done", timeout=20)
            assert busy.close_code is None  # speaking longer than the timeout: still open
        assert app.stats.idle_closed == 1


# -- 6. odd input is a 4xx, never a 500 with a traceback ----------------------------------

async def test_odd_paths_and_tokens_are_4xx_without_tracebacks(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with server(_auth_cfg()) as (app, _):
        port = bound_port(app)
        for path in ("/%00", "/a%00b.js", "/" + "x" * 300, "/" + "y" * 300 + "/z.js"):
            answer = await asyncio.to_thread(
                _raw, port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 404"), (path, answer[:60])
        answer = await asyncio.to_thread(
            _raw, port, _upgrade("/v1/stream?token=%C3%A9t%C3%A9.abc"))
        assert answer.startswith(b"HTTP/1.1 401"), answer[:60]
        answer = await asyncio.to_thread(
            _raw, port, "GET /v1/tts?text=hi&token=\u00e9.\u00e9 HTTP/1.1\r\nHost: x\r\n\r\n"
            .encode("latin-1"))
        assert answer[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 401"), answer[:60]
        good = {"Authorization": f"Bearer {KEY}"}
        for query in ("sample_rate=999999999999999999999", "seed=abc", "temperature=nan",
                      "top_K=-99999999999999"):
            status, _, body = await asyncio.to_thread(
                _get, f"http://127.0.0.1:{port}/v1/tts?text=hi&{query}", good)
            assert status == 400 and json.loads(body)["error"]["param"] == query.split("=")[0]
        for name in ([], {}, 5, None):  # found by schemathesis: a list name was a 500
            status, _, body = await asyncio.to_thread(
                _post, f"http://127.0.0.1:{port}/v1/voices", {"name": name, "seed": 1}, good)
            assert status == 400, (name, body)
        status, _, _ = await asyncio.to_thread(
            _get, f"http://127.0.0.1:{port}/v1/info", {"Authorization": "Bearer \u00e9"
                                                       .encode().decode("latin-1")})
        assert status == 200
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


# -- 7. stream numbers wrap at 65,536 without losing the reused number's audio ------------

def test_stream_numbers_wrap_and_skip_open_ones() -> None:
    from rtts.api.native.protocol import parse_client_message

    session = Session()

    def start(cid: str) -> Any:
        msg = parse_client_message(json.dumps({"type": "start", "context_id": cid}))
        return session.receive(msg)[0].context

    def cancel(cid: str) -> None:
        session.receive(parse_client_message(json.dumps({"type": "cancel", "context_id": cid})))

    keep = start("keep")  # stream 1 stays open through the wrap
    assert keep.stream == 1
    serials = {keep.serial}
    streams = []
    for i in range(65_535):
        ctx = start(f"c{i}")
        serials.add(ctx.serial)
        streams.append(ctx.stream)
        cancel(f"c{i}")
    assert len(serials) == 65_536  # serials never repeat
    assert streams[:2] == [2, 3] and streams[-2] == 65535
    assert streams[-1] == 2  # wrapped; 1 is still open ("keep"): skipped
    assert start("again").stream == 3


async def test_reused_stream_number_after_a_cancel_delivers_its_audio() -> None:
    async with server() as (app, url):
        async with connect(url) as ws:
            client = Client(ws)
            await client.recv_until(lambda e: e["type"] == "ready")
            await client.send(type="start", context_id="old")
            await client.send(type="cancel", context_id="old")  # stream 1, cancelled
            await client.recv_until(lambda e: e["type"] == "cancelled")
            conn = next(iter(app.connections))
            conn.session._next_stream = 65535  # as after 65,534 more contexts
            for cid in ("last", "wrapped"):
                await client.send(type="start", context_id=cid)
                await client.send(type="text", context_id=cid, text="Short one.")
                await client.send(type="end", context_id=cid)
                done = await client.recv_until(
                    lambda e, c=cid: e["type"] == "done" and e["context_id"] == c)
                assert done
            streams = {e["context_id"]: e["stream"] for e in client.got.of("segment_started")}
            assert streams["wrapped"] == 1  # the cancelled context's number, reused
            samples = sum(e["samples"] for e in client.got.of("segment_done", "wrapped"))
            assert samples > 0 and len(client.got.audio(1)) == 2 * samples


# -- 10. the web directory publishes only the demo and the library -----------------------

async def test_static_files_publish_only_the_demo_and_library(tmp_path: Path) -> None:
    web = tmp_path / "web"
    (web / "test").mkdir(parents=True)
    (web / "types").mkdir()
    (web / "index.html").write_text("<!doctype html><title>demo</title>")
    (web / "client.js").write_text("export const x = 1;")
    (web / "types" / "client.d.ts").write_text("export declare const x: number;")
    (web / ".env").write_text("SECRET=1")
    (web / ".git").mkdir()
    (web / ".git" / "config").write_text("[core]")
    (web / "test" / "client.test.js").write_text("test")
    (web / "package-lock.json").write_text("{}")
    (web / "package.json").write_text("{}")
    async with server(base_config(web_dir=web)) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        for hidden in ("/.env", "/.git/config", "/test/client.test.js", "/package-lock.json",
                       "/package.json", "/test/../.env"):
            assert (await asyncio.to_thread(_get, base + hidden))[0] == 404, hidden
        status, headers, body = await asyncio.to_thread(_get, base + "/")
        assert status == 200 and b"demo" in body
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        assert headers["X-Frame-Options"] == "DENY"
        status, headers, body = await asyncio.to_thread(_get, base + "/client.js", None, "HEAD")
        assert status == 200 and body == b"" and headers["Content-Length"] == "19"
        assert headers["Content-Type"].startswith("text/javascript")
        status, headers, _ = await asyncio.to_thread(_get, base + "/types/client.d.ts")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        status, headers, _ = await asyncio.to_thread(_get, base + "/client.js", None, "OPTIONS")
        assert status == 405 and headers["Allow"] == "GET, HEAD"
        info = json.loads((await asyncio.to_thread(_get, base + "/v1/info"))[2])
        assert socket.gethostname() not in info["instance"]
    assert published("index.html") and published("types/client.d.ts")
    assert not published(".env") and not published("a/.hidden/b.js")


def test_safety_warnings() -> None:
    from rtts.cli.main import safety_warnings

    open_cfg = replace(base_config(), host="0.0.0.0")
    assert any("auth off" in w for w in safety_warnings(open_cfg))
    assert not safety_warnings(base_config())  # loopback, auth off: fine for development
    keyed = replace(base_config(), host="0.0.0.0",
                    auth=AuthConfig(api_keys=(KEY,)))
    assert any("--token-secret" in w for w in safety_warnings(keyed))
    assert not safety_warnings(replace(keyed, auth=AuthConfig(api_keys=(KEY,),
                                                              token_secret=SECRET)))
