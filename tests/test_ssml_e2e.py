"""SSML end to end (issue 29): over real sockets and HTTP, with the fake engine recording
the segments it is asked to say: the native socket (``"ssml": true``), ElevenLabs'
``enable_ssml_parsing=true`` on stream-input (raw socket, as ElevenLabs documents it, and
pipecat's own ``ElevenLabsTTSService``), ElevenLabs HTTP through the real ``elevenlabs``
SDK, and ``/v1/tts?ssml=true``. Bad and hostile SSML gets each protocol's own error."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from elevenlabs.client import AsyncElevenLabs
from elevenlabs.core.api_error import ApiError as ElevenApiError
from test_ssml import BILLION_LAUGHS, EXTERNAL_ENTITY
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from helpers import client, server
from rtts.engines.base import SynthRequest
from rtts.engines.fake import FakeEngine
from rtts.server import bound_port
from rtts.text.ssml import speed_for

# pieces split inside a tag, inside an element and inside an entity reference
PIECES = ['<speak>Hello <prosody rate="x-slow">slow', " words</prosody> and <bre",
          'ak time="1s"/> the code <say-as interpret-as="digi', 'ts">42</say-as> &am',
          "p; done.</speak>"]


class Recording(FakeEngine):
    """The fake engine, noting the text and speed of every request it is given."""

    def __init__(self) -> None:
        super().__init__(ms_per_char=5)
        self.heard: list[tuple[str, int]] = []

    def serve(self, admit: Callable[[int], Sequence[SynthRequest]], slots: int) -> Any:
        def noted(free: int) -> Sequence[SynthRequest]:
            new = admit(free)
            self.heard += [(r.text, r.params.speed) for r in new]
            return new
        return super().serve(noted, slots)


def check_heard(heard: list[tuple[str, int]], base: int = 5) -> None:
    said = " ".join(text for text, _ in heard)
    assert "<" not in said and "&" not in said, said  # no markup reaches the engine
    assert "[lbreak]" in said and "four two" in said, said
    slow = [(t, s) for t, s in heard if "slow" in t]
    assert slow and all(s == speed_for(0.5, base) for _, s in slow), heard  # x-slow
    assert all(s == base for t, s in heard if "slow" not in t), heard
    assert all("slow" not in t or "Hello" not in t for t, _ in heard)  # cut at the change


# -- native ------------------------------------------------------------------------------


async def test_native_ssml_in_pieces_reaches_the_engine_as_tags_and_speeds():
    engine = Recording()
    async with server(engine=engine) as (_, url), client(url) as c:
        await c.send(type="start", context_id="a", ssml=True, speed=5)
        for piece in PIECES:
            await c.send(type="text", context_id="a", text=piece)
        await c.send(type="end", context_id="a")
        await c.until("done", "a")
        assert not c.of_kind("error")
        done = c.got.of("segment_done", "a")
        text = "".join(e["text"] for e in done)
        assert "[lbreak]" in text and "<" not in text
    check_heard(engine.heard)


async def test_native_bad_and_hostile_ssml_close_the_context_with_an_error_event():
    async with server() as (_, url), client(url) as c:
        for cid, doc in [("a", "<speak><p>never closed</speak>"), ("b", BILLION_LAUGHS),
                         ("c", EXTERNAL_ENTITY),
                         ("d", '<speak><break time="soon"/></speak>')]:
            await c.send(type="start", context_id=cid, ssml=True)
            await c.send(type="text", context_id=cid, text=doc)
            await c.send(type="end", context_id=cid)
            err = await c.until("error", cid)
            assert err["code"] == "invalid_ssml" and err["context_closed"] is True, err
            assert "invalid SSML" in err["message"] and "root:" not in err["message"]
        # the connection goes on, and the id can be started again
        await c.send(type="start", context_id="a", ssml=True)
        await c.send(type="text", context_id="a", text="<speak>Fine.</speak>")
        await c.send(type="end", context_id="a")
        assert (await c.until("done", "a"))["segments"] == 1
        await c.send(type="start", context_id="e", ssml="yes")
        assert (await c.until("error", "e"))["code"] == "invalid_params"
        # one SSML message is bounded (it is read on the event loop): send more messages
        await c.send(type="start", context_id="f", ssml=True)
        await c.send(type="text", context_id="f", text="<speak>" + "a " * 2500)
        assert (await c.until("error", "f"))["code"] == "text_too_long"
        for text in ["<speak>", "Fine <break/> words. ", "More words."]:
            await c.send(type="text", context_id="f", text=text)
        await c.send(type="text", context_id="f", text="</speak>")
        await c.send(type="end", context_id="f")
        assert (await c.until("done", "f"))["segments"] > 1


# -- ElevenLabs --------------------------------------------------------------------------


async def _eleven_socket(port: int, texts: list[str], query: str = "enable_ssml_parsing=true"
                         ) -> tuple[list[dict[str, Any]], int | None]:
    url = (f"ws://127.0.0.1:{port}/v1/text-to-speech/alloy/stream-input"
           f"?output_format=pcm_24000&{query}")
    got: list[dict[str, Any]] = []
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "voice_settings": {"speed": 1.0}}))
        for text in texts:
            await ws.send(json.dumps({"text": text}))
        await ws.send(json.dumps({"text": ""}))
        with pytest.raises(ConnectionClosed):
            async with asyncio.timeout(10):
                while True:
                    got.append(json.loads(await ws.recv()))
        return got, ws.close_code


async def test_elevenlabs_socket_ssml_in_pieces_reaches_the_engine_as_tags_and_speeds():
    engine = Recording()
    async with server(engine=engine) as (app, _):
        got, code = await _eleven_socket(bound_port(app), PIECES)
    assert code == 1000 and got[-1]["isFinal"] is True
    assert any(m.get("audio") for m in got)
    chars = "".join("".join(m["alignment"]["chars"]) for m in got if m.get("alignment"))
    assert "[lbreak]" in chars and "<" not in chars  # alignments cover what it reads out
    check_heard(engine.heard)


async def test_long_ssml_is_read_off_the_event_loop_with_the_same_result():
    body = 'word <break time="200ms"/> ' * 170  # 4,590 characters: read in a worker thread
    engine = Recording()
    async with server(engine=engine) as (app, _):
        got, code = await _eleven_socket(bound_port(app), ["<speak>" + body + "</speak>"])
        assert code == 1000 and got[-1]["isFinal"] is True
        chars = "".join("".join(m["alignment"]["chars"]) for m in got if m.get("alignment"))
        assert chars.count("[uv_break]") == 170 and "<" not in chars
        base = f"http://127.0.0.1:{bound_port(app)}/v1/tts?format=pcm16&ssml=true&text="
        status, _ = await asyncio.to_thread(_get, base + urllib.parse.quote(
            "<speak>" + body + "</speak>"))
        assert status == 200
        status, _ = await asyncio.to_thread(_get, base + urllib.parse.quote("<speak>" + body))
        assert status == 400  # the error, from the worker thread
    said = " ".join(t for t, _ in engine.heard)  # (repeated segments come from the cache)
    assert "word [uv_break] word" in said and "<" not in said


async def test_elevenlabs_socket_without_the_flag_reads_markup_as_text():
    engine = Recording()
    async with server(engine=engine) as (app, _):
        await _eleven_socket(bound_port(app), ['Hi <break time="1s"/> there.'], query="")
    assert "[lbreak]" not in " ".join(t for t, _ in engine.heard)


@pytest.mark.parametrize("doc", ["<speak><p>unclosed</speak>", BILLION_LAUGHS,
                                 EXTERNAL_ENTITY, "<p>" * 40])
async def test_elevenlabs_socket_bad_ssml_gets_an_error_message_and_1008(doc):
    async with server() as (app, _):
        got, code = await _eleven_socket(bound_port(app), [doc])
    assert code == 1008
    assert got[-1]["error"] == "invalid_ssml" and "invalid SSML" in got[-1]["message"], got


def _pipecat_ssml(port: int, text: str) -> int:
    """pipecat's ElevenLabsTTSService with enable_ssml_parsing, in its own event loop."""
    from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    audio = [0]

    class Sink(FrameProcessor):
        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                audio[0] += len(frame.audio)
            await self.push_frame(frame, direction)

    async def main() -> None:
        tts = ElevenLabsTTSService(api_key="k", settings=ElevenLabsTTSService.Settings(
                                       voice="21m00Tcm4TlvDq8ikWAM"),
                                   url=f"ws://127.0.0.1:{port}", sample_rate=24000,
                                   enable_ssml_parsing=True)
        task = PipelineTask(Pipeline([tts, Sink()]),
                            params=PipelineParams(audio_out_sample_rate=24000))
        await task.queue_frame(TTSSpeakFrame(text))
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(PipelineRunner(handle_sigint=False).run(task), 30)

    asyncio.run(main())
    return audio[0]


async def test_pipecat_elevenlabs_service_with_enable_ssml_parsing():
    engine = Recording()
    async with server(engine=engine) as (app, _):
        result: list[int] = []
        text = ('Hello <prosody rate="x-slow">slow words</prosody> and <break time="1s"/> '
                'the code <say-as interpret-as="digits">42</say-as>.')
        thread = threading.Thread(target=lambda: result.append(
            _pipecat_ssml(bound_port(app), text)))
        thread.start()
        await asyncio.to_thread(thread.join, 40)
        assert not thread.is_alive() and result and result[0] > 0
    check_heard(engine.heard)


async def test_elevenlabs_http_ssml_through_the_sdk():
    engine = Recording()
    async with server(engine=engine) as (app, _):
        sdk = AsyncElevenLabs(api_key="k", base_url=f"http://127.0.0.1:{bound_port(app)}")
        ssml = {"additional_query_parameters": {"enable_ssml_parsing": "true"}}
        pcm = b"".join([c async for c in sdk.text_to_speech.stream(
            "alloy", text="".join(PIECES), output_format="pcm_24000", request_options=ssml)])
        assert pcm
        check_heard(engine.heard)
        chunks = [c async for c in sdk.text_to_speech.stream_with_timestamps(
            "alloy", text="".join(PIECES), output_format="pcm_24000", request_options=ssml)]
        chars = "".join("".join(c.alignment.characters) for c in chunks if c.alignment)
        assert "[lbreak]" in chars and "<" not in chars
        for doc in (BILLION_LAUGHS, "<speak>a & b</speak>"):
            with pytest.raises(ElevenApiError) as caught:
                async for _ in sdk.text_to_speech.stream("alloy", text=doc,
                                                         request_options=ssml):
                    pass
            assert caught.value.status_code == 400
            assert "invalid SSML" in json.dumps(caught.value.body)


# -- /v1/tts -----------------------------------------------------------------------------


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def test_rest_tts_ssml_and_its_400s():
    engine = Recording()
    async with server(engine=engine) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}/v1/tts?format=pcm16&ssml=true&text="
        status, body = await asyncio.to_thread(_get, base + urllib.parse.quote("".join(PIECES)))
        assert status == 200 and body
        check_heard(engine.heard)
        for doc in (BILLION_LAUGHS, EXTERNAL_ENTITY, "<speak><sub>x</sub></speak>"):
            status, body = await asyncio.to_thread(_get, base + urllib.parse.quote(doc))
            error = json.loads(body)["error"]
            assert status == 400 and error["code"] == "invalid_ssml", body
            assert error["message"].startswith("invalid SSML")
        status, _ = await asyncio.to_thread(_get, base.replace("ssml=true", "ssml=maybe") + "hi")
        assert status == 400


# -- OpenAI (rtts's own "ssml" field, sent by the SDK as extra_body) ---------------------


async def test_openai_sdk_speech_with_ssml_in_extra_body():
    import openai

    engine = Recording()
    async with server(engine=engine) as (app, _):
        sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(app)}/v1",
                                 api_key="k", max_retries=0)
        speech = await sdk.audio.speech.create(model="tts-1", voice="alloy",
                                               input="".join(PIECES), response_format="pcm",
                                               extra_body={"ssml": True})
        assert speech.content
        check_heard(engine.heard)
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.audio.speech.create(model="tts-1", voice="alloy", input=EXTERNAL_ENTITY,
                                          extra_body={"ssml": True})
        assert caught.value.code == "invalid_ssml" and "refused" in caught.value.message
