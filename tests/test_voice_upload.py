"""Voices from an uploaded clip (``POST /v1/voices`` JSON and multipart, ElevenLabs'
``POST /v1/voices/add``) and speaker anchoring through the core, on the fake engine (which has
samples as ChatTTS has them). Real files made with PyAV, real HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.error
import urllib.request
import uuid
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from helpers import base_config, client, server
from rtts.audio.decode import ClipError, decode_clip
from rtts.core.governor import Level
from rtts.core.params import NO_SPEAKER, SynthParams, parse_params, trim_sample
from rtts.engines.base import EngineInfo
from rtts.engines.fake import FakeEngine
from rtts.errors import ProtocolError
from rtts.server import bound_port

av = pytest.importorskip("av")


def make_clip(fmt: str, codec: str, seconds: float = 2.0, rate: int = 48000) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout="mono")
        t = np.arange(int(rate * seconds)) / rate
        x = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(t)) / 2 * 32767).astype(np.int16)
        size = s.codec_context.frame_size or 1024
        for i in range(0, len(x), size):
            frame = av.AudioFrame.from_ndarray(x[None, i:i + size], format="s16",
                                               layout="mono")
            frame.sample_rate = rate
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


CLIPS = {"wav": ("wav", "pcm_s16le"), "mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus")}


def call(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None,
         ctype: str = "application/json") -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            content, status = r.read(), r.status
    except urllib.error.HTTPError as exc:
        content, status = exc.read(), exc.code
    try:
        return status, json.loads(content)
    except ValueError:
        return status, content


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = io.BytesIO()
    for k, v in fields.items():
        out.write(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n"
                  f"{v}\r\n".encode())
    for k, (fname, data) in files.items():
        out.write(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"; "
                  f"filename=\"{fname}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
                  .encode() + data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


# -- pure ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CLIPS))
def test_clips_decode_to_24k_mono(kind):
    audio = decode_clip(make_clip(*CLIPS[kind]), max_seconds=10, max_bytes=2**23)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - 48000) < 2400  # 2 s at 24 kHz (codec padding aside)
    assert 0.05 < np.abs(audio).max() <= 1.0


def test_bad_clips_are_refused_before_they_expand():
    with pytest.raises(ClipError, match="larger"):
        decode_clip(b"\0" * 1001, max_seconds=10, max_bytes=1000)
    with pytest.raises(ClipError, match="long"):
        decode_clip(make_clip("wav", "pcm_s16le", seconds=3), max_seconds=2, max_bytes=2**23)
    with pytest.raises(ClipError, match="decoded"):
        decode_clip(b"RIFF" + b"\x13" * 500, max_seconds=10, max_bytes=2**23)
    with pytest.raises(ClipError):
        decode_clip(b"", max_seconds=10, max_bytes=2**23)


def test_start_options_are_validated():
    p = parse_params({"anchor": False, "oral": 3, "laugh": 1, "breaks": 7,
                      "repetition_penalty": 1.2})
    assert (p.anchor, p.refine_prompt, p.repetition_penalty) == (
        False, "[oral_3][laugh_1][break_7]", 1.2)
    # unset: the server decides (Service.anchor_fits), true/false force it
    assert parse_params({}).anchor is None and not parse_params({}).refines
    assert parse_params({"anchor": True}).anchor is True
    for bad in ({"anchor": "yes"}, {"oral": 10}, {"laugh": 3}, {"breaks": -1},
                {"repetition_penalty": 0.5}, {"repetition_penalty": True}):
        with pytest.raises(ProtocolError):
            parse_params(bad)


def test_trim_sample_bounds_codes_and_text():
    engine = FakeEngine()
    long = engine.encode_sample(np.ones(24000 * 12, np.float32) * 0.1, "word " * 100)
    assert long.seconds > 11
    cut = trim_sample(long, 10.0)
    assert cut.frames == int(10 * 24000 / 512) and cut.num_vq == 4
    assert 0 < len(cut.text) < len(long.text)
    codes = np.frombuffer(long.codes, "<u2").reshape(4, -1)
    assert np.array_equal(np.frombuffer(cut.codes, "<u2").reshape(4, -1),
                          codes[:, :cut.frames])


# -- anchoring through the core (fake engine) ----------------------------------------------


async def _segments(app, text, **params):
    """Speak ``text`` in one context to its end; the context (its anchor) after."""
    ctx = app.open_context(SynthParams(**params), use_cache=False, schedule=(8,))
    ctx.feed(text)
    ctx.end()
    async for _ in ctx.events():
        pass
    return ctx


async def test_later_segments_carry_the_first_segments_codes():
    engine = FakeEngine(ms_per_char=5)
    submitted: list[SynthParams] = []
    async with server(engine=engine) as (app, _):
        real = app.open_segment

        async def spy(text, params, **kw):
            submitted.append(params)
            return await real(text, params, **kw)

        app.open_segment = spy  # type: ignore[method-assign]
        text = "First one here. Second one now. And a third."
        ctx = await _segments(app, text, voice="seed:3")
        assert len(submitted) == 3 and submitted[0].sample is None
        assert ctx.anchor is not None
        assert submitted[1].sample == submitted[2].sample == ctx.anchor
        assert ctx.anchor.text == "First one here."
        submitted.clear()
        await _segments(app, text, voice="seed:3", anchor=False)
        assert len(submitted) == 3 and all(p.sample is None for p in submitted)


class MeasuredFake(FakeEngine):
    """The fake engine reporting measured step times, as ChatTTS's ``info.kernels`` does."""
    kernels: dict[str, object] | None = None

    @property
    def info(self) -> EngineInfo:
        base = super().info
        return base if self.kernels is None else replace(base, kernels=self.kernels)


async def test_unset_anchor_follows_the_engines_measured_real_time_headroom():
    engine = MeasuredFake(ms_per_char=2)
    async with server(engine=engine) as (app, _):
        # unmeasured (the fake engine reports no step times): anchor
        assert (await _segments(app, "One here. Two here.", voice="seed:3")).anchoring
        # measured: 2 real-time streams; with 1 speaking one more fits, with 2 it does not
        engine.kernels = {"realtime_streams": 2, "step_ms": {"1": 5.0, "2": 8.0}}
        app.speaking = 1
        assert app.anchor_fits(engine)
        app.speaking = 2
        assert not app.anchor_fits(engine)
        ctx = app.open_context(SynthParams(voice="seed:3"), use_cache=False)
        assert not ctx.anchoring  # behind real time: the later segments do not wait
        forced = app.open_context(SynthParams(voice="seed:3", anchor=True), use_cache=False)
        assert forced.anchoring
        ctx.cancel()
        forced.cancel()
        app.speaking = 0


async def test_a_degraded_server_does_not_wait_for_the_anchor():
    engine = FakeEngine(ms_per_char=20, chunk_ms=50, rtf=1.0)
    async with server(engine=engine) as (app, _):
        app.governor.level = Level.DEGRADED  # as the governor sets it under load, and holds
        app.governor.update = lambda signals, now: Level.DEGRADED  # type: ignore[method-assign]
        ctx = app.open_context(SynthParams(voice="seed:3"), use_cache=False, schedule=(8,))
        ctx.feed("First one here, a little longer. Second one now. And a third.")
        ctx.end()
        events = ctx.events()
        async for event in events:
            if type(event).__name__ == "Audio":
                break
        # the first segment is still being generated, and the later ones are submitted
        assert ctx.anchor is None and len(ctx._inflight) > 1
        async for _ in events:
            pass
        assert ctx.finished


async def test_cancel_while_later_segments_wait_for_the_anchor():
    engine = FakeEngine(ms_per_char=20, chunk_ms=50, rtf=1.0)
    async with server(engine=engine) as (app, _):
        ctx = app.open_context(SynthParams(voice="seed:3"), use_cache=False, schedule=(8,))
        ctx.feed("First one here, a little longer. Second one now. And a third.")
        ctx.end()
        events = ctx.events()
        async for event in events:
            if type(event).__name__ == "Audio":
                break
        assert ctx.anchor is None and ctx._anchor_source is not None  # waiting for it
        ctx.cancel()
        await events.aclose()
        assert ctx._kick is None
        # a fresh context after it works, anchored
        done = await _segments(app, "One here. Two here.", voice="seed:3")
        assert done.anchor is not None and done.finished


# -- over HTTP -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CLIPS))
async def test_upload_a_clip_makes_a_voice_with_a_sample(tmp_path, kind):
    async with server(base_config(voices_dir=tmp_path)) as (app, url):
        base = f"http://127.0.0.1:{bound_port(app)}"
        clip = make_clip(*CLIPS[kind])
        if kind == "mp3":  # multipart
            raw, ctype = multipart({"name": "from-mp3", "transcript": "Hello there."},
                                   {"audio": ("a.mp3", clip)})
            status, body = await asyncio.to_thread(call, base + "/v1/voices", "POST",
                                                   raw=raw, ctype=ctype)
        else:
            status, body = await asyncio.to_thread(
                call, base + "/v1/voices", "POST",
                {"name": f"from-{kind}", "audio": base64.b64encode(clip).decode(),
                 "transcript": "Hello there."})
        assert status == 201, body
        assert body["sample"]["text"] == "Hello there."
        assert 1.8 < body["sample"]["seconds"] < 2.2
        name = body["name"]
        stored = json.loads((tmp_path / f"{name}.json").read_text())
        assert stored["sample"]["text"] == "Hello there." and stored["seed"] is None
        params = app.voices.apply(SynthParams(voice=name))
        assert params.voice == NO_SPEAKER and params.sample is not None
        # it speaks, on the native socket
        async with client(url) as c:
            await c.send(type="start", context_id="a", voice=name)
            await c.send(type="text", context_id="a", text="Speak like the clip.")
            await c.send(type="end", context_id="a")
            await c.until("done", "a")
            assert not c.got.of("error")


async def test_elevenlabs_add_voice_form(tmp_path):
    async with server(base_config(voices_dir=tmp_path)) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        raw, ctype = multipart({"name": "My Voice", "description": "d", "labels": "{}",
                                "transcript": "Hello."},
                               {"files": ("a.ogg", make_clip(*CLIPS["opus"]))})
        status, body = await asyncio.to_thread(call, base + "/v1/voices/add", "POST",
                                               raw=raw, ctype=ctype)
        assert status == 200, body
        voice_id = body["voice_id"]
        assert voice_id.startswith("my-voice-")
        status, one = await asyncio.to_thread(call, base + f"/v1/voices/{voice_id}")
        assert status == 200 and one["sample"]["text"] == "Hello."


async def test_bad_uploads_get_4xx_and_store_nothing(tmp_path):
    async with server(base_config(voices_dir=tmp_path)) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        post = base + "/v1/voices"
        b64 = base64.b64encode
        wav = make_clip("wav", "pcm_s16le")
        cases = [
            ({"name": "x1", "audio": "not base64!"}, 400),
            ({"name": "x2", "audio": b64(b"garbage" * 100).decode()}, 400),
            ({"name": "x3", "audio": b64(make_clip("wav", "pcm_s16le", 11)).decode()}, 400),
            ({"name": "x4", "audio": b64(wav[:60]).decode()}, 400),  # truncated
            ({"name": "X bad", "audio": b64(wav).decode()}, 400),
            ({"name": "x5", "audio": b64(wav).decode(), "transcript": "t" * 1000}, 400),
            ({"name": "x6", "audio": b64(wav).decode(), "extra": 1}, 400),
            ({"name": "alloy", "audio": b64(wav).decode()}, 409),
        ]
        for body, want in cases:
            status, err = await asyncio.to_thread(call, post, "POST", body)
            assert status == want, (body.get("name"), status, err)
            assert "error" in err and err["error"]["message"]
        # over the body limit: refused before anything is decoded
        try:  # the server answers 413 from the declared length and may close while we send
            status, err = await asyncio.to_thread(call, post, "POST",
                                                  raw=b"{" + b" " * (12 * 2**20) + b"}")
        except urllib.error.URLError:
            status = 413
        assert status == 413
        raw, ctype = multipart({"name": "x7"}, {"audio": ("a.wav", b"RIFFjunk")})
        status, err = await asyncio.to_thread(call, post, "POST", raw=raw, ctype=ctype)
        assert status == 400
        status, err = await asyncio.to_thread(call, post, "POST", raw=b"--x\r\nbroken",
                                              ctype="multipart/form-data; boundary=x")
        assert status == 400
        raw, ctype = multipart({"name": "no file"}, {})
        status, _ = await asyncio.to_thread(call, base + "/v1/voices/add", "POST", raw=raw,
                                            ctype=ctype)
        assert status == 400
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


async def test_save_voice_from_a_context_the_server_spoke(tmp_path):
    async with server(base_config(voices_dir=tmp_path)) as (app, url):
        async with client(url) as c:
            await c.send(type="save_voice", context_id="a", name="early")
            err = await c.until("error")
            assert err["code"] == "unknown_context"
            await c.send(type="start", context_id="a", voice="seed:42")
            await c.send(type="text", context_id="a", text="First part here. Then more.")
            await c.send(type="end", context_id="a")
            await c.until("done", "a")
            await c.send(type="save_voice", context_id="a", name="mine")
            saved = await c.until("voice_saved", "a")
            assert saved["voice"]["name"] == "mine" and saved["voice"]["seed"] == 42
            assert saved["voice"]["sample"]["text"] == "First part here."
            await c.send(type="save_voice", context_id="a", name="mine")  # exists
            err = await c.until("error", "a")
            assert "exists" in err["message"]
            await c.send(type="save_voice", context_id="a", name="Bad Name")
            err = await c.until("error", "a")
            assert err["code"] == "invalid_params"
        stored = json.loads((tmp_path / "mine.json").read_text())
        assert stored["seed"] == 42 and stored["sample"]["text"] == "First part here."
        params = app.voices.apply(SynthParams(voice="mine"))
        assert params.voice == "seed:42" and params.sample is not None
        assert params.sample.text == "First part here."
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]


def test_openai_instructions_map_onto_the_refine_prompt():
    from rtts.api.openai import refine_from_instructions

    assert refine_from_instructions(None) == {} == refine_from_instructions("Speak.")
    assert refine_from_instructions("Speak in a cheerful, casual tone with pauses.") == {
        "laugh": 1, "oral": 6, "breaks": 5}
    assert refine_from_instructions("Laughing, formal and brisk") == {
        "laugh": 2, "oral": 0, "breaks": 1}
    assert refine_from_instructions("use [oral_3][break_4] please, cheerful") == {
        "oral": 3, "breaks": 4}
    assert refine_from_instructions("[laugh_9]") == {}  # out of range: ignored
    assert SynthParams(**refine_from_instructions("slowly")).refine_prompt == "[break_5]"


def test_elevenlabs_voice_settings_map_where_they_map():
    from rtts.api.elevenlabs import ElevenError, settings_of

    assert settings_of(None) == {"speed": 5}
    got = settings_of({"stability": 0.5, "similarity_boost": 0.75, "style": 0.0,
                       "use_speaker_boost": True, "speed": 1.0})
    assert got == {"speed": 5, "temperature": 0.3}
    got = settings_of({"stability": 1.0, "similarity_boost": 0, "style": 0.5})
    assert got == {"speed": 5, "temperature": 0.05, "anchor": False, "oral": 4}
    SynthParams(**got)  # valid params
    for bad in ({"stability": 2}, {"style": -0.1}, {"similarity_boost": "x"}):
        with pytest.raises(ElevenError):
            settings_of(bad)


async def test_anchor_is_a_tts_query_option():
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}/v1/tts?text=Hi%20there.&format=pcm16"
        status, _ = await asyncio.to_thread(call, base + "&anchor=false&oral=2")
        assert status == 200
        status, err = await asyncio.to_thread(call, base + "&anchor=maybe")
        assert status == 400 and "anchor" in err["error"]["message"]
        status, err = await asyncio.to_thread(call, base + "&laugh=5")
        assert status == 400 and "laugh" in err["error"]["message"]
