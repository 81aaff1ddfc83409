"""Playback-aware flow control and heard text (issue 14), character timings on the native
protocol (issue 16): the pure session, then a real server (fake engine) over a socket."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from dataclasses import replace

import pytest
from websockets.exceptions import ConnectionClosed

from helpers import base_config, client, server
from rtts.api.native.pacing import LeadPacer
from rtts.api.native.protocol import (
    CancelMessage,
    EndMessage,
    PlaybackMessage,
    StartMessage,
    TextMessage,
    parse_client_message,
    unpack_frame,
)
from rtts.api.native.session import Playback, SendEvent, Session
from rtts.core.params import SynthParams
from rtts.engines.fake import FakeEngine
from rtts.errors import ErrorCode, ProtocolError
from rtts.text.segmenter import Chunk
from rtts.text.timings import estimate

# -- pure: parsing, pacer, session ----------------------------------------------------


@pytest.mark.parametrize("msg,code", [
    ({"played_ms": -1}, "invalid_params"),
    ({"played_ms": 1e12}, "invalid_params"),
    ({"played_ms": "12"}, "invalid_params"),
    ({"played_ms": True}, "invalid_params"),
    ({"played_ms": 10, "buffered_ms": -5}, "invalid_params"),
    ({}, "invalid_message"),
    ({"played_ms": 1, "context_id": "bad id!"}, "invalid_message"),
])
def test_bad_playback_messages_are_protocol_errors(msg, code):
    with pytest.raises(ProtocolError) as info:
        parse_client_message(json.dumps({"type": "playback", **msg}))
    assert info.value.code == code


def test_playback_and_timings_parse():
    assert parse_client_message('{"type":"playback","context_id":"a","played_ms":12.5,'
                                '"buffered_ms":300}') == PlaybackMessage("a", 12.5, 300.0)
    start = parse_client_message('{"type":"start","timings":true}')
    assert isinstance(start, StartMessage) and start.timings
    with pytest.raises(ProtocolError):
        parse_client_message('{"type":"start","timings":1}')


def test_pacer_uses_the_reported_position_without_extrapolating():
    p = LeadPacer(1.0, ramp=None)
    for _ in range(10):
        p.sent(0.1, 0.0)
    assert p.delay(0.0) == 0.0 and p.played(0.5) == pytest.approx(0.5)  # estimate
    p.report(0.2)
    assert p.reported and p.played(100.0) == pytest.approx(0.2)  # never runs ahead
    p.sent(0.5, 0.0)
    assert p.lead(100.0) == pytest.approx(1.3)
    assert p.delay(100.0) == pytest.approx(0.3)  # still waiting, however long ago
    p.report(0.1)  # an older report arriving late does not move it back
    assert p.played(100.0) == pytest.approx(0.2)
    p.report(5.0)  # more than was sent: capped at what was sent
    assert p.played(0.0) == pytest.approx(1.5) and p.delay(0.0) == 0.0


def test_reported_lead_never_starves_a_prebuffering_client():
    # --max-lead 0.1 s, a client that waits for 400 ms before it starts playing: on its
    # reports (0 ms played) the server still sends the 0.5 s floor, so playback can start
    p = LeadPacer(0.1, ramp=None)
    p.report(0.0)
    sent = 0.0
    while p.delay(0.0) == 0.0 and sent < 5.0:
        p.sent(0.1, 0.0)
        sent += 0.1
    assert 0.5 <= sent <= 0.6 + 1e-9


def _session_with_segments(timings: bool = False) -> tuple[Session, list[Chunk]]:
    s = Session()
    s.receive(StartMessage("a", SynthParams(), chunk_schedule=(4,), timings=timings), now=0.0)
    text = "Hello there, general Kenobi. You are a bold one."
    acts = s.receive(TextMessage("a", text), now=0.0) + s.receive(EndMessage("a"), now=0.0)
    chunks = [a.chunk for a in acts if hasattr(a, "chunk")]
    assert len(chunks) >= 2
    return s, chunks


def test_segment_done_carries_timings_only_when_asked():
    for asked in (False, True):
        s, chunks = _session_with_segments(asked)
        start = 0.0
        for i, chunk in enumerate(chunks):
            samples = 24 * 100 * len(chunk.text)  # 100 ms a character at 24 kHz
            acts = s.segment_done("a", i, chunk, samples, 3,
                                  estimate(chunk.text, samples / 24))
            ev = next(a.event for a in acts if isinstance(a, SendEvent)
                      and a.event["type"] == "segment_done")
            if not asked:
                assert "chars" not in ev
                continue
            assert "".join(ev["chars"]) == chunk.text and ev["timings_estimated"] is True
            starts, durs = ev["char_start_ms"], ev["char_duration_ms"]
            assert starts == sorted(starts) and starts[0] == round(start)
            assert starts[-1] + durs[-1] == pytest.approx(start + ev["duration_ms"], abs=1)
            start += ev["duration_ms"]


def test_cancel_reports_heard_text_from_reported_playback():
    s, chunks = _session_with_segments()
    first = chunks[0]
    samples = 24 * 100 * len(first.text)
    s.segment_done("a", 0, first, samples, 3, estimate(first.text, samples / 24))
    text = "Hello there, general Kenobi. You are a bold one."
    expect = estimate(first.text, samples / 24).heard(400.0)
    assert s.receive(PlaybackMessage("a", 400.0), now=0.1) == [Playback("a", 400.0)]
    acts = s.receive(CancelMessage("a"), now=0.2)
    [ev] = [a.event for a in acts if isinstance(a, SendEvent)]
    assert ev["type"] == "cancelled" and ev["heard_ms"] == 400.0
    assert ev["heard_source"] == "reported"
    assert ev["text_spoken"] == first.text[:expect] and 0 < expect < len(first.text)
    assert ev["text_spoken"] + ev["text_remaining"] == text
    # a report crossing the cancel on the wire is not an error; a stranger's is
    assert s.receive(PlaybackMessage("a", 500.0), now=0.3) == []
    with pytest.raises(ProtocolError) as info:
        s.receive(PlaybackMessage("zz", 500.0), now=0.3)
    assert info.value.code == ErrorCode.UNKNOWN_CONTEXT


def test_heard_text_in_an_unfinished_segment_is_segment_granularity():
    s, chunks = _session_with_segments()
    first = chunks[0]
    samples = 24 * 100 * len(first.text)
    s.segment_done("a", 0, first, samples, 3, estimate(first.text, samples / 24))
    ctx = s.contexts["a"]
    ctx.estimated_played_ms = samples / 24 + 300.0  # inside segment 1, which is not done
    heard = s.heard(ctx)
    assert heard["heard_source"] == "estimated"
    assert heard["text_spoken"] == "Hello there, general Kenobi. "[:first.end]


def test_playback_floods_are_rate_limited_and_do_not_grow_memory():
    s, _ = _session_with_segments()
    now, errors, accepted = 0.0, 0, 0
    for i in range(200):  # 200 reports in 0.2 s
        try:
            accepted += len(s.receive(PlaybackMessage("a", float(i)), now=now))
        except ProtocolError as exc:
            assert exc.code == ErrorCode.RATE_LIMITED
            errors += 1
        now += 0.001
    assert errors > 150 and accepted <= 25
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(20_000):  # at the allowed rate: nothing accumulates
        s.receive(PlaybackMessage("a", 1000.0 + i), now=1.0 + i * 0.05)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename")
                if "rtts" in str(d.traceback))
    assert grown < 4096, grown


# -- a real server: pacing on the reported position, heard text, errors ----------------


async def test_slow_reported_playback_bounds_the_lead():
    """A client that plays at half speed and says so gets audio no further ahead than
    --max-lead of its *reported* position (the wall-clock estimate would send more)."""
    lead_s = 0.5
    engine = FakeEngine(ms_per_char=100)  # 6 s of audio, produced at once
    cfg = replace(base_config(), max_lead_s=lead_s)
    async with server(cfg, engine) as (app, url), client(url) as c:
        loop = asyncio.get_running_loop()
        await c.send(type="start", context_id="s")
        await c.send(type="text", context_id="s", text="z" * 59 + ".")
        await c.send(type="end", context_id="s")
        started = await c.until("segment_started", "s")
        rate = started["sample_rate"]
        reported, worst = 0.0, 0.0
        t0 = loop.time()
        next_report = t0
        while loop.time() - t0 < 1.5:
            now = loop.time()
            if now >= next_report:  # every 100 ms, 50 ms more played: half speed
                reported = 500.0 * (now - t0)
                await c.send(type="playback", context_id="s", played_ms=reported,
                             buffered_ms=200)
                next_report = now + 0.1
            try:
                async with asyncio.timeout(0.02):
                    msg = await c.ws.recv()
            except TimeoutError:
                continue
            if isinstance(msg, bytes):

                c.got.frames.append(unpack_frame(msg))
                received_ms = 1000.0 * sum(len(p) // 2 for _, p in c.got.frames) / rate
                worst = max(worst, received_ms - reported)
        elapsed_ms = 1000.0 * (loop.time() - t0)
        received_ms = 1000.0 * sum(len(p) // 2 for _, p in c.got.frames) / rate
        # one 100 ms frame may go out on the edge of the bound
        assert worst <= 1000.0 * lead_s + 100.0 + 1.0, worst
        assert received_ms < elapsed_ms, (received_ms, elapsed_ms)  # not the wall clock
        assert received_ms >= reported + 1000.0 * lead_s - 200.0, (received_ms, reported)
        await c.send(type="playback", context_id="s", played_ms=reported + 10.0)
        await c.send(type="cancel", context_id="s")
        ev = await c.until("cancelled", "s")
        assert ev["heard_source"] == "reported"
        assert ev["heard_ms"] == pytest.approx(reported + 10.0, abs=0.01)
        assert ev["text_spoken"] + ev["text_remaining"] == "z" * 59 + "."


async def test_cancelled_returns_heard_text_and_timings_option():
    engine = FakeEngine(ms_per_char=50)
    cfg = replace(base_config(), max_lead_s=None)
    text = "Hello there, this is the second part of the text which keeps going on."
    async with server(cfg, engine) as (app, url), client(url) as c:
        # timings on: every segment_done carries consistent character timings
        await c.send(type="start", context_id="t", timings=True, chunk_schedule=[8])
        await c.send(type="text", context_id="t", text=text)
        await c.send(type="end", context_id="t")
        await c.until("done", "t")
        dones = c.got.of("segment_done", "t")
        assert len(dones) >= 2
        assert "".join("".join(d["chars"]) for d in dones) == "".join(d["text"] for d in dones)
        for d in dones:
            starts = d["char_start_ms"]
            assert starts == sorted(starts)
            assert d["audio_start_ms"] - 1 <= starts[0]
            end = starts[-1] + d["char_duration_ms"][-1]
            assert end <= d["audio_start_ms"] + d["duration_ms"] + 1
        # heard text on cancel, from the reported position inside the first segment
        await c.send(type="start", context_id="h", chunk_schedule=[8])
        await c.send(type="text", context_id="h", text=text)
        first = await c.until("segment_done", "h")
        assert "chars" not in first  # not asked for
        heard_ms = first["duration_ms"] * 0.6
        await c.send(type="playback", context_id="h", played_ms=heard_ms)
        await c.send(type="cancel", context_id="h")
        ev = await c.until("cancelled", "h")
        n = estimate(first["text"], first["duration_ms"]).heard(heard_ms)
        assert 0 < n < len(first["text"])
        assert ev["text_spoken"] == text[:n] and ev["text_remaining"] == text[n:]
        assert ev["heard_ms"] == pytest.approx(heard_ms, abs=0.01)


async def test_bad_playback_gets_errors_and_floods_close_1008():
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a")
        await c.send(type="text", context_id="a", text="Hi there.")
        await c.send(type="end", context_id="a")
        await c.until("done", "a")
        await c.send(type="playback", context_id="a", played_ms=10)  # after done: ignored
        await c.send(type="playback", context_id="nope", played_ms=10)
        assert (await c.until("error"))["code"] == "unknown_context"
        await c.send(type="start", context_id="b")
        for bad in (-1, 1e15, "x"):
            await c.send(type="playback", context_id="b", played_ms=bad)
            err = await c.until("error")
            assert err["code"] == "invalid_params" and err["context_id"] == "b"
        assert all(e["code"] != "unknown_context" or e.get("context_id") == "nope"
                   for e in c.got.of("error"))
        with pytest.raises(ConnectionClosed) as closed:
            for i in range(200):
                await c.send(type="playback", context_id="b", played_ms=i)
            await c.recv_until(lambda e: False)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        codes = {e["code"] for e in c.got.of("error")}
        assert "rate_limited" in codes


def test_heard_text_of_character_by_character_input_stays_compact():
    s = Session()
    s.receive(StartMessage("a", SynthParams(), chunk_schedule=(4,)), now=0.0)
    text = "Typed one character at a time, like live typing does. " * 20
    for ch in text:
        s.receive(TextMessage("a", ch), now=0.0)
    ctx = s.contexts["a"]
    assert len(ctx.input) <= 257
    ctx.estimated_played_ms = 0.0
    heard = s.heard(ctx)
    assert heard["text_spoken"] == "" and heard["text_remaining"] == text
