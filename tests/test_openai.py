"""The OpenAI-compatible endpoints, driven by the real ``openai`` package (unmodified, from
PyPI) against an in-process server with the fake engine (the documented test double)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import urllib.error
import urllib.request
from dataclasses import replace

import av
import openai
import pytest

from helpers import base_config, server
from rtts.api.auth import AuthConfig
from rtts.core.governor import Level
from rtts.core.scheduler import SchedulerConfig
from rtts.engines.fake import FakeEngine
from rtts.server import bound_port

TEXT = "Hello there, friend. How are you today? I am fine, thanks for asking."
DECODER = {"mp3": "mp3float", "opus": "opus", "aac": "aac", "flac": "flac",
           "wav": "pcm_s16le"}


def sdk(app, key: str = "sk-none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(app)}/v1",
                              api_key=key, max_retries=0)


def decode(data: bytes) -> tuple[str, float]:
    container = av.open(io.BytesIO(data))
    stream = container.streams.audio[0]
    name, rate = stream.codec_context.name, stream.rate
    samples = sum(f.samples for f in container.decode(audio=0))
    return name, samples / rate


async def test_speech_all_six_formats_decode_with_the_right_codec_and_length():
    async with server() as (app, _):
        client = sdk(app)
        pcm = await client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT,
                                               response_format="pcm")
        seconds = len(pcm.content) / 2 / 24000  # raw s16le 24 kHz mono
        assert 3.0 < seconds < 5.0
        for fmt, codec in DECODER.items():
            audio = await client.audio.speech.create(model="tts-1", voice="alloy",
                                                     input=TEXT, response_format=fmt)
            name, length = decode(audio.content)
            assert name == codec, fmt
            assert abs(length - seconds) < 0.15, (fmt, length, seconds)
        default = await client.audio.speech.create(model="gpt-4o-mini-tts", voice="coral",
                                                   input="Short one.")
        assert decode(default.content)[0] == "mp3float"  # mp3 is the default


async def test_streaming_response_reads_arrive_while_later_segments_are_generated():
    # real-time pacing: each segment takes as long to make as it lasts
    async with server(engine=FakeEngine(rtf=1.0)) as (app, _):
        client = sdk(app)
        t0 = time.monotonic()
        reads: list[tuple[float, int]] = []
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="nova", input=TEXT, response_format="pcm") as resp:
            assert resp.headers["content-type"].startswith("audio/pcm")
            async for chunk in resp.iter_bytes():
                if not reads:  # at the first read, later segments are still being made
                    completed_at_first_read = app.scheduler.completed
                    busy = app.scheduler.running_batches + app.scheduler.queue_depth
                reads.append((time.monotonic() - t0, len(chunk)))
        assert busy > 0
        assert app.scheduler.completed - completed_at_first_read >= 2  # segments made after
        total = sum(n for _, n in reads)
        audio_s = total / 2 / 24000
        first, last = reads[0][0], reads[-1][0]
        assert len(reads) >= 5
        # the first bytes came long before the clip could have been made in full ...
        assert first < 0.4 * audio_s, (first, audio_s)
        # ... and reads kept coming, spread over the generation
        assert last - first > 0.5 * audio_s
        assert len({round(t, 1) for t, _ in reads}) >= 5


async def test_sse_stream_format_sends_deltas_then_done_with_usage():
    async with server() as (app, _):
        client = sdk(app)
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="echo", input=TEXT, response_format="mp3",
                stream_format="sse") as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[len("data: "):]) async for line in resp.iter_lines()
                      if line.startswith("data: ")]
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
        usage = events[-1]["usage"]
        assert usage["input_tokens"] == len(TEXT) and usage["output_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        mp3 = b"".join(base64.b64decode(e["audio"]) for e in deltas)
        name, seconds = decode(mp3)
        assert name == "mp3float" and seconds > 3.0


async def test_models_voices_and_voice_forms():
    async with server() as (app, _):
        client = sdk(app)
        ids = [m.id async for m in client.models.list()]
        assert "tts-1" in ids and "gpt-4o-mini-tts" in ids
        assert (await client.models.retrieve("tts-1")).id == "tts-1"
        base = f"http://127.0.0.1:{bound_port(app)}/v1"

        def get(path):
            with urllib.request.urlopen(base + path, timeout=5) as r:
                return json.loads(r.read())

        models = await asyncio.to_thread(get, "/audio/models")
        voices = await asyncio.to_thread(get, "/audio/voices")
        assert {"id": "tts-1"} in models["models"]
        names = {v["id"] for v in voices["voices"]}
        assert names >= {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx",
                         "sage", "shimmer", "verse", "marin", "cedar"}
        assert "calm" in names  # and the named voices (rtts.core.voices), built-ins first
        assert all(v["name"] for v in voices["voices"])
        # {"id": ...}, seed:N, any case, and speed/instructions are accepted
        for voice in ({"id": "verse"}, "seed:7", "Shimmer"):
            audio = await client.audio.speech.create(
                model="tts-1", voice=voice, input="Fine.", response_format="wav", speed=1.5,
                instructions="Speak calmly.")
            assert decode(audio.content)[0] == "pcm_s16le"


async def test_voices_map_to_fixed_distinct_chattts_speakers():
    from rtts.api.openai import VOICES, resolve_voice
    from rtts.core.voicenames import speed_from_factor as chattts_speed

    async with server() as (app, _):
        seeds = [resolve_voice(v, app) for v in VOICES]
        assert len(set(seeds)) == 13 and all(s.startswith("seed:") for s in seeds)
    assert chattts_speed(1.0) == 5 and chattts_speed(0.25) == 0 and chattts_speed(4.0) == 9
    assert chattts_speed(2.0) > 5 > chattts_speed(0.5)


ERRORS = [
    (dict(input=""), "input", "empty"),
    (dict(input="x" * 4097), "input", "4096"),
    (dict(voice="nobody"), "voice", "unknown voice"),
    (dict(response_format="ogg-vorbis"), "response_format", "response_format"),
    (dict(speed=9.0), "speed", "0.25"),
    (dict(speed=0.1), "speed", "0.25"),
    (dict(stream_format="chunks"), "stream_format", "stream_format"),
    (dict(input=openai.omit), "input", "missing required parameter"),
    (dict(model=openai.omit), "model", "missing required parameter"),
    (dict(voice=openai.omit), "voice", "missing required parameter"),
    (dict(voice={"name": "alloy"}), "voice", "voice"),
]


async def test_bad_input_raises_the_sdk_error_with_the_server_message():
    async with server() as (app, _):
        client = sdk(app)
        for override, param, words in ERRORS:
            kwargs = {"model": "tts-1", "voice": "alloy", "input": "Hello.", **override}
            with pytest.raises(openai.BadRequestError) as info:
                await client.audio.speech.create(**kwargs)
            err = info.value
            assert err.status_code == 400 and words in err.message, (override, err.message)
            assert err.body["param"] == param and err.body["type"] == "invalid_request_error"
        # not JSON at all, and an unknown model path
        with pytest.raises(openai.BadRequestError) as info:
            await client.post("/audio/speech", body=None, cast_to=object,
                              options={"headers": {"Content-Type": "application/json"}})
        assert "JSON" in info.value.message
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("whisper-1")
        assert "whisper-1" in info.value.message


async def test_overload_not_ready_and_auth_errors_are_openai_shaped():
    cfg = base_config(scheduler=SchedulerConfig(max_queue=0))
    async with server(cfg) as (app, _):
        client = sdk(app)
        with pytest.raises(openai.RateLimitError) as info:  # queue full: 429
            await client.audio.speech.create(model="tts-1", voice="alloy", input="Hi there.")
        assert info.value.response.headers["retry-after"] == "1"
        assert "queue is full" in info.value.message
    async with server() as (app, _):
        client = sdk(app)
        app.governor._move(Level.REJECTING, "test")
        app.apply_level(Level.REJECTING)
        with pytest.raises(openai.InternalServerError) as info:  # governor rejecting: 503
            await client.audio.speech.create(model="tts-1", voice="alloy", input="Hi there.")
        assert info.value.status_code == 503 and "overloaded" in info.value.message
        assert info.value.response.headers["retry-after"] == "1"
    key = "sk-test-openai"
    cfg = base_config(auth=replace(AuthConfig(), api_keys=(key,)))
    async with server(cfg) as (app, _):
        with pytest.raises(openai.AuthenticationError) as info:
            await sdk(app, "wrong").audio.speech.create(model="tts-1", voice="alloy",
                                                        input="Hi.")
        assert info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await sdk(app, "wrong").models.list()
        audio = await sdk(app, key).audio.speech.create(model="tts-1", voice="alloy",
                                                        input="Hi.", response_format="flac")
        assert decode(audio.content)[0] == "flac"


async def test_engine_failure_before_audio_is_a_500_and_disconnect_cancels():
    async with server(engine=FakeEngine(rtf=1.0)) as (app, _):
        client = sdk(app)
        with pytest.raises(openai.InternalServerError) as info:
            await client.audio.speech.create(model="tts-1", voice="alloy",
                                             input="This [fail] here.")
        # a code and an incident id, never the engine's own exception text
        assert "synthesis failed (incident" in info.value.message
        assert "fake engine failure" not in info.value.message
        # a client that leaves mid-stream frees its requests
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=TEXT * 3, response_format="pcm") as resp:
            async for _ in resp.iter_bytes():
                break
        for _ in range(100):
            if app.scheduler.queue_depth == 0 and app.scheduler.running_batches == 0:
                break
            await asyncio.sleep(0.05)
        assert app.scheduler.queue_depth == 0 and app.scheduler.running_batches == 0


async def test_cors_preflight_and_static_library_cross_origin():
    cfg = base_config(auth=replace(AuthConfig(), allowed_origins=("https://app.example",)))
    async with server(cfg) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"

        def request(path, method="GET", origin="https://app.example"):
            req = urllib.request.Request(base + path, method=method, headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status, dict(r.headers)
            except urllib.error.HTTPError as exc:
                return exc.code, dict(exc.headers)

        status, headers = await asyncio.to_thread(request, "/v1/audio/speech", "OPTIONS")
        assert status == 200
        assert headers["access-control-allow-origin"] == "https://app.example"
        status, headers = await asyncio.to_thread(request, "/v1/audio/speech", "OPTIONS",
                                                  "https://evil.example")
        assert status == 400 and "access-control-allow-origin" not in headers
        libs = sorted(p.name for p in app.config.web_dir.glob("*.js")) if app.config.web_dir \
            else []
        if libs:
            status, headers = await asyncio.to_thread(request, "/" + libs[0])
            assert status == 200 and headers["access-control-allow-origin"] == \
                "https://app.example"
        status, _ = await asyncio.to_thread(request, "/openapi.json")
        assert status == 200


async def test_drain_lets_a_streaming_speech_body_finish_and_refuses_new_ones():
    cfg = replace(base_config(), shutdown_grace_s=15.0)  # longer than the clip
    async with server(cfg, FakeEngine(rtf=1.0)) as (app, _):
        client = sdk(app)
        other = sdk(app)
        full = await client.audio.speech.create(model="tts-1", voice="ash", input="Quick one.",
                                                response_format="pcm")
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="ash", input=TEXT, response_format="pcm") as resp:
            chunks = []
            shutdown = None
            async for chunk in resp.iter_bytes():
                chunks.append(chunk)
                if shutdown is None:
                    shutdown = asyncio.create_task(app.drain_and_close())
                    await asyncio.sleep(0.05)
                    assert app.state == "draining"
                    # still answering, but refusing new speech (test_drain.py)
                    with pytest.raises(openai.APIStatusError) as refused:
                        await other.audio.speech.create(model="tts-1", voice="ash",
                                                        input="Too late.")
                    assert refused.value.status_code == 503
                    assert refused.value.response.headers["retry-after"]
            assert shutdown is not None
        body = b"".join(chunks)
        assert len(body) / 2 / 24000 > 3.0  # the whole clip, not cut at the drain
        assert len(full.content) > 0
        await shutdown
        app.state = "stopped"


async def test_quota_is_held_while_a_body_streams_and_released_after():
    key = "sk-quota"
    cfg = base_config(auth=replace(AuthConfig(), api_keys=(key,), max_sessions_per_key=1))
    async with server(cfg, FakeEngine(rtf=1.0)) as (app, _):
        client = sdk(app, key)
        for _ in range(3):  # listing models does not use up a session
            assert [m.id async for m in client.models.list()]
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="sage", input=TEXT, response_format="pcm") as resp:
            async for _ in resp.iter_bytes():
                with pytest.raises(openai.RateLimitError) as info:  # the one session is busy
                    await client.audio.speech.create(model="tts-1", voice="sage", input="Hi.")
                assert "sessions per key" in info.value.message
                assert info.value.response.headers["retry-after"]
                break
        for _ in range(100):  # the client left mid-body: the session is given back
            if not any(app.auth.active.values()):
                break
            await asyncio.sleep(0.05)
        assert not any(app.auth.active.values())
        audio = await client.audio.speech.create(model="tts-1", voice="sage", input="Hi.",
                                                 response_format="wav")
        assert decode(audio.content)[0] == "pcm_s16le"
        assert not any(app.auth.active.values())


async def test_oversized_body_is_413():
    async with server() as (app, _):
        with pytest.raises(openai.APIStatusError) as info:
            await sdk(app).audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                                               extra_body={"pad": "x" * 300_000})
        assert info.value.status_code == 413 and "larger than" in info.value.message


async def test_disallowed_origin_is_403():
    cfg = base_config(auth=replace(AuthConfig(), allowed_origins=("https://app.example",)))
    async with server(cfg) as (app, _):
        evil = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(app)}/v1",
                                  api_key="x", max_retries=0,
                                  default_headers={"Origin": "https://evil.example"})
        with pytest.raises(openai.PermissionDeniedError) as info:
            await evil.audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
        assert "origin" in info.value.message
        good = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(app)}/v1",
                                  api_key="x", max_retries=0,
                                  default_headers={"Origin": "https://app.example"})
        audio = await good.audio.speech.create(model="tts-1", voice="alloy", input="Hi.",
                                               response_format="aac")
        assert decode(audio.content)[0] == "aac"


async def test_metrics_count_streaming_http_requests():
    async with server(engine=FakeEngine(rtf=1.0)) as (app, _):
        client = sdk(app)
        base = f"http://127.0.0.1:{bound_port(app)}"

        def metric(name: str) -> float:
            with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[1])
            raise AssertionError(f"no {name}")

        active = "rtts_active_http_requests"
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="onyx", input=TEXT, response_format="pcm") as resp:
            async for _ in resp.iter_bytes():
                # this speech body (the /metrics scrape does not count itself)
                assert await asyncio.to_thread(metric, active) == 1
                break
        for _ in range(100):
            if await asyncio.to_thread(metric, active) == 0:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(metric, active) == 0
        assert await asyncio.to_thread(metric, "rtts_http_speech_requests_total") == 1
