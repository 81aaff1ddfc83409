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
