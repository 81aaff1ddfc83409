"""Scheduler logic with the fake engine (a documented test double; no model needed)."""

import asyncio

import numpy as np
import pytest

from rtts.core.params import SynthParams
from rtts.core.scheduler import RequestStream, Scheduler, SchedulerConfig
from rtts.engines.base import SynthRequest
from rtts.engines.fake import FakeEngine
from rtts.errors import EngineError, EngineTimeout, Overloaded


async def collect(stream):
    return np.concatenate([c async for c in stream] or [np.zeros(0, np.float32)])


async def started(engine, **cfg):
    sched = Scheduler(engine, SchedulerConfig(**cfg))
    await sched.start()
    return sched


async def test_concurrent_requests_share_a_batch():
    engine = FakeEngine(ms_per_char=10)
    sched = await started(engine, max_batch_size=4, max_wait_ms=50)
    streams = [sched.submit(SynthRequest(f"text number {i}", SynthParams())) for i in range(4)]
    audio = await asyncio.gather(*(collect(s) for s in streams))
    assert engine.batches == [4]
    assert [len(a) for a in audio] == [engine.total_samples(f"text number {i}")
                                       for i in range(4)]
    await sched.stop()


async def test_batch_size_limit_and_first_segments_first():
    engine = FakeEngine(ms_per_char=5)
    sched = await started(engine, max_batch_size=2, max_wait_ms=30)
    later = [sched.submit(SynthRequest(f"later {i}", SynthParams(), priority=1))
             for i in range(3)]
    first = sched.submit(SynthRequest("first", SynthParams(), priority=0))
    order = []

    async def run(name, s):
        await collect(s)
        order.append(name)

    await asyncio.gather(run("first", first), *(run(f"l{i}", s) for i, s in enumerate(later)))
    assert engine.batches == [2, 2]
    assert order.index("first") < order.index("l2")  # priority 0 rode in the first batch
    await sched.stop()


async def test_incompatible_params_do_not_batch():
    class KeyedFake(FakeEngine):
        def batch_key(self, params):
            return params.temperature

    engine = KeyedFake(ms_per_char=5)
    sched = await started(engine, max_batch_size=4, max_wait_ms=30)
    a = sched.submit(SynthRequest("aaa", SynthParams(temperature=0.3)))
    b = sched.submit(SynthRequest("bbb", SynthParams(temperature=0.9)))
    await asyncio.gather(collect(a), collect(b))
    assert sorted(engine.batches) == [1, 1]
    await sched.stop()


async def test_cancel_one_row_leaves_the_other():
    engine = FakeEngine(ms_per_char=50, rtf=1.0)  # 100 ms chunks at real time
    sched = await started(engine, max_batch_size=2, max_wait_ms=30)
    a = sched.submit(SynthRequest("a" * 40, SynthParams()))  # 2 s
    b = sched.submit(SynthRequest("b" * 10, SynthParams()))  # 0.5 s
    first = await a.__anext__()
    assert first.size
    a.cancel()
    audio_b = await collect(b)
    assert len(audio_b) == engine.total_samples("b" * 10)
    assert await collect(a) is not None  # ends without error
    await sched.stop()


async def test_cancelling_every_row_stops_generation():
    engine = FakeEngine(ms_per_char=100, rtf=1.0)
    sched = await started(engine, max_batch_size=1)
    s = sched.submit(SynthRequest("x" * 100, SynthParams()))  # 10 s of audio
    await s.__anext__()
    s.cancel()
    await asyncio.sleep(0.3)
    assert sched.running_batches == 0  # the thread let go well before 10 s
    assert sched.cancelled == 1
    await sched.stop()


async def test_engine_exception_fails_only_its_batch():
    engine = FakeEngine(ms_per_char=5)
    sched = await started(engine, max_batch_size=1)
    bad = sched.submit(SynthRequest("please [fail]", SynthParams()))
    good = sched.submit(SynthRequest("fine", SynthParams()))
    with pytest.raises(EngineError, match="failed"):
        await collect(bad)
    assert len(await collect(good)) == engine.total_samples("fine")
    await sched.stop()


async def test_hang_hits_the_timeout_and_frees_the_slot():
    engine = FakeEngine(ms_per_char=5)
    sched = await started(engine, max_batch_size=1, request_timeout_s=0.3)
    hung = sched.submit(SynthRequest("[hang]", SynthParams()))
    with pytest.raises(EngineTimeout):
        await collect(hung)
    after = sched.submit(SynthRequest("next", SynthParams()))
    assert len(await asyncio.wait_for(collect(after), 5)) > 0
    await sched.stop()


async def test_full_queue_rejects():
    engine = FakeEngine(ms_per_char=100, rtf=1.0)
    sched = await started(engine, max_batch_size=1, max_queue=2)
    running = sched.submit(SynthRequest("x" * 50, SynthParams()))
    await running.__anext__()  # now running, not queued
    sched.submit(SynthRequest("q1", SynthParams()))
    sched.submit(SynthRequest("q2", SynthParams()))
    with pytest.raises(Overloaded):
        sched.submit(SynthRequest("q3", SynthParams()))
    await sched.stop()


async def test_stop_fails_queued_requests():
    engine = FakeEngine(ms_per_char=100, rtf=1.0)
    sched = await started(engine, max_batch_size=1)
    running = sched.submit(SynthRequest("x" * 50, SynthParams()))
    queued = sched.submit(SynthRequest("y", SynthParams()))
    await running.__anext__()
    await sched.stop()
    with pytest.raises(EngineError):
        await collect(queued)


# -- continuous batching (FakeEngine(continuous=True) serves like the ChatTTS engine) ----


async def first_chunk_after(stream, since):
    await stream.__anext__()
    return asyncio.get_running_loop().time() - since


async def test_continuous_a_request_arriving_mid_batch_joins_at_the_next_step():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)  # 100 ms ticks, real time
    sched = await started(engine, max_batch_size=4, max_wait_ms=10)
    a = sched.submit(SynthRequest("a" * 40, SynthParams()))  # 2 s of audio
    await a.__anext__()
    await asyncio.sleep(0.25)  # a's batch is running
    loop = asyncio.get_running_loop()
    b = sched.submit(SynthRequest("b" * 10, SynthParams()))
    wait_b = await first_chunk_after(b, loop.time())
    assert wait_b < 0.5  # one tick, not the 1.75 s left of a's batch
    assert not a.finished
    audio_b = await collect(b)
    assert len(audio_b) + 2400 == engine.total_samples("b" * 10)  # first chunk taken above
    await collect(a)
    assert engine.batches == [1, 2] and sched.joined == 1 and sched.completed == 2
    for _ in range(100):  # the batch ends once its thread has returned
        if sched.running_batches == 0:
            break
        await asyncio.sleep(0.01)
    assert sched.running_batches == 0
    await sched.stop()


async def test_continuous_cancel_frees_the_slot_for_a_waiting_request():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = await started(engine, max_batch_size=1, max_wait_ms=10)  # one slot
    a = sched.submit(SynthRequest("a" * 60, SynthParams()))  # 3 s
    await a.__anext__()
    b = sched.submit(SynthRequest("b" * 10, SynthParams()))
    await asyncio.sleep(0.3)
    assert b.first_audio_at is None and sched.queue_depth == 1  # no free slot
    loop = asyncio.get_running_loop()
    a.cancel()
    assert await first_chunk_after(b, loop.time()) < 0.35  # took a's slot at the next step
    await collect(b)
    assert engine.batches == [1, 1] and sched.cancelled == 1
    await sched.stop()


async def test_continuous_mixed_params_share_one_batch():
    engine = FakeEngine(ms_per_char=20, continuous=True)
    sched = await started(engine, max_batch_size=4, max_wait_ms=30)
    params = [SynthParams(temperature=0.3, seed=1), SynthParams(temperature=0.9, top_K=5),
              SynthParams(top_P=0.2, seed=9)]
    streams = [sched.submit(SynthRequest(f"text {i}", p)) for i, p in enumerate(params)]
    await asyncio.gather(*(collect(s) for s in streams))
    assert engine.batches == [3]
    await sched.stop()


async def test_continuous_engine_failure_retries_rows_without_audio_alone():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = await started(engine, max_batch_size=4, max_wait_ms=10)
    good = sched.submit(SynthRequest("a" * 20, SynthParams()))
    await good.__anext__()
    bad = sched.submit(SynthRequest("[fail] here", SynthParams()))
    with pytest.raises(EngineError):
        await collect(bad)
    with pytest.raises(EngineError):  # it had audio when its batch broke
        await collect(good)
    after = sched.submit(SynthRequest("fine", SynthParams()))
    assert len(await collect(after)) == engine.total_samples("fine")
    await sched.stop()


async def test_continuous_timeout_counts_per_request_and_spares_the_others():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = await started(engine, max_batch_size=4, max_wait_ms=10, request_timeout_s=0.5)
    hang = sched.submit(SynthRequest("[hang]", SynthParams()))
    ok = sched.submit(SynthRequest("b" * 6, SynthParams()))  # 0.3 s of audio
    with pytest.raises(EngineTimeout):
        await collect(hang)
    assert len(await collect(ok)) == engine.total_samples("b" * 6)
    await sched.stop()


async def test_continuous_degraded_shrinks_the_slot_count():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = await started(engine, max_batch_size=4, max_wait_ms=10, degraded_slots=1)
    sched.degraded = True
    a = sched.submit(SynthRequest("a" * 10, SynthParams()))
    await a.__anext__()
    b = sched.submit(SynthRequest("b" * 10, SynthParams()))
    await asyncio.sleep(0.25)
    assert b.first_audio_at is None  # one slot while degraded
    await asyncio.gather(collect(a), collect(b))
    assert engine.batches == [1, 1]
    await sched.stop()


async def test_continuous_stop_fails_running_and_queued():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = await started(engine, max_batch_size=1, max_wait_ms=10)
    a = sched.submit(SynthRequest("a" * 100, SynthParams()))
    await a.__anext__()
    b = sched.submit(SynthRequest("b" * 10, SynthParams()))
    await sched.stop()
    for s in (a, b):
        with pytest.raises(EngineError):
            await collect(s)


async def test_continuous_later_segments_leave_a_slot_for_first_segments():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = await started(engine, max_batch_size=4, max_wait_ms=10)  # reserve: 1 slot
    assert sched.reserve == 1
    later = [sched.submit(SynthRequest("l" * 20, SynthParams(), priority=1)) for _ in range(4)]
    await asyncio.sleep(0.3)
    assert [s.first_audio_at is not None for s in later] == [True, True, True, False]
    loop = asyncio.get_running_loop()
    first = sched.submit(SynthRequest("f" * 10, SynthParams(), priority=0))
    assert await first_chunk_after(first, loop.time()) < 0.35  # the reserved slot
    await asyncio.gather(*(collect(s) for s in [first, *later]))
    await sched.stop()


async def test_continuous_later_segment_waits_until_the_first_segment_has_audio():
    """A lookahead segment's prefill would delay a first segment's first audio: it joins
    once that first audio exists."""
    engine = FakeEngine(ms_per_char=50, rtf=1.0, first_chunk_latency_ms=300, continuous=True)
    sched = await started(engine, max_batch_size=8, max_wait_ms=10)
    first = sched.submit(SynthRequest("f" * 10, SynthParams(), priority=0))
    later = sched.submit(SynthRequest("l" * 10, SynthParams(), priority=1))
    await asyncio.gather(collect(first), collect(later))
    assert engine.batches == [1, 2]  # the later one joined, after the first's audio
    assert later.admitted_at is not None and first.first_audio_at is not None
    assert later.admitted_at >= first.first_audio_at
    await sched.stop()


async def test_continuous_later_segment_does_not_wait_for_another_later_segment():
    """The hold protects the first audio of a stream's first segment only: a later segment
    (the next sentence of a stream already playing) joins while another stream's later
    segment is still before its first audio; waiting would be a gap in both streams."""
    sched = Scheduler(FakeEngine(continuous=True), SchedulerConfig(max_batch_size=8))

    def submit(priority, stream):  # queued as submit() queues, without a dispatcher
        s = RequestStream(SynthRequest("x" * 10, SynthParams(), priority=priority,
                                       stream=stream))
        sched._queue.append(s)
        return s

    one = submit(1, 1)
    assert sched._pick(8) == [one] and one.first_audio_at is None
    two = submit(1, 2)
    assert sched._pick(7, warming=True, running=[one]) == [two]  # joins at once
    first = submit(0, 3)
    assert sched._pick(6, warming=True, running=[one, two]) == [first]
    three = submit(1, 4)  # a first segment without audio runs: this one waits
    assert sched._pick(5, warming=True, running=[one, two, first]) == []
    first.first_audio_at = one.first_audio_at = 1.0
    assert sched._pick(5, warming=True, running=[one, two, first]) == [three]


async def test_continuous_engine_failing_before_its_first_step_fails_the_batch():
    class Broken(FakeEngine):
        def serve(self, admit, slots):
            raise RuntimeError("device lost")
            yield  # a generator, like the real engines

    sched = await started(Broken(continuous=True), max_batch_size=4, max_wait_ms=10)
    stream = sched.submit(SynthRequest("hello", SynthParams()))
    with pytest.raises(EngineError):
        await asyncio.wait_for(collect(stream), 5)  # an error, not a hang
    await sched.stop()


def test_pick_survives_the_loop_changing_playing_streams_meanwhile():
    """The engine's thread picks the rows of a continuous batch while the event loop adds
    and ends playing streams. A garbage collection during the pick runs Python code (here
    a gc callback that ends a stream, as the loop's thread would once it takes over
    there): the pick must not fail with "dictionary changed size during iteration" (the
    mixed-abuse run did, and the batch's rows failed)."""
    import gc

    sched = Scheduler(FakeEngine(continuous=True), SchedulerConfig(max_batch_size=8))
    # (more than the 2,000 two-tuples CPython keeps for reuse, whose reuse starts no GC)
    sched._playing.update({k: 0.0 for k in range(5000)})  # long ago: the pick drops them
    ended = []

    def loop_thread_meanwhile(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and sched._playing:
            ended.append(next(iter(sched._playing)))
            sched.stream_ended(ended[-1])

    s = RequestStream(SynthRequest("x" * 10, SynthParams(), priority=1, stream=99))
    sched._queue.append(s)
    threshold = gc.get_threshold()
    gc.callbacks.append(loop_thread_meanwhile)
    gc.set_threshold(1)  # a collection at every tracked allocation
    try:
        assert sched._pick(8) == [s]
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(loop_thread_meanwhile)
    assert ended and not sched._playing  # the loop's changes happened mid-pick


async def test_continuous_lookahead_waits_where_one_more_row_lowers_throughput():
    """With no real-time capacity measured (0: nothing keeps up, so no cap), a stream's
    next segment still does not join beside its own running row where the step times the
    engine measured say one more row lowers the batch's tokens per second (ChatTTS int4
    on 2 cores: 4 rows 21 ms, 5 rows 35 ms); where it raises it (a GPU, or 1 -> 2 rows on
    that CPU) the lookahead joins."""
    for step_ms, want_joined in (({2: 20.0, 3: 40.0}, False), ({2: 20.0, 3: 22.0}, True),
                                 ({2: 20.0}, True)):
        engine = FakeEngine(ms_per_char=20, rtf=1.0, continuous=True)
        sched = await started(engine, max_batch_size=8, max_wait_ms=10, later_hold_s=0)
        sched.step_ms = dict(step_ms)
        heard = [sched.submit(SynthRequest("h" * 40, SynthParams(), priority=0, stream=s))
                 for s in (1, 2)]
        await asyncio.sleep(0.2)
        ahead = sched.submit(SynthRequest("a" * 5, SynthParams(), priority=1, stream=1))
        await asyncio.sleep(0.2)
        assert (ahead.admitted_at is not None) == want_joined, step_ms
        await asyncio.gather(*(collect(s) for s in [*heard, ahead]))
        assert ahead.admitted_at is not None  # it ran once its stream's row had ended
        assert max(engine.batches) == (3 if want_joined else 2), (step_ms, engine.batches)
        await sched.stop()


def test_lookahead_costs_compares_tokens_per_second():
    sched = Scheduler(FakeEngine(), SchedulerConfig())
    sched.step_ms = {1: 11.8, 2: 15.0, 4: 21.1, 5: 34.8, 8: 31.8}
    assert not sched.lookahead_costs(1)  # 2 rows in 15 ms beat 1 in 11.8
    assert sched.lookahead_costs(4)  # 5 rows in 34.8 ms are fewer per ms than 4 in 21.1
    assert not sched.lookahead_costs(2)  # 3 rows unmeasured: the row joins, and is measured
    assert not sched.lookahead_costs(8)
    # a count not run yet: the step at ``rows`` plus what the linears timed at load add
    sched.step_ms = {4: 21.1}
    sched.linear_ms = {4: 12.4, 5: 23.5, 8: 24.0}
    assert sched.lookahead_costs(4)  # about 32 ms for 5 rows
    sched.linear_ms = {4: 12.4, 5: 12.9}
    assert not sched.lookahead_costs(4)  # about 21.6 ms: more tokens per ms


async def test_continuous_lookahead_stays_within_the_measured_realtime_capacity():
    """Once the engine has measured how many rows stay real time, a stream's next segment
    does not join beside its own running row when the batch already holds that many rows
    (each extra row would slow the segments being heard); a stream with no row running
    still joins at once, and without a measured capacity lookahead joins as before. With
    more streams playing than the capacity (they cannot all keep up), lookahead joins:
    holding it only opened a gap before each next segment."""
    for cap, want_joined in ((2, False), (None, True), (1, True)):
        engine = FakeEngine(ms_per_char=20, rtf=1.0, continuous=True)
        sched = await started(engine, max_batch_size=8, max_wait_ms=10, later_hold_s=0)
        sched.realtime_slots = cap
        heard = [sched.submit(SynthRequest("h" * 40, SynthParams(), priority=0, stream=s))
                 for s in (1, 2)]
        await asyncio.sleep(0.2)  # both play; now their next segments arrive
        ahead = [sched.submit(SynthRequest("a" * 5, SynthParams(), priority=1, stream=s))
                 for s in (1, 2)]
        other = sched.submit(SynthRequest("o" * 5, SynthParams(), priority=1, stream=3))
        await asyncio.sleep(0.2)
        joined = [s.admitted_at is not None for s in ahead]
        assert joined == [want_joined, want_joined], cap
        assert other.admitted_at is not None  # stream 3 has no row: it joins either way
        await asyncio.gather(*(collect(s) for s in [*heard, *ahead, other]))
        # capped: the two next segments ran only once their streams' rows had ended
        assert max(engine.batches) == (5 if want_joined else 3), engine.batches
        assert all(s.admitted_at is not None for s in ahead)
        await sched.stop()


def test_the_served_fake_batches_as_chattts_does():
    """``rtts serve --engine fake`` batches continuously, as ChatTTS does (in fixed batches,
    a new stream's first segment waited behind a whole batch of long segments: 925 ms under
    the abuse mix's long texts); ``--batching static`` still gives fixed batches."""
    from rtts.config import EngineConfig
    from rtts.engines import build_engine

    engine = build_engine(EngineConfig(name="fake"))
    assert Scheduler(engine, SchedulerConfig()).continuous
    assert not Scheduler(engine, SchedulerConfig(batching="static")).continuous
