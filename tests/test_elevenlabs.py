"""The ElevenLabs-compatible sockets and HTTP streams, driven by the real ``elevenlabs`` SDK
(unmodified, from PyPI), a client sending exactly pipecat's multi-stream-input messages, and
pipecat's own ``ElevenLabsTTSService``, against an in-process server with the fake engine
(the documented test double).

The SDK forces its WebSocket base to ``wss://`` (``RealtimeTextToSpeechClient.__init__``
rewrites the scheme); the tests point its private ``_ws_base_url`` at ``ws://127.0.0.1:PORT``,
the only change made to it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import av
import pytest
from elevenlabs.client import AsyncElevenLabs, ElevenLabs
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from helpers import base_config, server
from rtts.api.auth import AuthConfig
from rtts.api.elevenlabs import (
    ElevenError,
    _Aligner,
    chunk_schedule,
    parse_message,
    parse_output_format,
    resolve_voice_id,
    socket_kind,
)
from rtts.server import bound_port, run_server

TEXT = "Hello there, friend. How are you today? I am fine, thanks for asking."


# -- pure parts ------------------------------------------------------------------------------


def test_output_formats_map_to_codecs_and_bad_ones_are_refused():
    pcm = parse_output_format("pcm_16000")
    assert (pcm.codec, pcm.sample_rate) == ("pcm16", 16000)
    assert parse_output_format("ulaw_8000").codec == "mulaw"
    assert parse_output_format("alaw_8000").codec == "alaw"
    mp3 = parse_output_format(None)  # ElevenLabs' default
    assert (mp3.codec, mp3.sample_rate, mp3.bit_rate) == ("mp3", 44100, 128000)
    assert parse_output_format("opus_48000_64").bit_rate == 64000
    wav = parse_output_format("wav_24000")  # litellm's response_format="wav"
    assert (wav.codec, wav.sample_rate) == ("wav", 24000)
    for bad in ("pcm_12345", "mp3_44100", "wav", "wav_12345", "opus_24000_64", "pcm_x"):
        with pytest.raises(ElevenError):
            parse_output_format(bad)


def test_messages_parse_and_bad_ones_raise():
    m = parse_message('{"text":" ","context_id":"a","voice_settings":{"speed":1.1},'
                      '"try_trigger_generation":true,"whatever":1}', max_text_chars=100)
    assert (m.text, m.context_id, m.voice_settings) == (" ", "a", {"speed": 1.1})
    assert parse_message('{"close_socket":true}', max_text_chars=10).close_socket
    for bad in ('nope', '[1]', '{"text":5}', '{"flush":"yes"}', '{"context_id":""}',
                '{"voice_settings":3}', '{"text":"' + "x" * 11 + '"}', b"\x00"):
        with pytest.raises(ElevenError):
            parse_message(bad, max_text_chars=10)


def test_schedule_and_paths():
    assert chunk_schedule({"chunk_length_schedule": [50, 90]}, auto_mode=False) == (50, 90)
    assert chunk_schedule({"chunk_length_schedule": [50]}, auto_mode=True)[0] == 8
    with pytest.raises(ElevenError):
        chunk_schedule({"chunk_length_schedule": [0]}, auto_mode=False)
    assert socket_kind("/v1/text-to-speech/abc/multi-stream-input?x=1") == ("abc", True)
    assert socket_kind("/v1/text-to-speech/abc/stream-input") == ("abc", False)
    assert socket_kind("/v1/text-to-speech/abc/stream") is None


def test_alignment_covers_the_text_between_segments():
    a = _Aligner()
    a.feed("Hi there.  How")
    a.feed(" are you?")
    first, said1 = a.segment(0, 9, "Hi there.", 500)
    second, said2 = a.segment(11, 23, "How are you?", 800)
    assert first.text + second.text == "Hi there.  How are you?"
    assert first.end_ms == 500 and second.end_ms == 800
    assert said2.text == " How are you?"  # normalized text, a space between segments
    a.feed(" Bad one. Next.")
    a.skip(32)  # a failed segment: no audio, no alignment
    third, _ = a.segment(33, 38, "Next.", 300)
    assert third.text == " Next." and third.end_ms == 300


async def test_voice_ids_resolve_like_openai_names_and_unknown_ids_are_stable():
    async with server() as (app, _):
        assert resolve_voice_id("alloy", app) == "seed:2"
        eleven = resolve_voice_id("21m00Tcm4TlvDq8ikWAM", app)
        assert eleven.startswith("seed:") and eleven == resolve_voice_id("21m00Tcm4TlvDq8ikWAM",
                                                                          app)
        assert eleven != resolve_voice_id("EXAVITQu4vr4xnJmXOxB", app)
        with pytest.raises(ElevenError):
            resolve_voice_id("bad voice!", app)


# -- the real elevenlabs SDK ------------------------------------------------------------------


def _sdk(port: int, key: str = "sk-none") -> ElevenLabs:
    client = ElevenLabs(api_key=key, base_url=f"http://127.0.0.1:{port}")
    client.text_to_speech._ws_base_url = f"ws://127.0.0.1:{port}"  # the SDK forces wss://
    return client


def _realtime(port: int, output_format: str, pieces: list[str], log: list[str],
              key: str = "sk-none") -> bytes:
    """convert_realtime in a thread; ``log`` records text pieces handed out and audio in."""

    def text() -> Iterator[str]:
        for piece in pieces:
            log.append("text")
            yield piece
            time.sleep(0.15)  # an LLM producing tokens

    out = b""
    for chunk in _sdk(port, key).text_to_speech.convert_realtime(
            "21m00Tcm4TlvDq8ikWAM", text=text(), model_id="eleven_flash_v2_5",
            output_format=output_format):
        log.append("audio")
        out += chunk
    return out


PIECES = ["Hello there, ", "friend. ", "How are ", "you today? ", "I am fine, ", "thanks ",
          "for ", "asking", "."]


@pytest.mark.parametrize("output_format", ["pcm_16000", "mp3_44100_128"])
async def test_sdk_convert_realtime_streams_before_the_text_ends(output_format):
    async with server() as (app, _):
        log: list[str] = []
        audio = await asyncio.to_thread(_realtime, bound_port(app), output_format, PIECES, log)
        # audio came back while the text iterator was still producing
        last_text = len(log) - 1 - log[::-1].index("text")
        assert "audio" in log[:last_text], log
        if output_format.startswith("pcm"):
            seconds = len(audio) / 2 / 16000
        else:
            container = av.open(io.BytesIO(audio))
            assert container.streams.audio[0].codec_context.name.startswith("mp3")
            seconds = sum(f.samples for f in container.decode(audio=0)) / 44100
        assert 2.5 < seconds < 6.0, seconds


async def test_sdk_http_stream_and_with_timestamps():
    async with server() as (app, _):
        client = AsyncElevenLabs(api_key="k", base_url=f"http://127.0.0.1:{bound_port(app)}")
        pcm = b"".join([c async for c in client.text_to_speech.stream(
            "alloy", text=TEXT, output_format="pcm_24000")])
        seconds = len(pcm) / 2 / 24000
        assert 2.5 < seconds < 6.0
        chunks = [c async for c in client.text_to_speech.stream_with_timestamps(
            "21m00Tcm4TlvDq8ikWAM", text=TEXT, output_format="pcm_24000")]
        audio = b"".join(base64.b64decode(c.audio_base_64) for c in chunks if c.audio_base_64)
        assert abs(len(audio) - len(pcm)) < 48  # same text, same length
        aligned = [c.alignment for c in chunks if c.alignment is not None]
        assert len(aligned) >= 2  # one per segment
        chars = "".join("".join(a.characters) for a in aligned)
        assert chars == TEXT
        starts = [s for a in aligned for s in a.character_start_times_seconds]
        ends = [e for a in aligned for e in a.character_end_times_seconds]
        assert starts == sorted(starts) and starts[0] == 0
        assert abs(ends[-1] - len(audio) / 2 / 24000) < 0.002  # times span the whole audio


async def test_http_errors_are_elevenlabs_shaped_and_key_is_xi_api_key():
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        port = bound_port(app)

        async def post(path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                         f"Connection: close\r\n{head}\r\n".encode() + data)
            raw = await reader.read()
            writer.close()
            status = int(raw.split(b" ", 2)[1])
            return status, json.loads(raw.split(b"\r\n\r\n", 1)[1] or b"null")

        ok = {"xi-api-key": "sekrit"}
        status, body = await post("/v1/text-to-speech/alloy/stream", {"text": "Hi."}, {})
        assert status == 401 and body["detail"]["message"]
        for path, payload, want in [
            ("/v1/text-to-speech/alloy/stream", b"{nope", 400),
            ("/v1/text-to-speech/alloy/stream", {"text": ""}, 400),
            ("/v1/text-to-speech/alloy/stream?output_format=wav_1", {"text": "Hi."}, 422),
            ("/v1/text-to-speech/bad%20voice!/stream", {"text": "Hi."}, 400),
            ("/v1/text-to-speech/alloy/stream", {"text": "Hi.", "voice_settings": 5}, 400),
        ]:
            status, body = await post(path, payload, ok)
            assert status == want, (path, payload, status, body)
            assert set(body["detail"]) == {"status", "message"}
        client = AsyncElevenLabs(api_key="sekrit", base_url=f"http://127.0.0.1:{port}")
        audio = b"".join([c async for c in client.text_to_speech.convert(
            "alloy", text="Short one.", output_format="mp3_44100_128")])
        assert av.open(io.BytesIO(audio)).streams.audio[0].codec_context.name.startswith("mp3")


# -- multi-stream-input, as pipecat's ElevenLabsTTSService speaks it -------------------------


class Recv:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def audio_samples(self, cid: str, until: int | None = None) -> int:
        msgs = self.messages if until is None else self.messages[:until]
        return sum(len(base64.b64decode(m["audio"])) // 2 for m in msgs
                   if m.get("contextId") == cid and m.get("audio"))

    def alignments(self, cid: str) -> list[tuple[int, dict[str, Any]]]:
        return [(i, m["alignment"]) for i, m in enumerate(self.messages)
                if m.get("contextId") == cid and m.get("alignment")]


async def _until(ws: Any, got: Recv, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            msg = json.loads(await ws.recv())
            got.messages.append(msg)
            if pred(msg):
                return msg


def _check_alignment(got: Recv, cid: str, text: str, rate: int) -> None:
    """chars joined = the text; times increase inside each segment; each alignment ends
    exactly where the audio received so far ends (PCM at the engine rate, so no delay)."""
    aligned = got.alignments(cid)
    assert aligned, cid
    assert "".join("".join(a["chars"]) for _, a in aligned).strip() == text.strip()
    spans = 0
    for index, a in aligned:
        starts, durs = a["charStartTimesMs"], a["charDurationsMs"]
        assert len(starts) == len(durs) == len(a["chars"])
        assert starts == sorted(starts) and starts[0] == 0 and min(durs) >= 0
        spans += starts[-1] + durs[-1]
        heard_ms = got.audio_samples(cid, index) * 1000 / rate
        assert abs(spans - heard_ms) <= len(aligned), (spans, heard_ms)


async def test_multi_stream_input_as_pipecat_sends_it():
    async with server() as (app, _):
        url = (f"ws://127.0.0.1:{bound_port(app)}/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM/"
               "multi-stream-input?model_id=eleven_flash_v2_5&output_format=pcm_24000"
               "&auto_mode=true&apply_text_normalization=auto&language_code=en&unknown=1")
        got = Recv()
        a_text = "Hello there, friend. How are you today?"
        b_first, b_second = "I am the other voice. ", "Still here after the keep-alive."
        async with connect(url, additional_headers={"xi-api-key": "k"}) as ws:
            settings = {"stability": 0.5, "similarity_boost": 0.75, "speed": 1.0}
            await ws.send(json.dumps({"text": " ", "context_id": "A",
                                      "voice_settings": settings}))
            for piece in ("Hello there, ", "friend. ", "How are you today?"):
                await ws.send(json.dumps({"text": piece, "context_id": "A"}))
            await ws.send(json.dumps({"text": " ", "context_id": "B",
                                      "voice_settings": settings}))
            await ws.send(json.dumps({"text": b_first, "context_id": "B"}))
            await ws.send(json.dumps({"context_id": "A", "flush": True}))
            await ws.send(json.dumps({"context_id": "A", "close_context": True}))
            await ws.send(json.dumps({"text": "", "context_id": "B"}))  # keep-alive
            final_a = await _until(ws, got, lambda m: m.get("isFinal") is True)
            assert final_a["contextId"] == "A"
            # B is still open and keeps producing after A's end and the keep-alive
            await ws.send(json.dumps({"text": b_second, "context_id": "B"}))
            await ws.send(json.dumps({"text": "", "context_id": "B"}))  # keep-alive
            await ws.send(json.dumps({"context_id": "B", "flush": True}))
            await _until(ws, got, lambda m: m.get("contextId") == "B" and m.get("alignment")
                         and "keep" in "".join(m["alignment"]["chars"]))
            await ws.send(json.dumps({"context_id": "B", "close_context": True}))
            final_b = await _until(ws, got, lambda m: m.get("isFinal") is True)
            assert final_b["contextId"] == "B"
            await ws.send(json.dumps({"close_socket": True}))
            with pytest.raises(ConnectionClosed):
                await _until(ws, got, lambda m: False)
            assert ws.close_code == 1000
        assert all("contextId" in m for m in got.messages)
        audio = [m for m in got.messages if m.get("audio")]
        assert {m["contextId"] for m in audio} == {"A", "B"}
        assert all(m["isFinal"] is None for m in audio)
        _check_alignment(got, "A", a_text, 24000)
        _check_alignment(got, "B", b_first + b_second, 24000)
        assert got.alignments("A")[0][1] and all(
            m.get("normalizedAlignment") for _, m in enumerate(got.messages) if m.get(
                "alignment"))


async def test_stream_input_bad_input_gets_error_message_and_close_code():
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        base = f"ws://127.0.0.1:{bound_port(app)}/v1/text-to-speech/alloy/stream-input"
        # a path under the prefix that is not one of the sockets: 404 at the handshake
        with pytest.raises(InvalidStatus) as info:
            async with connect(base.replace("stream-input", "stream")):
                pass
        assert info.value.response.status_code == 404
        # wrong key in the header: refused at the handshake
        with pytest.raises(InvalidStatus) as info:
            async with connect(base, additional_headers={"xi-api-key": "wrong"}):
                pass
        assert info.value.response.status_code == 401
        # no key in the header: the first message must carry it
        async with connect(base) as ws:
            await ws.send(json.dumps({"text": " ", "xi_api_key": "nope"}))
            msg = json.loads(await ws.recv())
            assert msg["error"] == "invalid_api_key" and msg["code"] == 1008
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008
        async with connect(base) as ws:  # key in the first message: works
            await ws.send(json.dumps({"text": " ", "xi_api_key": "sekrit"}))
            await ws.send(json.dumps({"text": "Hi there."}))
            await ws.send(json.dumps({"text": ""}))
            got = Recv()
            await _until(ws, got, lambda m: m.get("isFinal") is True)
            assert any(m.get("audio") for m in got.messages)
            assert all("contextId" not in m for m in got.messages)  # stream-input: none
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1000
        # what the URL sets is checked at the handshake, as the key is: an unknown voice,
        # a bad format or timeout never opens a socket that then closes
        for path, want in [("/v1/text-to-speech/bad%20voice!/stream-input", 400),
                           ("/v1/text-to-speech/alloy/stream-input?output_format=wav", 422),
                           ("/v1/text-to-speech/alloy/multi-stream-input"
                            "?inactivity_timeout=9999", 400)]:
            with pytest.raises(InvalidStatus) as info:
                async with connect(base.split("/v1/")[0] + path,
                                   additional_headers={"xi-api-key": "sekrit"}):
                    pass
            assert info.value.response.status_code == want, path
            detail = json.loads(info.value.response.body)["detail"]
            assert detail["status"] and detail["message"]
        for query, first in [("", "not json"), ("", {"text": 5}),
                             ("", {"text": " ", "generation_config": {
                                 "chunk_length_schedule": ["x"]}})]:
            async with connect(base + query, additional_headers={"xi-api-key": "sekrit"}
                               ) as ws:
                with contextlib.suppress(ConnectionClosed):  # a bad query closes at once
                    await ws.send(first if isinstance(first, str) else json.dumps(first))
                msg = json.loads(await ws.recv())
                assert set(msg) == {"message", "error", "code"}, msg
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
                assert ws.close_code == msg["code"] == 1008
        await asyncio.sleep(0.1)
        assert app.elevenlabs.sockets == set()
        assert sum(app.auth.active.values()) == 0  # every admitted key released


async def test_inactivity_timeout_closes_with_an_error_message():
    async with server() as (app, _):
        url = (f"ws://127.0.0.1:{bound_port(app)}/v1/text-to-speech/alloy/multi-stream-input"
               "?inactivity_timeout=1")
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "x"}))
            t0 = time.monotonic()
            msg = json.loads(await ws.recv())
            assert (msg["error"], msg["code"]) == ("input_timeout_exceeded", 1008)
            assert 0.9 < time.monotonic() - t0 < 3
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008


# -- pipecat's real ElevenLabsTTSService ------------------------------------------------------


def _pipecat_run(port: int, texts: list[str]) -> dict[str, Any]:
    """pipecat's ElevenLabsTTSService in its own pipeline (own event loop, in a thread)."""
    from pipecat.frames.frames import (
        EndFrame,
        TTSAudioRawFrame,
        TTSSpeakFrame,
        TTSStoppedFrame,
        TTSTextFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    out: dict[str, Any] = {"audio": 0, "words": [], "stopped": 0}

    class Sink(FrameProcessor):
        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                out["audio"] += len(frame.audio)
            elif isinstance(frame, TTSTextFrame):
                out["words"].append(frame.text)
            elif isinstance(frame, TTSStoppedFrame):
                out["stopped"] += 1
            await self.push_frame(frame, direction)

    async def main() -> None:
        tts = ElevenLabsTTSService(api_key="k", settings=ElevenLabsTTSService.Settings(
                                       voice="21m00Tcm4TlvDq8ikWAM"),
                                   url=f"ws://127.0.0.1:{port}", sample_rate=24000)
        task = PipelineTask(Pipeline([tts, Sink()]),
                            params=PipelineParams(audio_out_sample_rate=24000))
        for text in texts:
            await task.queue_frame(TTSSpeakFrame(text))
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(PipelineRunner(handle_sigint=False).run(task), 30)

    asyncio.run(main())
    return out


async def test_pipecat_elevenlabs_tts_service_against_rtts():
    async with server() as (app, _):
        result: dict[str, Any] = {}

        def run() -> None:
            result.update(_pipecat_run(bound_port(app), [TEXT]))

        thread = threading.Thread(target=run)
        thread.start()
        await asyncio.to_thread(thread.join, 40)
        assert not thread.is_alive()
        assert result["audio"] > 24000 * 2 * 2  # over 2 s of PCM16 at 24 kHz
        # the words reach pipecat's context only through the alignment
        words = " ".join(result["words"]).split()
        assert words == TEXT.split(), words


# -- the real ChatTTS code (tiny random checkpoint) ------------------------------------------


@pytest.mark.chattts
async def test_real_chattts_multi_stream_alignment_and_wyoming(tiny_checkpoint):
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    from rtts.config import EngineConfig
    from rtts.engines.chattts import ChatTTSEngine

    cfg = replace(base_config(), wyoming_port=0,
                  engine=EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                      max_new_token=48))
    async with server(cfg, ChatTTSEngine(cfg.engine)) as (app, _):
        url = (f"ws://127.0.0.1:{bound_port(app)}/v1/text-to-speech/alloy/multi-stream-input"
               "?output_format=pcm_24000&auto_mode=true")
        text = "Hello there, friend. How are you?"
        got = Recv()
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "c"}))
            await ws.send(json.dumps({"text": text, "context_id": "c", "flush": True}))
            await ws.send(json.dumps({"context_id": "c", "close_context": True}))
            await _until(ws, got, lambda m: m.get("isFinal") is True, timeout=120)
        assert got.audio_samples("c") > 0
        _check_alignment(got, "c", text, 24000)
        async with AsyncTcpClient("127.0.0.1", app.wyoming.port) as wc:
            await wc.write_event(Synthesize(text="Hi there.").event())
            kinds = []
            while not kinds or kinds[-1] != "audio-stop":
                event = await asyncio.wait_for(wc.read_event(), 120)
                kinds.append(event.type)
            assert kinds[0] == "audio-start" and "audio-chunk" in kinds


async def test_shutdown_drains_then_closes_open_sockets_with_1001():
    cfg = replace(base_config(), shutdown_grace_s=0.5)
    async with server(cfg) as (app, _):
        url = f"ws://127.0.0.1:{bound_port(app)}/v1/text-to-speech/alloy/multi-stream-input"
        ws = await connect(url)
        await ws.send(json.dumps({"text": "Unfinished sentence without an end",
                                  "context_id": "x"}))
        await asyncio.sleep(0.1)
        assert app.busy_connections() == 1  # an open context counts for the drain
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(5):
            while True:
                await ws.recv()
    assert ws.close_code == 1001


# -- pipecat fed an LLM reply: its aggregator sends sentence by sentence, no trailing space ---


def _pipecat_llm_run(port: int, sentences: list[str], token_s: float) -> dict[str, Any]:
    """An LLM reply token by token (``LLMTextFrame``s between the response start and end
    frames, ``token_s`` apart) into pipecat's ElevenLabsTTSService, in its own pipeline;
    records when tokens went in and audio came out, the audio, and the word frames."""
    from pipecat.frames.frames import (
        EndFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
        TTSTextFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    out: dict[str, Any] = {"audio": bytearray(), "first_audio": None, "words": [],
                           "sentence_done": [], "reply_done": None}

    class Sink(FrameProcessor):
        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                out["audio"] += frame.audio
                if out["first_audio"] is None:
                    out["first_audio"] = time.monotonic()
            elif isinstance(frame, TTSTextFrame):
                out["words"].append((frame.text, frame.pts))
            await self.push_frame(frame, direction)

    async def main() -> None:
        tts = ElevenLabsTTSService(api_key="k", settings=ElevenLabsTTSService.Settings(
                                       voice="21m00Tcm4TlvDq8ikWAM"),
                                   url=f"ws://127.0.0.1:{port}", sample_rate=24000)
        task = PipelineTask(Pipeline([tts, Sink()]),
                            params=PipelineParams(audio_out_sample_rate=24000))

        async def llm() -> None:
            await asyncio.sleep(0.5)  # the pipeline has started
            await task.queue_frame(LLMFullResponseStartFrame())
            for sentence in sentences:
                tokens = re.findall(r"\s*[^\s.]+|\.", sentence)  # " dog", "." as LLMs do
                for i, token in enumerate(tokens):
                    await task.queue_frame(LLMTextFrame(token if i or sentence is sentences[0]
                                                        else " " + token.lstrip()))
                    await asyncio.sleep(token_s)
                out["sentence_done"].append(time.monotonic())
            out["reply_done"] = time.monotonic()
            await task.queue_frame(LLMFullResponseEndFrame())
            await asyncio.sleep(1.0)
            await task.queue_frame(EndFrame())

        producer = asyncio.create_task(llm())
        await asyncio.wait_for(PipelineRunner(handle_sigint=False).run(task), 90)
        await producer

    asyncio.run(main())
    return out


async def _pipecat_llm(app: Any, sentences: list[str], token_s: float) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def run() -> None:
        result.update(_pipecat_llm_run(bound_port(app), sentences, token_s))

    thread = threading.Thread(target=run)
    thread.start()
    await asyncio.to_thread(thread.join, 120)
    assert not thread.is_alive()
    return result


async def test_pipecat_llm_reply_speaks_each_sentence_as_it_arrives():
    """First audio while the LLM is still producing (not at pipecat's final flush), and the
    word times pipecat derives increase through the reply and span its audio."""
    sentences = ["The quick brown fox jumps over the lazy dog.", "Please call me back soon.",
                 "I will be at home tonight.", "Bring the blue folder.", "We can finish then."]
    async with server() as (app, _):
        got = await _pipecat_llm(app, sentences, token_s=0.08)
    assert got["first_audio"] is not None
    print(f"pipecat: first audio {got['first_audio'] - got['sentence_done'][0]:.3f} s after "
          f"the first sentence's last token; the reply took "
          f"{got['reply_done'] - got['sentence_done'][0]:.2f} s more")
    # audio of the first sentence came before the reply ended: it was cut and spoken then
    assert got["first_audio"] < got["sentence_done"][2], (
        got["first_audio"] - got["sentence_done"][0])
    words = [w for w, _ in got["words"]]
    assert " ".join(words).split() == " ".join(sentences).split()
    pts = [p for _, p in got["words"]]
    assert pts == sorted(pts) and len(set(pts)) == len(pts), repr(got["words"])
    audio_ns = len(got["audio"]) / 2 / 24000 * 1e9
    span = pts[-1] - pts[0]
    assert 0.6 * audio_ns < span < audio_ns, (span / 1e9, audio_ns / 1e9)


async def test_pipecat_llm_reply_on_the_piper_voice_is_heard_without_the_periods():
    """Speech recognition on the piper voice: pipecat's sentences ("...lazy dog." then
    "Please call me...") must not be joined into "dog.Please" and read with the period."""
    ti = pytest.importorskip("test_intelligibility")
    import numpy as np

    from rtts.config import EngineConfig

    cfg = base_config(engine=EngineConfig(name="piper", voice_models=(ti.JOE,)))
    async with run_server(cfg) as app:
        assert app.state == "ready", app.state_reason
        got = await _pipecat_llm(app, list(ti.SENTENCES), token_s=0.03)
    audio = np.frombuffer(bytes(got["audio"]), "<i2").astype(np.float32) / 32768
    recognize = ti.Recognizer()
    heard = recognize(audio, 24000)
    from piper import PiperVoice

    voice = PiperVoice.load(ti.JOE)
    direct = np.concatenate([c.audio_float_array for c in voice.synthesize(ti.TEXT)])
    reference = recognize(direct, voice.config.sample_rate)
    print(f"WER through pipecat+rtts {heard.wer:.3f} ({heard.hypothesis!r}), piper direct "
          f"{reference.wer:.3f}")
    assert heard.wer <= reference.wer + ti.MARGIN, (heard.hypothesis, reference.hypothesis)
    assert got["first_audio"] < got["sentence_done"][-1]



# -- litellm's elevenlabs/ provider -----------------------------------------------------------

# litellm 1.110 pins python-dateutil<3 (through botocore) where this venv has 4.0, so it runs
# in its own interpreter: RTTS_LITELLM_PYTHON (a venv with `pip install litellm==1.110.2`),
# or this one if litellm imports here.
_LITELLM_SPEECH = """
import os, sys
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
import litellm
resp = litellm.speech(model="elevenlabs/eleven_multilingual_v2", input=sys.argv[2],
                      voice=sys.argv[3], response_format="wav", api_base=sys.argv[1],
                      api_key="k")
sys.stdout.buffer.write(resp.content)
"""


def _litellm_python() -> str:
    import os
    import subprocess
    import sys

    for python in (os.environ.get("RTTS_LITELLM_PYTHON"), sys.executable):
        if python and subprocess.run([python, "-c", "import litellm"],
                                     capture_output=True).returncode == 0:
            return python
    pytest.skip("litellm is not installed here (it pins python-dateutil<3): set "
                "RTTS_LITELLM_PYTHON to a venv's python with litellm==1.110.2")


async def test_litellm_elevenlabs_speech_with_response_format_wav():
    import subprocess
    import wave

    python = _litellm_python()
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        for voice in ("alloy", "nova"):  # litellm maps alloy to an ElevenLabs id itself
            proc = await asyncio.to_thread(
                subprocess.run, [python, "-c", _LITELLM_SPEECH, base, TEXT, voice],
                capture_output=True, timeout=120)
            assert proc.returncode == 0, proc.stderr.decode()[-2000:]
            with wave.open(io.BytesIO(proc.stdout)) as w:  # wav_24000: a WAV file
                assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
                frames = len(proc.stdout) - 44
            assert 2.5 < frames / 2 / 24000 < 6.0
