"""A crashed context ends the same way on every socket front-end: that protocol's error
event (with an incident id; the traceback is in the log), never silence or a hang.

The crash is injected where a server bug would be: the PCM conversion of the native and
Wyoming pipelines (fails once, for the first context), the native pacer, and the ElevenLabs
encoder. The fake engine is the documented test double.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from wyoming.audio import AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.tts import Synthesize

import rtts.api.elevenlabs as elevenlabs_mod
import rtts.api.native.connection as native_mod
import rtts.api.wyoming as wyoming_mod
from helpers import base_config, client, server
from rtts.api.native.pacing import LeadPacer
from rtts.server import bound_port


def _fail_first(real: Any) -> Any:
    """``real``, except that its first call raises (a bug that hits one context)."""
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected bug")
        return real(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("where", ["pcm", "pacer"])
async def test_native_crashed_context_gets_an_error_and_the_connection_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str) -> None:
    if where == "pcm":
        monkeypatch.setattr(native_mod, "float_to_pcm16", _fail_first(native_mod.float_to_pcm16))
    else:
        monkeypatch.setattr(LeadPacer, "delay", _fail_first(LeadPacer.delay))
    caplog.set_level(logging.ERROR, "rtts.api.native")
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="A")
        await c.send(type="text", context_id="A", text="This context hits the bug. ")
        await c.send(type="end", context_id="A")
        err = await c.until("error", "A")
        assert err["code"] == "internal_error" and err["context_closed"] is True
        assert "incident" in err["message"]
        incident = err["message"].split("incident ")[1].rstrip(")")
        assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)
        assert not c.got.of("done", "A")
        # the connection and a new context (even under the same id) still work
        for cid in ("B", "A"):
            await c.send(type="start", context_id=cid)
            await c.send(type="text", context_id=cid, text="Still speaking after it.")
            await c.send(type="end", context_id=cid)
            done = await c.until("done", cid)
            assert done["audio_ms"] > 0
        assert app.native.active_contexts() == 0


async def test_native_idle_timeout_still_closes_after_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The crashed context is gone, so the connection counts as idle and is closed (4000)
    instead of being held open forever by a context that will never end."""
    from dataclasses import replace
    monkeypatch.setattr(native_mod, "float_to_pcm16", _fail_first(native_mod.float_to_pcm16))
    async with server(replace(base_config(), idle_timeout_s=0.5)) as (_, url), \
            client(url) as c:
        await c.send(type="start", context_id="A")
        await c.send(type="text", context_id="A", text="Crash here. ")
        await c.until("error", "A")
        with pytest.raises(ConnectionClosed):
            await c.recv_until(lambda e: False, timeout=5)
        assert c.ws.close_code == 4000


class _BrokenEncoder:
    samples = 0

    def encode(self, samples: Any) -> bytes:
        raise RuntimeError("injected encoder bug")

    def finish(self) -> bytes:
        return b""


async def test_elevenlabs_crashed_context_gets_an_error_and_close_1011(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = elevenlabs_mod.open_encoder
    calls = {"n": 0}

    def open_encoder(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return _BrokenEncoder() if calls["n"] == 1 else real_open(*args, **kwargs)
    monkeypatch.setattr(elevenlabs_mod, "open_encoder", open_encoder)
    async with server() as (app, _):
        url = (f"ws://127.0.0.1:{bound_port(app)}/v1/text-to-speech/alloy/"
               "multi-stream-input?output_format=pcm_24000")
        async with connect(url, additional_headers={"xi-api-key": "k"}) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "A"}))
            await ws.send(json.dumps({"text": "Hello there. ", "context_id": "A"}))
            await ws.send(json.dumps({"context_id": "A", "flush": True}))
            messages = []
            with pytest.raises(ConnectionClosed):
                async with asyncio.timeout(10):
                    while True:
                        messages.append(json.loads(await ws.recv()))
            assert ws.close_code == 1011
            errors = [m for m in messages if m.get("error")]
            assert errors and "incident" in errors[0]["message"]
        # other sockets are unaffected
        async with connect(url, additional_headers={"xi-api-key": "k"}) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "B"}))
            await ws.send(json.dumps({"text": "Fine now.", "context_id": "B"}))
            await ws.send(json.dumps({"context_id": "B", "close_context": True}))
            async with asyncio.timeout(10):
                while not json.loads(await ws.recv()).get("isFinal"):
                    pass


async def test_wyoming_crashed_synthesis_gets_an_error_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace
    monkeypatch.setattr(wyoming_mod, "float_to_pcm16", _fail_first(wyoming_mod.float_to_pcm16))
    async with server(replace(base_config(), wyoming_port=0)) as (app, _):
        async with AsyncTcpClient("127.0.0.1", app.wyoming.port) as wy:
            await wy.write_event(Synthesize(text="This one hits the bug.").event())
            async with asyncio.timeout(10):
                while True:
                    event = await wy.read_event()
                    assert event is not None
                    if Error.is_type(event.type):
                        break
            error = Error.from_event(event)
            assert error.code == "internal_error" and "incident" in error.text
            # the same connection serves the next request
            await wy.write_event(Synthesize(text="Okay now.").event())
            async with asyncio.timeout(10):
                while not AudioStop.is_type((event := await wy.read_event()).type):
                    assert not Error.is_type(event.type)
