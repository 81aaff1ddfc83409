"""Scale-out: two ``rtts serve`` processes behind a real nginx (WebSocket upgrade,
``least_conn``) sharing a real redis-server phrase cache, all on loopback.

Shows: sessions spread over both instances, all opened with one browser token that
instance A issued (the replicas share ``--token-secret``); audio synthesized on one instance is a
cache hit on the other; SIGTERM on one instance lets its active session finish while
every new session lands on the other. The fake engine (the documented test double)
stands in for the model: this is about the servers, the proxy and the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from procs import free_port, start_nginx, start_rtts
from rtts.api.native.protocol import unpack_frame
from rtts.errors import CLOSE_GOING_AWAY

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"),
    reason="nginx not installed (apt-get install nginx)")


class Session:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list[dict] = []
        self.audio = bytearray()

    @classmethod
    async def open(cls, url: str) -> Session:
        s = cls(await connect(url, max_size=None, open_timeout=10))
        ready = await s.until("ready")
        s.instance = ready["instance"]
        return s

    async def until(self, kind: str, timeout: float = 20.0) -> dict:
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.ws.recv()
                if isinstance(msg, bytes):
                    self.audio += unpack_frame(msg)[1]
                    continue
                event = json.loads(msg)
                self.events.append(event)
                if event["type"] == "error":
                    raise AssertionError(event)
                if event["type"] == kind:
                    return event

    async def speak(self, text: str, cid: str = "a") -> tuple[list[dict], bytes]:
        start = len(self.audio)
        await self.ws.send(json.dumps({"type": "start", "context_id": cid, "seed": 11,
                                       "voice": "seed:3"}))
        await self.ws.send(json.dumps({"type": "text", "context_id": cid, "text": text}))
        await self.ws.send(json.dumps({"type": "end", "context_id": cid}))
        await self.until("done")
        started = [e for e in self.events
                   if e["type"] == "segment_started" and e["context_id"] == cid]
        return started, bytes(self.audio[start:])


API_KEY = "scaleout-key-0123456789"
TOKEN_SECRET = "scaleout-secret-0123456789abcdef0123"


def browser_token(port: int) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/token",
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return str(json.loads(r.read())["token"])


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


async def test_two_instances_behind_nginx_share_cache_and_drain(redis_url, tmp_path):
    port_a, port_b = free_port(), free_port()
    # Auth on, one shared token secret: a browser token from A opens sessions on B too.
    common = ["--engine", "fake", "--fake-rtf", "1.0", "--cache-redis", redis_url,
              "--shutdown-grace", "20", "--api-key", API_KEY, "--token-secret", TOKEN_SECRET]
    (tmp_path / "nginx").mkdir()
    with contextlib.ExitStack() as stack:
        proc_a = stack.enter_context(start_rtts(
            [*common, "--instance-id", "A"], port_a, tmp_path / "a.log"))
        stack.enter_context(start_rtts([*common, "--instance-id", "B"], port_b,
                                       tmp_path / "b.log"))
        proxy = stack.enter_context(start_nginx(tmp_path / "nginx", [port_a, port_b]))
        token = await asyncio.to_thread(browser_token, port_a)  # issued by A only
        url = f"ws://127.0.0.1:{proxy}/v1/stream?token={token}"

        # 1. least_conn spreads held sessions over both instances.
        sessions = [await Session.open(url) for _ in range(4)]
        by = {s.instance: [x for x in sessions if x.instance == s.instance] for s in sessions}
        assert sorted(by) == ["A", "B"] and [len(v) for v in by.values()] == [2, 2]

        # 2. A phrase spoken on A is a cache hit on B, with the same audio.
        text = "Thanks for calling. 请稍等。"
        first, audio_a = await by["A"][0].speak(text)
        await asyncio.sleep(0.2)  # Redis writes are asynchronous
        second, audio_b = await by["B"][0].speak(text)
        assert first and not any(e["cached"] for e in first)
        assert all(e["cached"] for e in second) and audio_b == audio_a
        assert await asyncio.to_thread(metric, port_b, 'rtts_cache_hits_total{tier="redis"}') \
            == len(second)

        # 3. Drain A while one of its sessions is mid-utterance.
        active = by["A"][1]
        long_text = "This answer is long enough to still be speaking when A drains. " * 2
        await active.ws.send(json.dumps({"type": "start", "context_id": "long"}))
        await active.ws.send(json.dumps({"type": "text", "context_id": "long",
                                         "text": long_text}))
        await active.ws.send(json.dumps({"type": "end", "context_id": "long"}))
        await active.until("segment_started")
        proc_a.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        newcomers = [await Session.open(url) for _ in range(6)]
        assert {s.instance for s in newcomers} == {"B"}
        _, audio_new = await newcomers[0].speak("Still here on B.")
        assert audio_new

        done = await active.until("done", timeout=60)
        seg_done = [e for e in active.events if e["type"] == "segment_done"
                    and e["context_id"] == "long"]
        assert done["segments"] == len(seg_done) >= 2
        # every sample of the long answer arrived (this session spoke nothing else)
        assert sum(e["samples"] for e in seg_done) * 2 == len(active.audio)
        with pytest.raises(ConnectionClosed):  # then A closes it: going away
            await active.until("never", timeout=10)
        assert active.ws.close_code == CLOSE_GOING_AWAY
        assert await asyncio.to_thread(proc_a.wait, 30) == 0

        for s in sessions + newcomers:
            await s.ws.close()
