"""rtts's own REST endpoints (rtts.api.rest) and the HTTP app around them (rtts.api.http.app)."""

from __future__ import annotations

import asyncio
import io
import json
import urllib.error
import urllib.request

import av

from helpers import server
from rtts.server import bound_port


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


async def test_tts_streams_every_format():
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        url = base + "/v1/tts?text=Hello%20there.%20Another%20sentence.&sample_rate=16000"
        status, headers, body = await asyncio.to_thread(fetch, url + "&format=mulaw")
        assert status == 200 and headers["content-type"] == "audio/basic"
        assert headers["x-sample-rate"] == "8000"
        seconds = len(body) / 8000
        assert seconds > 1.0
        status, headers, body = await asyncio.to_thread(fetch, url)  # wav by default
        assert headers["content-type"] == "audio/wav" and headers["x-sample-rate"] == "16000"
        assert headers.get("transfer-encoding") == "chunked"  # streamed, no Content-Length
        for fmt, codec in (("opus", "opus"), ("flac", "flac"), ("webm", "opus")):
            status, headers, body = await asyncio.to_thread(fetch, f"{url}&format={fmt}")
            assert status == 200
            container = av.open(io.BytesIO(body))
            assert container.streams.audio[0].codec_context.name == codec
            decoded = sum(f.samples for f in container.decode(audio=0))
            assert abs(decoded / container.streams.audio[0].rate - seconds) < 0.1


async def test_rest_errors_are_openai_shaped():
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        cases = [
            ("/v1/tts?text=", 400, "text"),
            ("/v1/tts?text=Hi.&format=ogg-vorbis", 400, "format"),
            ("/v1/tts?text=Hi.&voice=seed:abc", 400, None),
            ("/v1/tts?text=" + "x" * 5001, 400, "text"),
            ("/v1/nope", 404, None),
        ]
        for path, want, param in cases:
            status, headers, body = await asyncio.to_thread(fetch, base + path)
            assert status == want, path
            err = json.loads(body)["error"]
            assert err["message"] and err["param"] == param, (path, err)
        status, _, body = await asyncio.to_thread(fetch, base + "/v1/audio/speech", "GET")
        assert status == 405 and json.loads(body)["error"]["message"]
        status, _, body = await asyncio.to_thread(fetch, base + "/nope")
        assert status == 404 and body == b"not found\n"  # outside /v1/: plain text


async def test_formats_openapi_and_info():
    async with server() as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        _, _, body = await asyncio.to_thread(fetch, base + "/v1/formats")
        formats = {f["id"]: f for f in json.loads(body)["formats"]}
        assert set(formats) == {"pcm16", "mulaw", "alaw", "wav", "mp3", "opus", "webm", "aac",
                                "flac"}
        assert formats["mulaw"]["sample_rate"] == 8000
        _, headers, body = await asyncio.to_thread(fetch, base + "/openapi.json")
        schema = json.loads(body)
        assert schema["openapi"].startswith("3.")
        assert "/v1/audio/speech" in schema["paths"] and "/v1/tts" in schema["paths"]
        speech = schema["components"]["schemas"]["SpeechRequest"]
        assert speech["required"] == ["model", "input", "voice"]
        _, headers, body = await asyncio.to_thread(fetch, base + "/v1/info")
        assert json.loads(body)["engine"] == "fake"
        assert headers["server"].startswith("rtts/")
