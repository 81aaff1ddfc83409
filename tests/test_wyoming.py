"""The Wyoming (Home Assistant) listener, driven by the real ``wyoming`` package's client
(unmodified, from PyPI) against an in-process server with the fake engine (the documented
test double), and by a ``rtts serve --wyoming-port`` process."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from helpers import base_config, server
from procs import free_port, start_rtts
from rtts.api.wyoming import WyomingError, parse_header
from rtts.engines.fake import FakeEngine

TEXT = "Turning on the kitchen lights. The temperature is twenty degrees."


def wyoming_config():
    return replace(base_config(), wyoming_port=0)


async def read(client: AsyncTcpClient, timeout: float = 10.0) -> Event:
    async with asyncio.timeout(timeout):
        event = await client.read_event()
    assert event is not None, "connection closed"
    return event


async def collect(client: AsyncTcpClient, last: str) -> list[Event]:
    events = []
    while True:
        event = await read(client)
        events.append(event)
        if event.type == last:
            return events


def test_header_parsing_is_checked():
    assert parse_header(b'{"type":"describe"}\n')["type"] == "describe"
    for bad in (b"nope", b"[1]", b'{"type":1}', b'{"type":"x","data":3}',
                b'{"type":"x","payload_length":-1}'):
        with pytest.raises(WyomingError):
            parse_header(bad)


async def test_describe_lists_voices_and_streaming_support():
    async with server(wyoming_config()) as (app, _):
        assert app.wyoming is not None
        async with AsyncTcpClient("127.0.0.1", app.wyoming.port) as client:
            await client.write_event(Describe().event())
            info = Info.from_event(await read(client))
            (tts,) = info.tts
            assert tts.name == "rtts" and tts.supports_synthesize_streaming
            names = [v.name for v in tts.voices]
            assert "alloy" in names and "nova" in names
            await client.write_event(Ping(text="x").event())
            assert Pong.is_type((await read(client)).type)


async def test_synthesize_sends_audio_start_chunks_stop():
    async with server(wyoming_config()) as (app, _):
        async with AsyncTcpClient("127.0.0.1", app.wyoming.port) as client:
            await client.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(
                name="nova")).event())
            events = await collect(client, "audio-stop")
            assert AudioStart.is_type(events[0].type)
            start = AudioStart.from_event(events[0])
            assert (start.rate, start.width, start.channels) == (24000, 2, 1)
            chunks = [AudioChunk.from_event(e) for e in events if AudioChunk.is_type(e.type)]
            assert len(chunks) >= 2
            seconds = sum(len(c.audio) for c in chunks) / 2 / 24000
            assert 3.0 < seconds < 7.0, seconds
            # the connection serves the next request
            await client.write_event(Synthesize(text="Okay.").event())
            assert AudioStop.is_type((await collect(client, "audio-stop"))[-1].type)


async def test_streaming_synthesis_first_audio_before_stop():
    engine = FakeEngine(rtf=0.2)  # paced, as a real engine is
    async with server(wyoming_config(), engine) as (app, _):
        async with AsyncTcpClient("127.0.0.1", app.wyoming.port) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(
                name="alloy")).event())
            for piece in ("Turning on ", "the kitchen lights. ", "The temperature "):
                await client.write_event(SynthesizeChunk(text=piece).event())
            # audio for the first sentence arrives while the text is still open
            first = await read(client)
            assert AudioStart.is_type(first.type)
            assert AudioChunk.is_type((await read(client)).type)
            await client.write_event(SynthesizeChunk(text="is twenty degrees.").event())
            # Home Assistant also sends the whole text as `synthesize`: ignored here
            await client.write_event(Synthesize(text=TEXT).event())
            await client.write_event(SynthesizeStop().event())
            events = await collect(client, "synthesize-stopped")
            types = [e.type for e in events]
            assert types[-2:] == ["audio-stop", "synthesize-stopped"]
            assert "audio-start" not in types  # one audio stream for the whole text
            assert SynthesizeStopped.is_type(events[-1].type)


async def test_bad_input_gets_error_events_and_the_connection_stays():
    async with server(wyoming_config()) as (app, _):
        port = app.wyoming.port
        async with AsyncTcpClient("127.0.0.1", port) as client:
            for event in (SynthesizeChunk(text="hi").event(), SynthesizeStop().event(),
                          Event(type="bogus"), Synthesize(text="  ").event(),
                          Synthesize(text="Hi.", voice=SynthesizeVoice(
                              name="no-such-voice")).event(),
                          Event(type="synthesize", data={"text": 5})):
                await client.write_event(event)
                reply = await read(client)
                assert Error.is_type(reply.type), (event, reply)
                assert Error.from_event(reply).code
            client._writer.write(b"this is not json\n")  # type: ignore[union-attr]
            assert Error.from_event(await read(client)).code == "invalid_json"
            await client.write_event(Describe().event())
            assert Info.is_type((await read(client)).type)  # still serving
        # a header past the limit: an error event, then the connection closes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'{"type":"' + b"x" * 70000 + b'"}\n')
        line = await asyncio.wait_for(reader.readline(), 5)
        assert json.loads(line)["type"] == "error"
        await asyncio.wait_for(reader.read(), 5)  # EOF
        writer.close()


async def test_rtts_serve_wyoming_port_flag(tmp_path: Path):
    port, wport = free_port(), free_port()
    with start_rtts(["--engine", "fake", "--wyoming-port", str(wport)], port,
                    tmp_path / "log"):
        async with AsyncTcpClient("127.0.0.1", wport) as client:
            await client.write_event(Synthesize(text="Hello from Home Assistant.").event())
            events = await collect(client, "audio-stop")
            assert AudioStart.is_type(events[0].type) and len(events) >= 3


async def test_connection_caps_apply_to_wyoming():
    """Wyoming has no keys, so one client must at least not take every slot: the same
    per-client cap as the WebSockets, answered with an ``error`` event, then close."""
    cfg = replace(wyoming_config(), max_connections_per_client=2)
    async with server(cfg) as (app, _):
        port = app.wyoming.port
        async with AsyncTcpClient("127.0.0.1", port) as a, \
                AsyncTcpClient("127.0.0.1", port) as b:
            for c in (a, b):
                await c.write_event(Ping(text="x").event())
                assert Pong.is_type((await read(c)).type)
            async with AsyncTcpClient("127.0.0.1", port) as third:
                event = await read(third)
                assert Error.is_type(event.type)
                assert Error.from_event(event).code == "too_many_connections"
                async with asyncio.timeout(5):
                    assert await third.read_event() is None  # closed
        await asyncio.sleep(0.2)
        async with AsyncTcpClient("127.0.0.1", port) as again:  # the slots came back
            await again.write_event(Ping(text="y").event())
            assert Pong.is_type((await read(again)).type)
        assert app.stats.auth_rejected_by["client_connections"] == 1


def test_wyoming_without_auth_is_warned_about_when_keys_are_set():
    from rtts.api.auth import AuthConfig
    from rtts.cli.main import safety_warnings

    keyed = replace(base_config(), host="0.0.0.0", wyoming_port=10200,
                    auth=AuthConfig(api_keys=("k" * 20,), token_secret=b"s" * 32))
    assert any("Wyoming" in w for w in safety_warnings(keyed))
    assert not safety_warnings(replace(keyed, wyoming_host="127.0.0.1"))
