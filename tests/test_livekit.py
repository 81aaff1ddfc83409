"""LiveKit Agents' own plugins, unmodified from PyPI (``livekit-agents``,
``livekit-plugins-elevenlabs``, ``livekit-plugins-openai`` 1.8.x), pointed at rtts by their
``base_url`` and driven as an agent drives them: one aiohttp session for everything (LiveKit
shares one per job, with a long keep-alive), ``synthesize()`` and ``list_voices()`` over HTTP,
then ``stream()`` over the ElevenLabs multi-stream-input socket on the same session.

The fake engine (the documented test double) makes the audio; these tests are about the wire.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from helpers import base_config, server
from rtts.api.auth import AuthConfig
from rtts.server import bound_port

elevenlabs = pytest.importorskip("livekit.plugins.elevenlabs")
from livekit.agents import APIConnectOptions, APIStatusError  # noqa: E402
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402

REPLY = ("The quick brown fox jumps over the lazy dog. Please call me back when you can. "
         "I will be at home all evening. Bring the blue folder with you. "
         "We can finish the report together.")
OPTS = APIConnectOptions(max_retry=0, timeout=20)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def _tts(port: int, session: aiohttp.ClientSession, **kw: Any) -> Any:
    return elevenlabs.TTS(api_key=kw.pop("api_key", "k"), base_url=f"http://127.0.0.1:{port}/v1",
                          voice_id=kw.pop("voice_id", "alloy"), http_session=session, **kw)


async def _stream(tts: Any, text: str, tokens: bool = True) -> tuple[int, list[Any]]:
    """``stream()`` as an agent feeds it: LLM-sized pieces, then end of input. Returns the
    audio samples and the timed transcript (LiveKit's TimedStrings)."""
    stream = tts.stream(conn_options=OPTS)
    pieces = text.split(" ") if tokens else [text]
    for i, word in enumerate(pieces):
        stream.push_text(word + (" " if i < len(pieces) - 1 else ""))
    stream.end_input()
    samples, timed = 0, []
    async with asyncio.timeout(30):
        async for ev in stream:
            samples += ev.frame.samples_per_channel
            timed += ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or []
    await stream.aclose()
    return samples, timed


async def test_stream_after_synthesize_and_list_voices_on_one_session():
    async with server() as (app, _):
        port = bound_port(app)
        # limit=1: every request and the socket must share one kept-alive connection
        for connector in (aiohttp.TCPConnector(limit=1), aiohttp.TCPConnector()):
            async with aiohttp.ClientSession(connector=connector) as session:
                tts = _tts(port, session)
                voices = await tts.list_voices()
                assert {"alloy", "nova"} <= {v.id for v in voices}
                assert all(v.category for v in voices)
                samples = 0
                async with tts.synthesize("Hello there, friend.", conn_options=OPTS) as chunked:
                    async for ev in chunked:
                        samples += ev.frame.samples_per_channel
                assert samples > 0.5 * tts.sample_rate
                for _ in range(2):  # two turns on the one socket
                    samples, timed = await _stream(tts, "How are you today? I am fine.")
                    assert samples > 1.0 * tts.sample_rate
                    assert _words("".join(timed)) == _words("How are you today? I am fine.")
                await tts.aclose()


async def test_word_timestamps_increase_through_a_five_sentence_reply():
    async with server() as (app, _):
        async with aiohttp.ClientSession() as session:
            tts = _tts(bound_port(app), session)
            samples, timed = await _stream(tts, REPLY)
            await tts.aclose()
        # (LiveKit reads the normalized alignment: the text as spoken)
        assert _words("".join(timed)) == _words(REPLY)
        starts = [t.start_time for t in timed]
        ends = [t.end_time for t in timed]
        assert starts == sorted(starts) and len(set(starts)) == len(starts), starts
        assert all(s < e for s, e in zip(starts, ends, strict=True))
        audio_s = samples / tts.sample_rate
        # the last word ends where the audio ends (not where its sentence's audio ends)
        assert audio_s * 0.8 < ends[-1] <= audio_s + 0.05, (ends[-1], audio_s)


async def test_unknown_voice_is_refused_at_once_and_a_bad_key_too():
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        port = bound_port(app)
        async with aiohttp.ClientSession() as session:
            for _ in range(5):  # it hung in 2 of 5 tries when refused after the upgrade
                tts = _tts(port, session, api_key="sekrit", voice_id="no such voice!")
                with pytest.raises(APIStatusError) as info:
                    async with asyncio.timeout(5):
                        await _stream(tts, "Hello there.")
                assert info.value.status_code == 400 and not info.value.retryable
                await tts.aclose()
            tts = _tts(port, session, api_key="wrong")
            with pytest.raises(APIStatusError) as info:
                async with asyncio.timeout(5):
                    await _stream(tts, "Hello there.")
            assert info.value.status_code == 401
            await tts.aclose()


async def test_list_voices_with_a_key_and_the_openai_plugin_on_the_same_server():
    from livekit.plugins import openai as lk_openai

    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        port = bound_port(app)
        async with aiohttp.ClientSession() as session:
            tts = _tts(port, session, api_key="sekrit")
            assert "alloy" in {v.id for v in await tts.list_voices()}
            with pytest.raises(Exception):  # noqa: B017 - a wrong key is not a voice list
                await _tts(port, session, api_key="wrong").list_voices()
            oai = lk_openai.TTS(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit",
                                voice="alloy", model="tts-1")
            samples = 0
            async with oai.synthesize("Hello there.", conn_options=OPTS) as chunked:
                async for ev in chunked:
                    samples += ev.frame.samples_per_channel
                    assert ev.request_id  # the x-request-id header rtts now sends
            assert samples > 0
            await oai.aclose()
            await tts.aclose()
