"""Load governor: pure state machine, and the server degrading and recovering under load."""

import asyncio
from dataclasses import replace

import pytest
from websockets.exceptions import ConnectionClosed

from helpers import base_config, client, server
from rtts.core.governor import Governor, GovernorConfig, Level, LoadSignals
from rtts.core.scheduler import SchedulerConfig
from rtts.engines.fake import FakeEngine

CFG = GovernorConfig(degrade_queue_depth=10, reject_queue_depth=20, degrade_rss_mb=1000,
                     reject_rss_mb=2000, recover_ratio=0.5, hold_s=1.0)


def test_steps_up_at_once_and_down_with_hysteresis():
    g = Governor(CFG)
    assert g.update(LoadSignals(queue_depth=5), 0.0) == Level.NORMAL
    assert g.update(LoadSignals(queue_depth=10), 0.1) == Level.DEGRADED
    assert g.update(LoadSignals(queue_depth=25), 0.2) == Level.REJECTING
    # below the reject threshold but above 0.5 x it: stays rejecting
    assert g.update(LoadSignals(queue_depth=15), 5.0) == Level.REJECTING
    # calm (below 0.5 x 20) must last hold_s before stepping down one level
    assert g.update(LoadSignals(queue_depth=9), 6.0) == Level.REJECTING
    assert g.update(LoadSignals(queue_depth=9), 6.5) == Level.REJECTING
    assert g.update(LoadSignals(queue_depth=9), 7.0) == Level.DEGRADED
    # 9 is still above 0.5 x 10: no further recovery
    assert g.update(LoadSignals(queue_depth=9), 9.0) == Level.DEGRADED
    assert g.update(LoadSignals(queue_depth=2), 9.5) == Level.DEGRADED
    assert g.update(LoadSignals(queue_depth=2), 10.6) == Level.NORMAL
    assert g.transitions == {"normal->degraded": 1, "degraded->rejecting": 1,
                             "rejecting->degraded": 1, "degraded->normal": 1}


def test_any_signal_can_trigger_and_calm_resets_on_spikes():
    g = Governor(CFG)
    assert g.update(LoadSignals(rss_mb=1500), 0) == Level.DEGRADED
    assert "rss_mb" in g.reason
    assert g.update(LoadSignals(rss_mb=100), 1.0) == Level.DEGRADED
    assert g.update(LoadSignals(rss_mb=900), 1.5) == Level.DEGRADED  # spike: calm resets
    assert g.update(LoadSignals(rss_mb=100), 2.0) == Level.DEGRADED
    assert g.update(LoadSignals(rss_mb=100), 2.9) == Level.DEGRADED
    assert g.update(LoadSignals(rss_mb=100), 3.0) == Level.NORMAL


def test_disabled_signals_are_ignored():
    g = Governor(GovernorConfig(degrade_queue_depth=None, reject_queue_depth=None))
    assert g.update(LoadSignals(queue_depth=10**6, cpu_percent=100), 0) == Level.NORMAL


async def test_server_degrades_rejects_and_recovers():
    gov = GovernorConfig(degrade_queue_depth=3, reject_queue_depth=6, recover_ratio=0.5,
                         hold_s=0.2, interval_s=0.05)
    cfg = replace(base_config(), governor=gov,
                  scheduler=SchedulerConfig(max_batch_size=1, max_wait_ms=1, max_queue=100))
    engine = FakeEngine(ms_per_char=100, rtf=1.0)  # slow: segments pile up
    async with server(cfg, engine) as (app, url), client(url) as c:
        for i in range(8):
            await c.send(type="start", context_id=f"c{i}")
            await c.send(type="text", context_id=f"c{i}", text="Long enough to queue up.")
            await c.send(type="end", context_id=f"c{i}")
        # the queue fills faster than one sample interval, so it may skip straight up
        rejecting = await c.recv_until(lambda e: e["type"] == "server_state"
                                       and e["level"] == "rejecting")
        assert rejecting["degraded"] is True and "queue_depth" in rejecting["reason"]
        # a new session is refused with an error event and close 1013
        from websockets.asyncio.client import connect

        async with connect(url) as ws2:
            first = await ws2.recv()
            assert '"overloaded"' in first
            with pytest.raises(ConnectionClosed) as info:
                await ws2.recv()
            assert info.value.rcvd.code == 1013
        # a new context on the open connection is refused too
        await c.send(type="start", context_id="late")
        err = await c.until("error", "late")
        assert err["code"] == "overloaded"
        # load goes away: the server steps back down by itself
        for i in range(8):
            await c.send(type="cancel", context_id=f"c{i}")
        await c.recv_until(lambda e: e["type"] == "server_state" and e["level"] == "normal",
                           timeout=10)
        levels = [e["level"] for e in c.got.of("server_state")]
        assert levels[-2:] == ["degraded", "normal"]  # one step at a time on the way down
        async with client(url) as c2:
            await c2.send(type="start")
            await c2.send(type="text", text="Welcome back.")
            await c2.send(type="end")
            await c2.until("done")
        assert app.governor.transitions["degraded->normal"] == 1
        assert app.stats.rejected >= 2


async def test_degraded_sessions_get_shorter_segments():
    cfg = base_config()
    async with server(cfg, FakeEngine(ms_per_char=5)) as (app, url), client(url) as c:
        from rtts.core.governor import Level

        app.governor.level = Level.DEGRADED
        app.apply_level(Level.DEGRADED)
        await c.until("server_state")
        await c.send(type="start", chunk_schedule=[200])
        await c.send(type="text", text="word " * 60)
        await c.send(type="end")
        await c.until("done")
        assert all(len(e["text"]) <= 80 for e in c.got.of("segment_done"))
        await asyncio.sleep(0)


def test_streams_beyond_the_measured_capacity_degrade_and_recover():
    g = Governor(GovernorConfig(hold_s=1.0))  # the defaults: degrade at 1 stream over
    assert g.update(LoadSignals(streams_over_capacity=0), 0.0) == Level.NORMAL
    assert g.update(LoadSignals(streams_over_capacity=1), 0.1) == Level.DEGRADED
    assert "streams_over_capacity" in g.reason
    assert g.update(LoadSignals(streams_over_capacity=3), 0.2) == Level.DEGRADED  # no reject
    assert g.update(LoadSignals(streams_over_capacity=0), 0.5) == Level.DEGRADED
    assert g.update(LoadSignals(streams_over_capacity=0), 1.6) == Level.NORMAL


class _MeasuredEngine(FakeEngine):
    """A continuous fake engine reporting a measured real-time capacity, as ChatTTS does
    from its own steps (kernels.realtime_streams)."""

    capacity = 1

    def __init__(self, **kw):
        super().__init__(**kw)
        self.admitted = []  # (stream, priority) of every request, in admission order

    @property
    def info(self):
        return replace(super().info, kernels={"realtime_streams": self.capacity})

    def serve(self, admit, slots):
        def recording(free):
            new = admit(free)
            self.admitted += [(r.stream, r.priority) for r in new]
            return new

        return super().serve(recording, slots)


async def test_streams_beyond_the_real_time_capacity_wait_instead_of_joining():
    """Capacity 1, three streams at once: the governor degrades on the streams beyond it,
    and while degraded the batch admits one row at a time; every stream still gets its
    audio, and the server recovers when they are done."""
    gov = GovernorConfig(hold_s=0.2, interval_s=0.02)
    cfg = replace(base_config(), governor=gov,
                  scheduler=SchedulerConfig(max_batch_size=4, max_wait_ms=1))
    engine = _MeasuredEngine(ms_per_char=10, rtf=1.0, continuous=True)
    async with server(cfg, engine) as (app, url), client(url) as c:
        for i in range(3):
            await c.send(type="start", context_id=f"c{i}")
            await c.send(type="text", context_id=f"c{i}", text="Several words each, please.")
            await c.send(type="end", context_id=f"c{i}")
        state = await c.recv_until(lambda e: e["type"] == "server_state"
                                   and e["level"] == "degraded")
        assert "streams_over_capacity" in state["reason"]
        assert app.scheduler.realtime_slots == 1 and app.scheduler.slot_limit == 1
        await c.until_all("done", {"c0", "c1", "c2"})
        await c.recv_until(lambda e: e["type"] == "server_state" and e["level"] == "normal",
                           timeout=10)
        assert app.scheduler.slot_limit == 4


async def test_held_at_capacity_a_playing_stream_keeps_its_slot_between_segments():
    """Degraded at a measured capacity of 1: the stream already playing gets its next
    segment before a new stream gets its first, so it plays through; the new one waits."""
    gov = GovernorConfig(hold_s=30, interval_s=0.02)
    cfg = replace(base_config(), governor=gov,
                  scheduler=SchedulerConfig(max_batch_size=4, max_wait_ms=1))
    engine = _MeasuredEngine(ms_per_char=4, rtf=1.0, continuous=True)
    async with server(cfg, engine) as (app, url), client(url) as c:
        from rtts.core.governor import Level

        app.governor.level = Level.DEGRADED
        app.apply_level(Level.DEGRADED)
        await asyncio.sleep(0.1)  # the governor has sampled the capacity
        for i in range(2):
            await c.send(type="start", context_id=f"c{i}")
            await c.send(type="text", context_id=f"c{i}",  # no phrase-cache hits
                         text=f"Stream {i} says its first sentence. And then its second one.")
            await c.send(type="end", context_id=f"c{i}")
        await c.until_all("done", {"c0", "c1"})
        assert app.scheduler.capacity_capped
        admitted = [a for a in engine.admitted if a[0] is not None]  # not the warm-up
        streams = [stream for stream, _ in admitted]
        assert len(streams) == 4 and len(set(streams)) == 2
        # the first stream's segments, then the second's: not interleaved
        assert streams[0] == streams[1] != streams[2] == streams[3], admitted
        assert [p for _, p in admitted] == [0, 1, 0, 1]
        assert set(engine.batches) == {1}  # one row at a time: the capacity
