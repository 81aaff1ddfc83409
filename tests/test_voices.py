"""Named voices: the registry (rtts.core.voices), its HTTP endpoints (rtts.api.voices), resolution
on every protocol, and two instances sharing one voices directory."""

from __future__ import annotations

import asyncio
import json
import lzma
import os
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import base_config, client, server
from rtts.api.auth import AuthConfig
from rtts.core.params import SynthParams
from rtts.core.voices import BUILTIN_VOICES, Voice, VoiceError, VoiceStore, default_voices_dir
from rtts.server import bound_port

b14 = pytest.importorskip("pybase16384")


def speaker_string(values: np.ndarray) -> str:
    """Encode like ChatTTS's ``Speaker._encode`` (float16, raw LZMA2, base16384)."""
    raw = lzma.compress(values.astype(np.float16).tobytes(), format=lzma.FORMAT_RAW,
                        filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
    return str(b14.encode_to_string(raw))


GOOD_SPEAKER = speaker_string(np.linspace(-1, 1, 768))


# -- the registry, pure -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "narrator", "n-1_x", "0", "a" * 64])
def test_good_names(tmp_path, name):
    store = VoiceStore(tmp_path)
    voice = store.create({"name": name, "seed": 7})
    assert voice.name == name and store.get(name) == voice


@pytest.mark.parametrize("name", ["", "A", "-x", "_x", "a" * 65, "seed:5", "a b", "a/b",
                                  "../x", "x.json", "é", None, 5])
def test_bad_names(tmp_path, name):
    with pytest.raises(VoiceError) as info:
        VoiceStore(tmp_path).create({"name": name, "seed": 7})
    assert info.value.status == 400 and info.value.param == "name"
    assert list(tmp_path.iterdir()) == []


def test_builtins_are_stable_and_reserved(tmp_path):
    store = VoiceStore(tmp_path)
    # These names and seeds are public (README); changing one changes a user's voice.
    assert BUILTIN_VOICES == {"default": 2, "calm": 1031, "bright": 4099, "warm": 1597,
                              "deep": 2333, "soft": 8191, "clear": 6007}
    assert [v.name for v in store.list()] == list(BUILTIN_VOICES)
    assert all(v.builtin for v in store.list())
    assert store.apply(SynthParams(voice="calm")).voice == "seed:1031"
    for name in ("default", "calm"):
        with pytest.raises(VoiceError) as info:
            store.create({"name": name, "seed": 1})
        assert info.value.status == 409
        with pytest.raises(VoiceError) as info:
            store.delete(name)
        assert info.value.status == 403
    reserved = VoiceStore(tmp_path, reserved=["alloy"])
    with pytest.raises(VoiceError):
        reserved.create({"name": "alloy", "seed": 1})


def test_persists_and_collides(tmp_path):
    a = VoiceStore(tmp_path)
    voice = a.create({"name": "narrator", "seed": 1234, "params": {"temperature": 0.2}},
                     now=1.5)
    on_disk = json.loads((tmp_path / "narrator.json").read_text())
    assert on_disk == {"name": "narrator", "speaker": None, "seed": 1234,
                       "params": {"temperature": 0.2}, "created_at": 1.5}
    b = VoiceStore(tmp_path)  # another instance (or a restart) on the same directory
    assert b.get("narrator") == voice
    with pytest.raises(VoiceError) as info:
        b.create({"name": "narrator", "seed": 1})
    assert info.value.status == 409
    assert a.get("narrator") == voice  # not overwritten
    b.delete("narrator")
    assert a.get("narrator") is None  # seen at once (stat on every lookup)
    with pytest.raises(VoiceError) as info:
        a.delete("narrator")
    assert info.value.status == 404
    a.create({"name": "narrator", "seed": 99})  # recreated with another seed
    assert b.apply(SynthParams(voice="narrator")).voice == "seed:99"


def test_write_is_atomic_and_exclusive(tmp_path):
    """No temporary files are left, and of many instances creating one name at once
    exactly one wins; every reader sees a whole file or none."""
    stores = [VoiceStore(tmp_path) for _ in range(8)]
    results: list[Any] = []
    seen: list[Voice | None] = []
    stop = threading.Event()

    def create(store: VoiceStore, seed: int) -> None:
        try:
            results.append(store.create({"name": "race", "seed": seed}))
        except VoiceError as exc:
            results.append(exc.status)

    def read() -> None:
        reader = VoiceStore(tmp_path)
        while not stop.is_set():
            seen.append(reader.get("race"))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    writers = [threading.Thread(target=create, args=(s, i)) for i, s in enumerate(stores)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    winners = [r for r in results if isinstance(r, Voice)]
    assert len(winners) == 1 and sorted(r for r in results if r == 409) == [409] * 7
    assert os.listdir(tmp_path) == ["race.json"]
    assert seen and all(v is None or v == winners[0] for v in seen)


def test_a_broken_file_is_ignored_not_fatal(tmp_path, caplog):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"name": "nope", "seed": 1}))
    store = VoiceStore(tmp_path)
    assert store.get("broken") is None and store.get("other") is None
    assert [v.name for v in store.list()] == list(BUILTIN_VOICES)
    assert store.apply(SynthParams(voice="broken")).voice == "broken"


def test_validation(tmp_path):
    store = VoiceStore(tmp_path)
    bad: list[tuple[Any, str | None, str]] = [
        ({"name": "x"}, "speaker", "exactly one of seed"),
        ({"name": "x", "seed": 1, "speaker": GOOD_SPEAKER}, "seed", "exactly one"),
        ({"name": "x", "seed": -1}, "seed", "seed must be"),
        ({"name": "x", "seed": True}, "seed", "seed must be"),
        ({"name": "x", "seed": "5"}, "seed", "seed must be"),
        ({"name": "x", "speaker": "garbage that is no embedding"}, "speaker", "ChatTTS"),
        ({"name": "x", "speaker": "seed:5"}, "speaker", "seed"),
        ({"name": "x", "speaker": ""}, "speaker", "non-empty"),
        ({"name": "x", "speaker": speaker_string(np.array([1.0, np.nan, 2.0]))}, "speaker",
         "non-finite"),
        ({"name": "x", "speaker": speaker_string(np.array([np.inf] * 768))}, "speaker",
         "non-finite"),
        ({"name": "x", "seed": 1, "params": {"temperature": 9}}, "params", "temperature"),
        ({"name": "x", "seed": 1, "params": {"voice": "seed:2"}}, "params", "unknown params"),
        ({"name": "x", "seed": 1, "params": []}, "params", "JSON object"),
        ({"name": "x", "seed": 1, "colour": "blue"}, None, "unknown fields"),
        ([], None, "JSON object"),
    ]
    for body, param, message in bad:
        with pytest.raises(VoiceError) as info:
            store.create(body)
        assert info.value.status == 400, body
        assert info.value.param == param and message in info.value.message, body
    assert list(tmp_path.iterdir()) == []

    def engine_validate(speaker: str) -> None:
        raise ValueError("voice embedding has 768 values; this model needs 512")

    with pytest.raises(VoiceError, match="needs 512"):
        store.create({"name": "x", "speaker": GOOD_SPEAKER}, validate=engine_validate)
    voice = store.create({"name": "x", "speaker": GOOD_SPEAKER})
    assert voice.voice == GOOD_SPEAKER and voice.seed is None


def test_apply_fills_only_params_left_at_their_defaults(tmp_path):
    store = VoiceStore(tmp_path)
    store.create({"name": "slow", "seed": 3,
                  "params": {"speed": 2, "temperature": 0.5, "seed": 11}})
    got = store.apply(SynthParams(voice="slow"))
    assert got == SynthParams(voice="seed:3", speed=2, temperature=0.5, seed=11)
    got = store.apply(SynthParams(voice="slow", speed=7, seed=1))
    assert got == SynthParams(voice="seed:3", speed=7, temperature=0.5, seed=1)
    for other in (None, "seed:5", GOOD_SPEAKER, "unknown"):
        assert store.apply(SynthParams(voice=other)) == SynthParams(voice=other)
    assert VoiceStore(None).apply(SynthParams(voice="slow")).voice == "slow"


def test_default_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RTTS_VOICES_DIR", str(tmp_path / "v"))
    assert default_voices_dir() == tmp_path / "v"
    monkeypatch.delenv("RTTS_VOICES_DIR")
    monkeypatch.setenv("RTTS_HOME", str(tmp_path))
    assert default_voices_dir() == tmp_path / "voices"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_directory_is_a_clear_error(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(VoiceError) as info:
            VoiceStore(tmp_path).create({"name": "x", "seed": 1})
        assert info.value.status == 500 and "cannot store" in info.value.message
    finally:
        tmp_path.chmod(0o700)


def test_unwritable_path_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")  # the voices "directory" is a file
    with pytest.raises(VoiceError) as info:
        VoiceStore(tmp_path / "file" / "voices").create({"name": "x", "seed": 1})
    assert info.value.status == 500 and "cannot store" in info.value.message


def test_no_directory_means_builtins_only():
    store = VoiceStore(None)
    with pytest.raises(VoiceError) as info:
        store.create({"name": "x", "seed": 1})
    assert info.value.status == 403
    assert [v.name for v in store.list()] == list(BUILTIN_VOICES)


# -- over HTTP and the native protocol (fake engine) ---------------------------------------


def call(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            content = r.read()
            status = r.status
            ctype = r.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        content, status, ctype = exc.read(), exc.code, exc.headers.get("content-type", "")
    if "json" in ctype and content:
        return status, json.loads(content)
    return status, content


async def native_audio(url: str, voice: str, **params: Any) -> bytes:
    async with client(url) as c:
        await c.send(type="start", context_id="a", voice=voice, cache=False, **params)
        await c.send(type="text", context_id="a", text="Hello there, how are you?")
        await c.send(type="end", context_id="a")
        await c.until("done", "a")
        errors = c.got.of("error")
        assert not errors, errors
        return c.got.audio(c.got.of("segment_started", "a")[0]["stream"])


async def test_create_list_use_delete_over_http(tmp_path):
    async with server(base_config(voices_dir=tmp_path)) as (app, url):
        base = f"http://127.0.0.1:{bound_port(app)}"
        status, body = await asyncio.to_thread(
            call, base + "/v1/voices", "POST",
            {"name": "myname", "seed": 1234, "params": {"seed": 5}})
        assert status == 201, body
        assert body == {"name": "myname", "builtin": False, "seed": 1234, "engine": "fake",
                        "params": {"seed": 5}, "created_at": body["created_at"]}
        status, listed = await asyncio.to_thread(call, base + "/v1/voices")
        assert status == 200
        assert [v["name"] for v in listed["voices"]] == [*BUILTIN_VOICES, "myname"]
        status, one = await asyncio.to_thread(call, base + "/v1/voices/myname")
        assert status == 200 and one == body
        status, oa = await asyncio.to_thread(call, base + "/v1/audio/voices")
        names = [v["id"] for v in oa["voices"]]
        assert "alloy" in names and "calm" in names and "myname" in names

        # the native protocol: the name is the seed voice plus its default seed
        named = await native_audio(url, "myname")
        assert named and named == await native_audio(url, "seed:1234", seed=5)
        assert named != await native_audio(url, "seed:1234")
        assert await native_audio(url, "myname", seed=6) == await native_audio(
            url, "seed:1234", seed=6)  # the request's own seed wins
        # /v1/tts
        tts = base + "/v1/tts?text=Hello%20there.&format=pcm16"
        s1, a1 = await asyncio.to_thread(call, tts + "&voice=myname")
        s2, a2 = await asyncio.to_thread(call, tts + "&voice=seed:1234&seed=5")
        s3, a3 = await asyncio.to_thread(call, tts + "&voice=calm&seed=5")
        assert s1 == s2 == s3 == 200 and a1 == a2 and a1 != a3
        # OpenAI speech takes the name too
        speech = {"model": "tts-1", "input": "Hello there.", "response_format": "pcm"}
        s1, a1 = await asyncio.to_thread(call, base + "/v1/audio/speech", "POST",
                                         {**speech, "voice": "myname"})
        s2, a2 = await asyncio.to_thread(call, base + "/v1/audio/speech", "POST",
                                         {**speech, "voice": "alloy"})
        assert s1 == s2 == 200 and a1 and a1 != a2

        status, _ = await asyncio.to_thread(call, base + "/v1/voices/myname", "DELETE")
        assert status == 204
        assert not (tmp_path / "myname.json").exists()
        status, err = await asyncio.to_thread(call, base + "/v1/voices/myname", "DELETE")
        assert status == 404 and err["error"]["code"] == "voice_not_found"
        status, err = await asyncio.to_thread(call, base + "/v1/audio/speech", "POST",
                                              {**speech, "voice": "myname"})
        assert status == 400 and "unknown voice" in err["error"]["message"]


async def test_bad_inputs_get_4xx_with_a_body(tmp_path):
    async with server(base_config(voices_dir=tmp_path)) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        assert (await asyncio.to_thread(call, base + "/v1/voices", "POST",
                                        {"name": "taken", "seed": 1}))[0] == 201
        cases: list[tuple[str, str, Any, bytes | None, int, str | None, str]] = [
            ("/v1/voices", "POST", None, b"{nope", 400, None, "invalid_json"),
            ("/v1/voices", "POST", {"name": "Bad Name", "seed": 1}, None, 400, "name",
             "invalid_value"),
            ("/v1/voices", "POST", {"name": "x"}, None, 400, "speaker", "invalid_value"),
            ("/v1/voices", "POST", {"name": "x", "speaker": "garbage"}, None, 400, "speaker",
             "invalid_value"),
            ("/v1/voices", "POST",
             {"name": "x", "speaker": speaker_string(np.array([np.nan] * 768))}, None, 400,
             "speaker", "invalid_value"),
            ("/v1/voices", "POST", {"name": "x", "seed": 1, "params": {"top_K": 1000}}, None,
             400, "params", "invalid_value"),
            ("/v1/voices", "POST", {"name": "taken", "seed": 2}, None, 409, "name",
             "voice_exists"),
            ("/v1/voices", "POST", {"name": "calm", "seed": 2}, None, 409, "name",
             "voice_exists"),
            ("/v1/voices", "POST", {"name": "alloy", "seed": 2}, None, 409, "name",
             "voice_exists"),
            ("/v1/voices/calm", "DELETE", None, None, 403, "name", "builtin_voice"),
            ("/v1/voices/alloy", "DELETE", None, None, 403, "name", "builtin_voice"),
            ("/v1/voices/nobody", "DELETE", None, None, 404, "name", "voice_not_found"),
            ("/v1/voices/nobody", "GET", None, None, 404, "name", "voice_not_found"),
            ("/v1/voices", "PUT", None, None, 405, None, "method_not_allowed"),
        ]
        for path, method, body, raw, want, param, code in cases:
            status, err = await asyncio.to_thread(call, base + path, method, body, raw)
            assert status == want, (path, method, body, err)
            assert err["error"]["code"] == code and err["error"]["param"] == param, err
            assert err["error"]["message"]
        assert sorted(os.listdir(tmp_path)) == ["taken.json"]


async def test_voice_routes_need_a_key_when_keys_are_set(tmp_path):
    key = "k" * 32
    cfg = base_config(voices_dir=tmp_path, auth=replace(AuthConfig(), api_keys=(key,)))
    async with server(cfg) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        for method, path, body in (("GET", "/v1/voices", None),
                                   ("POST", "/v1/voices", {"name": "x", "seed": 1}),
                                   ("DELETE", "/v1/voices/x", None)):
            status, err = await asyncio.to_thread(call, base + path, method, body)
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {key}"}
        status, _ = await asyncio.to_thread(call, base + "/v1/voices", "POST",
                                            {"name": "x", "seed": 1}, None, auth)
        assert status == 201
        status, _ = await asyncio.to_thread(call, base + "/v1/voices/x", "DELETE", None,
                                            None, auth)
        assert status == 204


async def test_two_instances_share_one_directory(tmp_path):
    """A voice created on A resolves on B at once, to the same audio, on every protocol."""
    async with server(base_config(voices_dir=tmp_path)) as (a, url_a), \
            server(base_config(voices_dir=tmp_path)) as (b, url_b):
        base_a = f"http://127.0.0.1:{bound_port(a)}"
        base_b = f"http://127.0.0.1:{bound_port(b)}"
        status, _ = await asyncio.to_thread(
            call, base_a + "/v1/voices", "POST",
            {"name": "shared", "speaker": GOOD_SPEAKER, "params": {"seed": 9, "speed": 3}})
        assert status == 201
        status, listed = await asyncio.to_thread(call, base_b + "/v1/voices")
        assert "shared" in [v["name"] for v in listed["voices"]]
        assert b.voices.apply(SynthParams(voice="shared")) == a.voices.apply(
            SynthParams(voice="shared")) == SynthParams(voice=GOOD_SPEAKER, seed=9, speed=3)
        tts = "/v1/tts?text=Hello%20there.%20Twice.&format=pcm16&voice=shared"
        sa, audio_a = await asyncio.to_thread(call, base_a + tts)
        sb, audio_b = await asyncio.to_thread(call, base_b + tts)
        assert sa == sb == 200 and audio_a and audio_a == audio_b
        assert await native_audio(url_a, "shared") == await native_audio(url_b, "shared")
        status, _ = await asyncio.to_thread(call, base_b + "/v1/voices/shared", "DELETE")
        assert status == 204
        status, one = await asyncio.to_thread(call, base_a + "/v1/voices/shared")
        assert status == 404


# -- the real ChatTTS engine: identical speaker and audio on two instances ------------------


@pytest.mark.chattts
def test_chattts_two_instances_identical_speaker_and_audio(tiny_checkpoint: Path,
                                                           tmp_path: Path):
    pytest.importorskip("ChatTTS")
    import torch

    from rtts.config import EngineConfig
    from rtts.engines.base import SynthRequest
    from rtts.engines.chattts import ChatTTSEngine

    def engine() -> ChatTTSEngine:
        # one kernel path on both: the same arithmetic, so the same bytes
        eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint,
                                         threads=2, kernels="linear"))
        eng.load()
        return eng

    eng_a, eng_b = engine(), engine()
    store_a, store_b = VoiceStore(tmp_path), VoiceStore(tmp_path)

    def validate(eng: ChatTTSEngine) -> Any:
        return lambda speaker: eng.validate(SynthParams(voice=speaker))

    store_a.create({"name": "seeded", "seed": 4242, "params": {"seed": 7}},
                   validate=validate(eng_a))
    store_a.create({"name": "sampled", "speaker": eng_a.random_speaker(),
                    "params": {"seed": 7}}, validate=validate(eng_a))
    # the engine rejects what its model cannot use, with the reason
    wrong_dim = speaker_string(np.ones(eng_a.chat.speaker.dim + 1))
    with pytest.raises(VoiceError, match="needs"):
        store_a.create({"name": "wrong", "speaker": wrong_dim}, validate=validate(eng_a))
    with pytest.raises(ValueError, match="non-finite"):
        eng_a.validate(SynthParams(voice=speaker_string(
            np.full(eng_a.chat.speaker.dim, np.nan))))

    for name in ("seeded", "sampled", "calm"):  # calm: a built-in; the seed from the request
        asked = SynthParams(voice=name, seed=7 if name == "calm" else None)
        pa, pb = store_a.apply(asked), store_b.apply(asked)
        assert pa.seed == 7
        assert pa == pb and pa.voice != name
        ta, tb = eng_a._voice_tensor(pa.voice), eng_b._voice_tensor(pb.voice)
        assert ta.shape == (eng_a.chat.speaker.dim,) and torch.isfinite(ta).all()
        assert torch.equal(ta, tb), name
        audio = []
        for eng, params in ((eng_a, pa), (eng_b, pb)):
            chunks = [c for _, c in eng.generate([SynthRequest("Hello there.", params,
                                                               max_new_token=24)])
                      if c is not None]
            audio.append(np.concatenate(chunks).tobytes())
        assert audio[0] and audio[0] == audio[1], name
    eng_a.close()
    eng_b.close()


def test_cli_flag_and_openapi(tmp_path, monkeypatch):
    from rtts.api.http.app import openapi_schema
    from rtts.cli.main import build_parser, config_from_args
    from rtts.core.service import Service
    from rtts.engines.fake import FakeEngine

    args = build_parser().parse_args(["serve", "--engine", "fake", "--voices-dir",
                                      str(tmp_path)])
    assert config_from_args(args).voices_dir == tmp_path
    monkeypatch.setenv("RTTS_VOICES_DIR", str(tmp_path / "env"))
    args = build_parser().parse_args(["serve", "--engine", "fake"])
    assert config_from_args(args).voices_dir == tmp_path / "env"
    paths = openapi_schema(Service(base_config(), FakeEngine()))["paths"]
    assert set(paths["/v1/voices"]) == {"get", "post"}
    assert set(paths["/v1/voices/{name}"]) == {"get", "delete", "parameters"}
