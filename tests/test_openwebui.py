"""Open WebUI's calls to a TTS server, replayed exactly as its backend makes them
(``backend/open_webui/routers/audio.py``: ``get_available_models``,
``get_available_voices``, ``_tts_elevenlabs``), with aiohttp as it uses it; Open WebUI itself
is too large a dependency to install for this.

* OpenAI engine (``AUDIO_TTS_OPENAI_API_BASE_URL=http://rtts/v1``): ``GET {base}/audio/models``
  (``models``; on failure ``GET {base}/models``, ``data``) and ``GET {base}/audio/voices``
  (``voices: [{id, name}]``), **with no credentials**; speech is ``POST {base}/audio/speech``
  with ``Authorization: Bearer``.
* ElevenLabs engine (``ELEVENLABS_API_BASE_URL=http://rtts``): ``GET /v1/models`` (a JSON array
  of ``{model_id, name}``) and ``GET /v1/voices`` (``voices: [{voice_id, name}]``) with
  ``xi-api-key``; speech is ``POST /v1/text-to-speech/{voice_id}`` once the voice id is in the
  list ("Invalid voice id" otherwise).

Open WebUI swallows every listing error (it falls back to ``tts-1`` and six built-in names, or to
no voices at all), so these tests check what it would end up with.
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import aiohttp
import av

from helpers import base_config, server
from rtts.api.auth import AuthConfig
from rtts.server import bound_port

_OPENAI_FALLBACK_MODELS = [{"id": "tts-1"}, {"id": "tts-1-hd"}]
_OPENAI_DEFAULT_VOICES = {v: v for v in ("alloy", "echo", "fable", "onyx", "nova", "shimmer")}


async def openai_models(session: aiohttp.ClientSession, base: str) -> list[dict[str, Any]]:
    try:
        async with session.get(f"{base}/audio/models") as resp:
            resp.raise_for_status()
            data = await resp.json()
            models: list[dict[str, Any]] = data.get("models", [])
            return models
    except Exception:
        try:
            async with session.get(f"{base}/models") as resp:
                resp.raise_for_status()
                data = await resp.json()
                models = data.get("data", data.get("models", []))
                return models
        except Exception:
            return list(_OPENAI_FALLBACK_MODELS)


async def openai_voices(session: aiohttp.ClientSession, base: str) -> dict[str, str]:
    try:
        async with session.get(f"{base}/audio/voices") as resp:
            resp.raise_for_status()
            data = await resp.json()
            return {v["id"]: v["name"] for v in data.get("voices", [])}
    except Exception:
        return dict(_OPENAI_DEFAULT_VOICES)


async def eleven_models(session: aiohttp.ClientSession, base: str, key: str
                        ) -> list[dict[str, Any]]:
    try:
        async with session.get(f"{base}/v1/models", headers={
                "xi-api-key": key, "Content-Type": "application/json"}) as resp:
            resp.raise_for_status()
            models = await resp.json()
            return [{"name": m["name"], "id": m["model_id"]} for m in models]
    except Exception:
        return []


async def eleven_voices(session: aiohttp.ClientSession, base: str, key: str) -> dict[str, str]:
    try:
        async with session.get(f"{base}/v1/voices", headers={
                "xi-api-key": key, "Content-Type": "application/json"}) as resp:
            resp.raise_for_status()
            voices_data = await resp.json()
            return {v["voice_id"]: v["name"] for v in voices_data.get("voices", [])}
    except Exception:
        return {}


async def eleven_speech(session: aiohttp.ClientSession, base: str, key: str, voice_id: str,
                        text: str, model: str) -> bytes:
    available = await eleven_voices(session, base, key)
    assert not available or voice_id in available, "Invalid voice id"
    async with session.post(f"{base}/v1/text-to-speech/{voice_id}", json={
            "text": text, "model_id": model,
            "voice_settings": {"stability": 0.5, "similarity_boost": 0.5}}, headers={
            "Accept": "audio/mpeg", "Content-Type": "application/json",
            "xi-api-key": key}) as resp:
        resp.raise_for_status()
        return await resp.read()


async def test_openai_engine_lists_rtts_models_and_voices_without_a_key(tmp_path):
    async with server(base_config(voices_dir=tmp_path)) as (app, _):
        app.voices.create({"name": "narrator", "seed": 1234})
        base = f"http://127.0.0.1:{bound_port(app)}/v1"
        async with aiohttp.ClientSession() as session:
            models = await openai_models(session, base)
            voices = await openai_voices(session, base)
        assert {"tts-1", "rtts"} <= {m["id"] for m in models}
        assert {"alloy", "marin", "narrator"} <= set(voices)  # not only the six fallbacks


async def test_with_a_key_listing_needs_public_listing_and_speech_still_needs_the_key(
        tmp_path):
    for public in (False, True):
        cfg = replace(base_config(voices_dir=tmp_path / str(public)),
                      auth=AuthConfig(api_keys=("sekrit",), public_listing=public))
        async with server(cfg) as (app, _):
            app.voices.create({"name": "narrator", "seed": 1234})
            base = f"http://127.0.0.1:{bound_port(app)}/v1"
            async with aiohttp.ClientSession() as session:
                models = await openai_models(session, base)
                voices = await openai_voices(session, base)
                if public:  # what rtts serves
                    assert "rtts" in {m["id"] for m in models}
                    assert "narrator" in voices
                else:  # the 401s: Open WebUI falls back to its built-in lists
                    assert models == _OPENAI_FALLBACK_MODELS
                    assert voices == _OPENAI_DEFAULT_VOICES
                # the speech endpoint is never public
                async with session.post(f"{base}/audio/speech", json={
                        "model": "tts-1", "input": "Hi.", "voice": "alloy"}) as resp:
                    assert resp.status == 401
                async with session.post(f"{base}/audio/speech", json={
                        "model": "tts-1", "input": "Hi.", "voice": "alloy"},
                        headers={"Authorization": "Bearer sekrit"}) as resp:
                    assert resp.status == 200 and await resp.read()
                # a wrong key presented is still refused, public listing or not
                async with session.get(f"{base}/audio/voices",
                                       headers={"Authorization": "Bearer wrong"}) as resp:
                    assert resp.status == 401
                # the rtts voice registry (seeds, parameters) always needs the key
                async with session.get(f"{base}/voices") as resp:
                    assert resp.status == 401


async def test_elevenlabs_engine_lists_voices_and_models_and_speaks_a_listed_voice(tmp_path):
    for keys in ((), ("sekrit",)):
        cfg = replace(base_config(voices_dir=tmp_path / str(len(keys))),
                      auth=AuthConfig(api_keys=keys))
        async with server(cfg) as (app, _):
            app.voices.create({"name": "narrator", "seed": 1234})
            base = f"http://127.0.0.1:{bound_port(app)}"
            async with aiohttp.ClientSession() as session:
                models = await eleven_models(session, base, "sekrit")
                voices = await eleven_voices(session, base, "sekrit")
                assert "eleven_multilingual_v2" in {m["id"] for m in models}
                assert {"alloy", "narrator"} <= set(voices)
                audio = await eleven_speech(session, base, "sekrit", "narrator",
                                            "Hello from Open WebUI.", models[0]["id"])
                if keys:  # a wrong key: Open WebUI ends up with nothing
                    assert await eleven_voices(session, base, "wrong") == {}
                    assert await eleven_models(session, base, "wrong") == []
                # without xi-api-key, /v1/voices is rtts's own registry shape
                async with session.get(f"{base}/v1/voices", headers={
                        "Authorization": "Bearer sekrit"}) as resp:
                    own = await resp.json()
                assert all("voice_id" not in v for v in own["voices"])
                assert "narrator" in {v["name"] for v in own["voices"]}
            container = av.open(io.BytesIO(audio))
            assert container.streams.audio[0].codec_context.name.startswith("mp3")
