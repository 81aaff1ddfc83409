"""Running a fleet: usage per key over every protocol, the capacity gauge an autoscaler
targets, and the admin drain a Kubernetes preStop calls, over real sockets."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from helpers import Client, base_config, server
from rtts.api.auth import AuthConfig
from rtts.core.usage import KeyUsage, Usage
from rtts.engines.fake import FakeEngine
from rtts.server import bound_port

KEYS = ("key-alpha-0123456789", "key-beta-0123456789")
ADMIN = "admin-key-0123456789"


def http(port: int, path: str, *, method: str = "GET", key: str | None = None
         ) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


async def ahttp(port: int, path: str, **kw: Any) -> tuple[int, Any]:
    return await asyncio.to_thread(http, port, path, **kw)


def metric(text: str, name: str, key: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{key="{key}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_usage_counts_per_account_bounded_and_hands_over_deltas():
    u = Usage()
    u.context("a")
    u.characters("a", 5)
    u.audio(None, 1.5)
    assert u.of("a") == KeyUsage(5, 0.0, 1) and u.of("anonymous").audio_seconds == 1.5
    pending = u.take_pending()
    assert pending["a"] == KeyUsage(5, 0.0, 1) and u.take_pending() == {}
    u.characters("a", 2)
    u.restore(pending)  # a failed flush: the deltas come back, added to the new ones
    assert u.take_pending()["a"] == KeyUsage(7, 0.0, 1)
    assert u.of("a") == KeyUsage(7, 0.0, 1)  # the totals never go back
    from rtts.core import usage as mod
    small = Usage()
    for i in range(mod.MAX_ACCOUNTS + 3):
        small.characters(f"k{i}", 1)
    assert len(small.totals) == mod.MAX_ACCOUNTS + 1 and small.of("other").characters == 3


async def _native(url: str, key: str, text: str) -> tuple[int, float]:
    """One native context (key in the header): characters sent, audio seconds received."""
    async with connect(url, max_size=None,
                       additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        c = Client(ws)
        await c.until("ready")
        await c.send(type="start", context_id="n", sample_rate=24000)
        await c.send(type="text", context_id="n", text=text)
        await c.send(type="end", context_id="n")
        await c.until("done", "n", timeout=20)
        pcm = sum(len(p) for _, p in c.got.frames)
        return len(text), pcm / 2 / 24000


async def _openai(port: int, key: str, text: str) -> tuple[int, float]:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
    async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm") as resp:
        pcm = await resp.read()
    await client.close()
    return len(text), len(pcm) / 2 / 24000  # OpenAI's pcm: 24 kHz PCM16


async def _cartesia(port: int, key: str, text: str) -> tuple[int, float]:
    url = (f"ws://127.0.0.1:{port}/tts/websocket?cartesia_version=2025-04-16"
           f"&api_key={key}")
    async with connect(url) as ws:
        await ws.send(json.dumps({
            "context_id": "c", "model_id": "sonic-3", "transcript": text, "continue": False,
            "voice": {"mode": "id", "id": "a0e99841-438c-4a64-b679-ae501e7d6091"},
            "output_format": {"container": "raw", "encoding": "pcm_s16le",
                              "sample_rate": 24000}}))
        pcm = 0
        async with asyncio.timeout(20):
            while True:
                msg = json.loads(await ws.recv())
                if msg["type"] == "chunk":
                    pcm += len(base64.b64decode(msg["data"]))
                elif msg["type"] in ("done", "error"):
                    assert msg["type"] == "done", msg
                    break
    return len(text), pcm / 2 / 24000


async def test_usage_per_key_matches_what_each_key_sent_over_three_protocols():
    """Characters exactly, audio seconds within 1%, contexts, per key, over native,
    OpenAI HTTP (the openai SDK) and the Cartesia socket; /v1/usage tells each key its
    own, and /metrics has both."""
    cfg = base_config(auth=AuthConfig(api_keys=KEYS))
    async with server(cfg, FakeEngine(ms_per_char=4)) as (app, url):
        port = bound_port(app)
        a, b = KEYS
        sent: dict[str, list[tuple[int, float]]] = {a: [], b: []}
        # several segments each: the whitespace between them counts, as sent
        sent[a].append(await _native(url, a, "Hello there, this is the native socket. "
                                                 "It says two things."))
        sent[a].append(await _openai(port, a, "And this one came by OpenAI speech"))
        sent[b].append(await _cartesia(port, b, "Cartesia speaks for the other key. "
                                                   "Then once more, yes."))
        sent[b].append(await _openai(port, b, "Then OpenAI again for beta! Numbers: 42 and 7."))
        sent[b].append(await _native(url, b, "Native for beta too, at the end"))

        status, _ = await ahttp(port, "/v1/usage")
        assert status == 401
        status, body = await ahttp(port, "/metrics")
        ids = {k: app.auth.owner(app.auth.key_from_value(k) or "") for k in KEYS}
        for key in KEYS:
            chars = sum(n for n, _ in sent[key])
            audio = sum(s for _, s in sent[key])
            status, usage = await ahttp(port, "/v1/usage", key=key)
            assert status == 200, usage
            assert usage["key"] == ids[key] and usage["scope"] == "instance"
            assert usage["key_id"] == app.auth.key_from_value(key)
            assert usage["characters"] == chars
            assert usage["contexts"] == len(sent[key])
            assert usage["audio_seconds"] == pytest.approx(audio, rel=0.01)
            assert metric(body, "rtts_usage_characters_total", ids[key]) == chars
            assert metric(body, "rtts_usage_contexts_total", ids[key]) == len(sent[key])
            assert metric(body, "rtts_usage_audio_seconds_total", ids[key]) == \
                pytest.approx(audio, rel=0.01)
        # a browser token counts as (and reads the usage of) the key it was issued for
        token = app.auth.issue_token(app.auth.key_from_value(a) or "", time.time())
        status, usage = await ahttp(port, f"/v1/usage?token={token}")
        assert status == 200 and usage["key"] == ids[a]
        assert 'key="anonymous"' not in body  # every context had its key


async def test_usage_without_keys_is_the_anonymous_tenant():
    async with server(engine=FakeEngine(ms_per_char=2)) as (app, _):
        port = bound_port(app)
        n, _ = await _openai(port, "sk-none", "Nobody has a key here")
        status, usage = await ahttp(port, "/v1/usage")
        assert status == 200 and usage["key"] == "anonymous" and usage["characters"] == n


async def test_capacity_gauge_falls_back_to_slots_and_counts_every_protocol():
    cfg = base_config()
    async with server(cfg, FakeEngine(ms_per_char=30, rtf=1.0)) as (app, _):
        port = bound_port(app)
        slots = app.scheduler.slot_limit
        _, body = await ahttp(port, "/metrics")
        assert f"rtts_capacity_streams {slots}" in body
        assert 'rtts_capacity_info{source="slots"} 1' in body
        assert "rtts_capacity_utilization 0.0000" in body
        # an HTTP speech request in flight counts as a stream speaking
        task = asyncio.create_task(_openai(port, "sk", "A slow sentence to keep it busy. "
                                                     "And a second one after it."))
        for _ in range(200):
            if app.speaking:
                break
            await asyncio.sleep(0.02)
        _, body = await ahttp(port, "/metrics")
        assert "rtts_streams_speaking 1" in body
        assert f"rtts_capacity_utilization {1 / slots:.4f}" in body
        assert f"rtts_capacity_free_streams {slots - 1}" in body
        await task
        assert app.speaking == 0


async def test_admin_drain_finishes_live_sessions_refuses_new_ones_and_counts_to_zero():
    cfg = replace(base_config(auth=AuthConfig(api_keys=KEYS, admin_keys=(ADMIN,))),
                  shutdown_grace_s=10.0)
    async with server(cfg, FakeEngine(ms_per_char=15, rtf=0.5)) as (app, url):
        port = bound_port(app)
        key = KEYS[0]
        # refused without the admin key: 401 with the JSON error body; an API key is not one
        for who in (None, key):
            status, body = await ahttp(port, "/v1/admin/drain",
                                                   method="POST", key=who)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert app.state == "ready"
        async with connect(url, max_size=None,
                           additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            c = Client(ws)
            await c.until("ready")
            await c.send(type="start", context_id="a")
            await c.send(type="text", context_id="a", text="Finish this, please. " * 3)
            await c.send(type="end", context_id="a")
            await c.until("segment_started", "a")
            status, body = await ahttp(port, "/v1/admin/drain",
                                                   method="POST", key=ADMIN)
            assert status == 202 and body["draining"] and body["sessions"] == 1, body
            assert not body["done"]
            status, ready = await ahttp(port, "/readyz")
            assert status == 503 and "draining" in ready
            with pytest.raises(InvalidStatus) as refused:  # a new session is refused
                async with connect(url, additional_headers={"Authorization": f"Bearer {key}"}):
                    pass
            assert refused.value.response.status_code == 503
            status, _ = await ahttp(port, "/v1/tts?text=hi", key=key)
            assert status == 503
            done = await c.until("done", "a", timeout=30)  # the live one finishes
            assert done["segments"] == len(c.got.of("segment_done", "a")) >= 1
            for _ in range(100):
                status, body = await ahttp(port, "/v1/admin/drain",
                                                       key=ADMIN)
                if body["sessions"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert status == 200 and body["sessions"] == 0 and body["done"], body
            assert app.server is not None and app.server.is_serving()  # still answering


async def test_admin_api_is_off_without_an_admin_key():
    async with server() as (app, _):
        status, body = await ahttp(bound_port(app), "/v1/admin/drain",
                                               method="POST", key="anything")
        assert status == 403 and body["error"]["code"] == "forbidden"
        assert app.state == "ready"


async def test_usage_is_shared_by_instances_through_their_redis(redis_url):
    """Two instances on one Redis (the phrase cache's): each flushes its deltas
    (batched HINCRBY), and /v1/usage on either answers the sum."""
    import redis.asyncio as aioredis

    from rtts.core.cache import CacheConfig
    from rtts.core.usage import REDIS_PREFIX

    db = redis_url.rsplit("/", 1)[0] + "/7"
    r = aioredis.Redis.from_url(db)
    await r.flushdb()
    cfg = base_config(auth=AuthConfig(api_keys=KEYS, token_secret=b"s" * 32),
                      cache=CacheConfig(redis_url=db))
    async with server(cfg, FakeEngine(ms_per_char=2)) as (one, _), \
            server(cfg, FakeEngine(ms_per_char=2)) as (two, _):
        key = KEYS[0]
        n1, s1 = await _openai(bound_port(one), key, "First instance speaks. Twice.")
        n2, s2 = await _openai(bound_port(two), key, "The second one, once.")
        for app in (one, two):
            assert app.usage_flusher is not None
            await app.usage_flusher.flush()
        owner = one.auth.owner(one.auth.key_from_value(key) or "")
        assert owner == two.auth.owner(two.auth.key_from_value(key) or "")
        raw = await r.hgetall(REDIS_PREFIX + str(owner))
        assert int(raw[b"characters"]) == n1 + n2
        for app in (one, two):
            status, usage = await ahttp(bound_port(app), "/v1/usage", key=key)
            assert status == 200 and usage["scope"] == "shared"
            assert usage["characters"] == n1 + n2 and usage["contexts"] == 2
            assert usage["audio_seconds"] == pytest.approx(s1 + s2, rel=0.01)
        assert usage["instance"]["characters"] == n2  # this instance's own part
    await r.flushdb()
    await r.aclose()


async def test_rtts_drain_command_as_a_prestop_hook_on_a_real_process(tmp_path):
    """`rtts serve --admin-key` in its own process; `rtts drain` (what the preStop runs,
    key from RTTS_ADMIN_KEY) returns 0 once the live stream has finished, the server
    still up and not ready; a wrong key exits 2."""
    import subprocess
    import sys

    from procs import free_port, start_rtts

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    drain = [sys.executable, "-m", "rtts", "drain", "--url", base, "--wait", "30"]
    with start_rtts(["--engine", "fake", "--fake-rtf", "0.5", "--shutdown-grace", "5"], port,
                    tmp_path / "serve.log", env={"RTTS_ADMIN_KEY": ADMIN}):
        wrong = await asyncio.to_thread(subprocess.run, [*drain, "--admin-key", "nope"],
                                        capture_output=True, text=True, timeout=30)
        assert wrong.returncode == 2 and "401" in wrong.stderr
        async with connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None) as ws:
            c = Client(ws)
            await c.until("ready")
            await c.send(type="start", context_id="a")
            await c.send(type="text", context_id="a", text="Finish this one, please. " * 2)
            await c.send(type="end", context_id="a")
            await c.until("segment_started", "a")
            proc = await asyncio.create_subprocess_exec(
                *drain, env={**os.environ, "RTTS_ADMIN_KEY": ADMIN},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            await c.until("done", "a", timeout=30)
            out, err = await asyncio.wait_for(proc.communicate(), 40)
            assert proc.returncode == 0, (out, err)
            assert b"0 sessions left" in out
        status, text = await ahttp(port, "/readyz")
        assert status == 503 and "draining" in text


def test_capacity_rule_measured_when_steps_are_timed_else_slots():
    """The capacity is the engine's measured real-time streams once it has timed steps
    (0 included: not even one stream keeps up), else its slots."""
    from rtts.config import ServerConfig
    from rtts.core.service import Service

    class Measured(FakeEngine):
        kernels: dict[str, Any] = {}

        @property
        def info(self):  # type: ignore[override]
            return replace(super().info, kernels=self.kernels)

    engine = Measured()
    service = Service(ServerConfig(), engine, own_engine=False)
    slots = service.scheduler.slot_limit
    assert service.capacity() == (slots, "slots")
    engine.kernels = {"realtime_streams": 0}  # nothing timed yet
    assert service.capacity() == (slots, "slots")
    engine.kernels = {"realtime_streams": 3, "step_ms": {1: 20.0, 3: 21.0}}
    assert service.capacity() == (3, "measured")
    engine.kernels = {"realtime_streams": 0, "step_ms": {1: 90.0}}
    assert service.capacity() == (0, "measured")
    # the scheduler takes the step times the engine reports (its lookahead rule), string
    # keys too; an engine that reports none leaves them
    engine.kernels = {"realtime_streams": 0, "step_ms": {"4": 21.1, 5: 34.8},
                      "linear_ms": {4: 12.4}}
    service.scheduler.refresh_step_costs()
    assert service.scheduler.step_ms == {4: 21.1, 5: 34.8}
    assert service.scheduler.linear_ms == {4: 12.4}
    assert service.scheduler.lookahead_costs(4)
    engine.kernels = {"realtime_streams": 0}
    service.scheduler.refresh_step_costs()
    assert service.scheduler.step_ms == {4: 21.1, 5: 34.8}
    engine.kernels = {"realtime_streams": 0, "step_ms": {1: 90.0}}
    service.speaking = 1
    from rtts.metrics import render_metrics
    text = render_metrics(service)
    assert "rtts_capacity_utilization 1.0000" in text and "rtts_capacity_free_streams 0" in text
