"""The synthesis core on its own (no sockets): SpeechContext events, lookahead, cache, cancel."""

from __future__ import annotations

import asyncio

import numpy as np

from helpers import base_config
from rtts.core.context import Audio, Done, SegmentDone, SegmentFailed, SegmentStarted
from rtts.core.params import SynthParams
from rtts.core.service import Service
from rtts.engines.fake import FakeEngine
from rtts.text.segmenter import Chunk


async def started_service(engine=None) -> Service:
    service = Service(base_config(), engine or FakeEngine())
    await service.load()
    return service


async def collect(ctx):
    return [event async for event in ctx.events()]


async def test_feed_end_gives_ordered_segments_with_audio_and_offsets():
    service = await started_service()
    try:
        ctx = service.open_context(SynthParams(voice="seed:3"))
        text = "Hello there. This is the core speaking, in order."
        for i in range(0, len(text), 4):
            ctx.feed(text[i:i + 4])
        ctx.end()
        events = await collect(ctx)
        assert isinstance(events[-1], Done) and ctx.finished
        started = [e for e in events if isinstance(e, SegmentStarted)]
        done = [e for e in events if isinstance(e, SegmentDone)]
        assert [e.index for e in started] == [e.index for e in done] == list(range(len(done)))
        assert len(done) >= 2
        assert "".join(e.text for e in started).replace(" ", "") == text.replace(" ", "")
        for s in started:
            assert text[s.start:s.end].strip() == s.text.strip()
        audio = [e for e in events if isinstance(e, Audio)]
        assert sum(len(a.samples) for a in audio) == events[-1].samples > 0
        # audio of a segment comes between its start and its done
        kinds = [type(e).__name__ for e in events]
        assert kinds[0] == "SegmentStarted" and kinds[1] == "Audio"
        assert service.stats.contexts_total == 1 and service.stats.cancels == 0
    finally:
        await service.stop_core()


async def test_second_identical_context_is_served_from_the_cache():
    service = await started_service()
    try:
        results = []
        for _ in range(2):
            ctx = service.open_context(SynthParams(voice="seed:1"))
            ctx.feed("Cache me if you can.")
            ctx.end()
            events = await collect(ctx)
            results.append(events)
        first = [e.cached for e in results[0] if isinstance(e, SegmentStarted)]
        second = [e.cached for e in results[1] if isinstance(e, SegmentStarted)]
        assert not any(first) and all(second)
        a = np.concatenate([e.samples for e in results[0] if isinstance(e, Audio)])
        b = np.concatenate([e.samples for e in results[1] if isinstance(e, Audio)])
        assert len(a) == len(b) and np.allclose(a, b, atol=1e-3)  # stored as PCM16
    finally:
        await service.stop_core()


async def test_failed_segment_is_reported_and_the_context_goes_on():
    service = await started_service()
    try:
        ctx = service.open_context(SynthParams(), use_cache=False)
        ctx.add_segment(Chunk("This [fail] one.", 0, 16))
        ctx.add_segment(Chunk("This one works.", 16, 31))
        ctx.end()
        events = await collect(ctx)
        failed = [e for e in events if isinstance(e, SegmentFailed)]
        assert [e.index for e in failed] == [0]
        assert failed[0].error.message.startswith("synthesis failed (incident ")
        assert [e.index for e in events if isinstance(e, SegmentDone)] == [1]
        assert events[-1].failed == 1
    finally:
        await service.stop_core()


async def test_cancel_and_leaving_early_free_the_scheduler():
    service = await started_service(FakeEngine(rtf=1.0))
    try:
        ctx = service.open_context(SynthParams(), use_cache=False)
        ctx.feed("A long one. " * 20)
        ctx.end()
        async for event in ctx.events():
            if isinstance(event, Audio):
                break  # the consumer leaves: the generator's cleanup cancels its requests
        ctx2 = service.open_context(SynthParams(), use_cache=False)
        ctx2.feed("Another long one. " * 20)
        ctx2.end()
        events = ctx2.events()
        await events.__anext__()
        ctx2.cancel()
        rest = [e async for e in events]
        assert not any(isinstance(e, Done) for e in rest)  # cancelled: ends without Done
        for _ in range(100):
            if service.scheduler.queue_depth == 0 and service.scheduler.running_batches == 0:
                break
            await asyncio.sleep(0.05)
        assert service.scheduler.queue_depth == 0 and service.scheduler.running_batches == 0
        assert service.stats.cancels == 1  # cancel() counts; an abandoned iterator does not
    finally:
        await service.stop_core()


async def test_segment_done_carries_estimated_char_timings() -> None:
    """Every SegmentDone has character timings of its written text spanning its audio."""
    service = await started_service()
    try:
        ctx = service.open_context(SynthParams())
        ctx.feed("Hello there, 42 friends. 你好，世界。")
        ctx.end()
        texts: dict[int, str] = {}
        dones: list[SegmentDone] = []
        async for event in ctx.events():
            if isinstance(event, SegmentStarted):
                texts[event.index] = event.text
            elif isinstance(event, SegmentDone):
                dones.append(event)
        assert dones
        for done in dones:
            assert done.timings.text == texts[done.index]
            assert done.timings.end_ms == round(done.samples * 1000 / service.engine.sample_rate)
    finally:
        await service.stop_core()
