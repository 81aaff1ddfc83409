"""Server behaviour over real sockets on 127.0.0.1 with the fake engine (test double)."""

import asyncio
import json
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from helpers import base_config, client, server
from rtts.api.native.protocol import unpack_frame
from rtts.core.scheduler import SchedulerConfig
from rtts.engines.fake import FakeEngine
from rtts.errors import CLOSE_GOING_AWAY, CLOSE_MESSAGE_TOO_BIG, CLOSE_POLICY_VIOLATION
from rtts.server import bound_port


def http_get(app, path):
    url = f"http://127.0.0.1:{bound_port(app)}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


async def aget(app, path):
    return await asyncio.to_thread(http_get, app, path)


async def test_streamed_pieces_give_ordered_frames_and_alignment():
    engine = FakeEngine(ms_per_char=20)
    async with server(engine=engine) as (app, url), client(url) as c:
        await c.send(type="start", context_id="a", voice="seed:1")
        text = "Hello there, how are you today? I am fine, thanks. 你好，世界！"
        for i in range(0, len(text), 3):
            await c.send(type="text", context_id="a", text=text[i:i + 3])
        await c.send(type="end", context_id="a")
        done = await c.until("done", "a")
        seg_done = c.got.of("segment_done", "a")
        started = c.got.of("segment_started", "a")
        assert [e["segment"] for e in started] == list(range(len(seg_done)))
        assert len(seg_done) >= 2 and done["segments"] == len(seg_done)
        # frames arrive in (segment, sequence) order and add up to each segment's length
        keys = [(h.segment, h.sequence) for h, _ in c.got.frames]
        assert keys == sorted(keys)
        for e in seg_done:
            pcm = b"".join(p for h, p in c.got.frames if h.segment == e["segment"])
            assert len(pcm) // 2 == e["samples"] == engine.total_samples(e["text"])
        # alignment: each segment starts where the previous ended, text offsets point in
        for prev, nxt in zip(seg_done, seg_done[1:], strict=False):
            assert nxt["audio_start_ms"] == pytest.approx(prev["audio_start_ms"]
                                                           + prev["duration_ms"])
        for e in seg_done:
            assert text[e["text_start"]:e["text_end"]] == e["text"]
        assert done["audio_ms"] == pytest.approx(sum(e["duration_ms"] for e in seg_done))


async def test_first_segment_is_short_for_fast_first_audio():
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a")
        await c.send(type="text", context_id="a", text="Hi there, this is a long sentence "
                     "that keeps going and going for a while before it ends. ")
        first = await c.until("segment_started", "a")
        assert first["text"] == "Hi there,"


async def test_flush_synthesizes_buffered_text_and_reports():
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a", idle_flush_ms=0)
        await c.send(type="text", context_id="a", text="no punctuation yet")
        await asyncio.sleep(0.2)
        assert not c.got.frames
        await c.send(type="flush", context_id="a")
        flushed = await c.until("flushed", "a")
        assert flushed["segments"] == 1
        assert c.got.of("segment_done", "a")[0]["text"] == "no punctuation yet"


async def test_idle_timeout_flushes():
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a", idle_flush_ms=200)
        await c.send(type="text", context_id="a", text="trailing words")
        ev = await c.until("segment_done", "a", timeout=5)
        assert ev["text"] == "trailing words"


async def test_cancel_one_context_while_another_continues():
    engine = FakeEngine(ms_per_char=40, rtf=1.0)  # real-time pacing
    async with server(engine=engine) as (app, url), client(url) as c:
        await c.send(type="start", context_id="long")
        await c.send(type="start", context_id="short")
        await c.send(type="text", context_id="long", text="x" * 60 + ". " + "y" * 60 + ".")
        await c.send(type="end", context_id="long")
        await c.send(type="text", context_id="short", text="A short one, quickly.")
        await c.send(type="end", context_id="short")
        await c.recv_until(lambda e: False if e["type"] != "segment_started" else
                           e["context_id"] == "long")
        await asyncio.sleep(0.3)
        await c.send(type="cancel", context_id="long")
        await c.until("cancelled", "long")
        long_stream = c.got.of("segment_started", "long")[0]["stream"]
        n_before = sum(1 for h, _ in c.got.frames if h.stream == long_stream)
        await c.until("done", "short", timeout=15)
        await asyncio.sleep(0.3)
        # no frame of the cancelled context after `cancelled` (queued ones dropped)
        cancelled_at = next(i for i, e in enumerate(c.got.events) if e["type"] == "cancelled")
        assert not c.got.of("done", "long")
        n_after = sum(1 for h, _ in c.got.frames if h.stream == long_stream)
        assert n_after == n_before
        assert cancelled_at >= 0
        short_done = c.got.of("done", "short")[0]
        assert short_done["audio_ms"] > 0
        assert app.stats.cancels == 1
    assert app.scheduler.running_batches == 0


async def test_contexts_interleave_on_one_connection():
    async with server() as (app, url), client(url) as c:
        for cid in ("one", "two", "three"):
            await c.send(type="start", context_id=cid, voice=f"seed:{len(cid)}")
            await c.send(type="text", context_id=cid, text=f"This is context {cid}.")
            await c.send(type="end", context_id=cid)
        await c.until_all("done", {"one", "two", "three"})
        streams = {e["context_id"]: e["stream"] for e in c.got.of("segment_started")}
        assert len(set(streams.values())) == 3
        for stream in streams.values():
            assert c.got.audio(stream)


async def test_resampled_output_rate():
    engine = FakeEngine(ms_per_char=50)
    async with server(engine=engine) as (app, url), client(url) as c:
        await c.send(type="start", context_id="a", sample_rate=16000)
        await c.send(type="text", context_id="a", text="Sixteen kilohertz.")
        await c.send(type="end", context_id="a")
        await c.until("done", "a")
        samples = len(c.got.audio(1)) // 2
        expected = engine.total_samples("Sixteen kilohertz.") * 16000 / 24000
        assert abs(samples - expected) <= 1
        assert c.got.of("segment_started")[0]["sample_rate"] == 16000


@pytest.mark.parametrize("payload,code", [
    ("this is not json", "invalid_json"),
    (json.dumps({"type": "sing"}), "unknown_type"),
    (json.dumps({"type": "text", "text": "hi"}), "unknown_context"),
    (json.dumps({"type": "start", "temperature": -1}), "invalid_params"),
    (json.dumps({"type": "start", "sample_rate": 1}), "invalid_params"),
    (json.dumps([1, 2, 3]), "invalid_message"),
])
async def test_bad_input_gets_error_event_and_connection_survives(payload, code):
    async with server() as (app, url), client(url) as c:
        await c.ws.send(payload)
        err = await c.until("error")
        assert err["code"] == code and err["message"]
        await c.send(type="start", context_id="ok")
        await c.send(type="text", context_id="ok", text="Still working.")
        await c.send(type="end", context_id="ok")
        assert (await c.until("done", "ok"))["segments"] == 1


async def test_binary_from_client_is_rejected_politely():
    async with server() as (app, url), client(url) as c:
        await c.ws.send(b"\x00\x01")
        assert (await c.until("error"))["code"] == "binary_not_accepted"


async def test_oversize_message_closes_1009_and_server_keeps_serving():
    cfg = replace(base_config(), max_message_bytes=1024)
    async with server(cfg) as (app, url):
        async with client(url) as c:
            await c.send(type="start", context_id="a")
            await c.send(type="text", context_id="a", text="x" * 5000)
            with pytest.raises(ConnectionClosed) as info:
                await c.until("never")
            assert info.value.rcvd.code == CLOSE_MESSAGE_TOO_BIG
        async with client(url) as c2:
            await c2.send(type="start")
            await c2.send(type="text", text="Another client is fine.")
            await c2.send(type="end")
            await c2.until("done")


async def test_too_many_protocol_errors_closes_1008():
    cfg = replace(base_config(), max_protocol_errors=3)
    async with server(cfg) as (app, url), client(url) as c:
        for _ in range(3):
            await c.ws.send("garbage")
        with pytest.raises(ConnectionClosed) as info:
            await c.until("never")
        assert info.value.rcvd.code == CLOSE_POLICY_VIOLATION
        assert len(c.got.of("error")) == 3


async def test_invalid_utf8_closes_1007():
    async with server() as (app, url), client(url) as c:
        # a text frame whose payload is not UTF-8, written below the client's checks
        from websockets.frames import Frame, Opcode

        c.ws.protocol.send_frame(Frame(Opcode.TEXT, b"\xff\xfe"))
        c.ws.send_data()
        with pytest.raises(ConnectionClosed) as info:
            await c.until("never")
        assert info.value.rcvd.code == 1007


async def test_engine_failure_reports_error_for_that_segment_only():
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a")
        await c.send(type="start", context_id="b")
        await c.send(type="text", context_id="a", text="This one will [fail] now.")
        await c.send(type="text", context_id="b", text="This one is fine.")
        await c.send(type="end", context_id="a")
        await c.send(type="end", context_id="b")
        await c.until_all("done", {"a", "b"})
        err = c.got.of("error", "a")
        assert err and err[0]["code"] == "engine_error" and err[0]["segment"] == 0
        assert c.got.of("segment_done", "b")


async def test_health_ready_metrics_info_static_and_wav():
    async with server() as (app, url):
        assert (await aget(app, "/healthz"))[0] == 200
        assert (await aget(app, "/readyz"))[0] == 200
        status, body, _ = await aget(app, "/metrics")
        assert status == 200 and b"rtts_active_connections" in body
        assert b"rtts_batch_joins_total 0" in body
        status, body, _ = await aget(app, "/v1/info")
        info = json.loads(body)
        assert info["engine"] == "fake" and info["kernels"] is None
        assert info["batching"]["mode"] == "static"  # the fake is served in fixed batches
        assert (await aget(app, "/nope"))[0] == 404
        assert (await aget(app, "/../pyproject.toml"))[0] == 404
        assert (await aget(app, "/v1/stream"))[0] == 400
        status, body, headers = await aget(app, "/v1/tts?text=Hello%20world.&sample_rate=16000")
        assert status == 200 and headers["Content-Type"] == "audio/wav"
        import io

        import soundfile as sf

        audio, rate = sf.read(io.BytesIO(body))
        assert rate == 16000 and len(audio) > 1000 and np.abs(audio).max() > 0.1
        assert (await aget(app, "/v1/tts?text=&voice=x"))[0] == 400


async def test_not_ready_until_loaded_and_failed_load_reports_reason():
    class Broken(FakeEngine):
        def load(self):
            raise RuntimeError("weights missing")

    from rtts.server import run_server

    async with run_server(base_config(), Broken()) as app:
        status, body, _ = await aget(app, "/readyz")
        assert status == 503 and b"weights missing" in body
        url = f"ws://127.0.0.1:{bound_port(app)}/v1/stream"
        with pytest.raises(InvalidStatus) as info:
            async with connect(url):
                pass
        assert info.value.response.status_code == 503


async def test_graceful_shutdown_finishes_in_flight_then_closes_1001():
    engine = FakeEngine(ms_per_char=20, rtf=0.5)
    cfg = replace(base_config(), shutdown_grace_s=5.0)
    async with server(cfg, engine) as (app, url), client(url) as c:
        await c.send(type="start", context_id="a")
        await c.send(type="text", context_id="a", text="Finish this sentence please.")
        await c.send(type="end", context_id="a")
        await c.until("segment_started", "a")
        port = bound_port(app)
        shutdown = asyncio.create_task(app.drain_and_close())
        await asyncio.sleep(0.05)
        assert app.state == "draining"
        with pytest.raises(InvalidStatus) as refused:  # new streams refused (test_drain.py)
            async with connect(f"ws://127.0.0.1:{port}/v1/stream"):
                pass
        assert refused.value.response.status_code == 503
        await c.until("done", "a")  # in-flight work completes
        with pytest.raises(ConnectionClosed) as info:
            await c.until("never")
        assert info.value.rcvd.code == CLOSE_GOING_AWAY
        await shutdown
        app.state = "stopped"


async def test_shutdown_deadline_cancels_what_is_left():
    engine = FakeEngine(ms_per_char=200, rtf=1.0)  # far longer than the grace period
    cfg = replace(base_config(), shutdown_grace_s=0.3)
    async with server(cfg, engine) as (app, url), client(url) as c:
        await c.send(type="start", context_id="a")
        await c.send(type="text", context_id="a", text="x" * 50 + ".")
        await c.send(type="end", context_id="a")
        await c.until("segment_started", "a")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await app.drain_and_close()
        app.state = "stopped"
        assert loop.time() - t0 < 3.0
        with pytest.raises(ConnectionClosed):
            await c.until("never")
    assert app.scheduler.running_batches == 0


async def test_non_reading_client_is_paced_then_dropped_4008():
    engine = FakeEngine(ms_per_char=100)
    cfg = replace(base_config(), send_queue_frames=4, slow_client_timeout_s=0.5,
                  max_lead_s=None,  # no pacing: the server tries to send it all at once
                  scheduler=SchedulerConfig(max_wait_ms=1))
    async with server(cfg, engine) as (app, url):
        async with connect(url, max_size=None, max_queue=1) as ws:
            ws.transport.pause_reading()  # a client that stops reading entirely
            for i in range(8):  # ~800 s of audio, far beyond socket buffers
                await ws.send(json.dumps({"type": "start", "context_id": f"c{i}"}))
                await ws.send(json.dumps({"type": "text", "context_id": f"c{i}",
                                          "text": ("z" * 190 + ". ") * 5}))
                await ws.send(json.dumps({"type": "end", "context_id": f"c{i}"}))
            for _ in range(100):
                await asyncio.sleep(0.1)
                if not app.connections:
                    break
            assert not app.connections  # the server gave up on it
            ws.transport.resume_reading()
            received = 0
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    received += len(await ws.recv())
            # The close frame is behind data the client never read: it may be cut off
            # with the TCP connection, but if it arrives it says 4008.
            assert info.value.rcvd is None or info.value.rcvd.code == 4008
            assert received < 50 * 2**20  # it got what was in flight, not 800 s of audio
        assert app.stats.frames_sent < 8000


async def test_paused_reader_switches_to_the_queue_and_back_without_reordering():
    """Frames go straight to the socket while it has room, through the writer queue while
    the client is not reading; either way they arrive complete and in order."""
    engine = FakeEngine(ms_per_char=100)  # 6 x 31 s of audio: ~9 MB, beyond socket buffers
    cfg = replace(base_config(), max_lead_s=None, slow_client_timeout_s=10.0)
    async with server(cfg, engine) as (app, url), client(url) as c:
        c.ws.transport.pause_reading()  # the socket backs up: sends must queue
        texts = {f"c{i}": ("Segment one of many here. " * 12) for i in range(6)}
        for cid, text in texts.items():
            await c.send(type="start", context_id=cid)
            await c.send(type="text", context_id=cid, text=text)
            await c.send(type="end", context_id=cid)
        await asyncio.sleep(1.0)
        assert any(conn.out.qsize() for conn in app.connections)  # the queue path engaged
        c.ws.transport.resume_reading()
        await c.until_all("done", set(texts), timeout=30)
        for cid in texts:
            started = c.got.of("segment_started", cid)
            done_events = c.got.of("segment_done", cid)
            stream = started[0]["stream"]
            frames = [(h.segment, h.sequence, len(p)) for h, p in c.got.frames
                      if h.stream == stream]
            # per segment: sequence numbers 0..n-1 in order, and every sample arrived
            for e in done_events:
                seqs = [q for seg, q, _ in frames if seg == e["segment"]]
                assert seqs == list(range(e["frames"]))
                assert sum(n for seg, _, n in frames if seg == e["segment"]) == 2 * e["samples"]
            assert [seg for seg, _, _ in frames] == sorted(seg for seg, _, _ in frames)


async def test_many_clients_at_once():
    async with server() as (app, url):
        async def one(i):
            async with client(url) as c:
                await c.send(type="start", voice=f"seed:{i}")
                await c.send(type="text", text=f"Client number {i} speaking.")
                await c.send(type="end")
                return await c.until("done")

        results = await asyncio.gather(*(one(i) for i in range(30)))
        assert all(r["segments"] == 1 for r in results)
        assert max(app.scheduler.batch_sizes) > 1  # concurrent streams were batched


async def test_frames_are_valid_pcm16():
    async with server() as (app, url), client(url) as c:
        await c.send(type="start")
        await c.send(type="text", text="A tone please.")
        await c.send(type="end")
        await c.until("done")
        pcm = np.frombuffer(c.got.audio(1), dtype="<i2")
        assert pcm.size and np.abs(pcm).max() > 1000
        header, _ = unpack_frame(
            b"\x01\x00\x01\x00" + b"\x00" * 8)
        assert header.stream == 1


async def test_metrics_after_traffic():
    async with server() as (app, url):
        async with client(url) as c:
            await c.send(type="start")
            await c.send(type="text", text="Count me in the metrics.")
            await c.send(type="cancel")
            await c.until("cancelled")
            await c.send(type="start", context_id="b")
            await c.send(type="text", context_id="b", text="And this one too.")
            await c.send(type="end", context_id="b")
            await c.until("done", "b")
        _, body, _ = await aget(app, "/metrics")
        text = body.decode()
        values = {line.split(" ")[0]: float(line.split(" ")[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        assert values['rtts_batch_size_bucket{le="+Inf"}'] == values["rtts_batch_size_count"] >= 1
        assert values["rtts_time_to_first_audio_seconds_count"] >= 1
        assert values["rtts_frame_latency_seconds_count"] >= 1
        assert values["rtts_cancels_total"] == 1
        assert values["rtts_audio_seconds_generated_total"] > 0
        assert values["rtts_degraded"] == 0


@pytest.mark.parametrize("lead,paced", [(0.5, True), (None, False)])
async def test_output_is_paced_to_a_bounded_lead(lead, paced):
    engine = FakeEngine(ms_per_char=100)  # 2 s of audio, produced instantly
    cfg = replace(base_config(), max_lead_s=lead)
    async with server(cfg, engine) as (app, url), client(url) as c:
        loop = asyncio.get_running_loop()
        await c.send(type="start")
        await c.send(type="text", text="z" * 19 + ".")
        await c.send(type="end")
        await c.until("segment_started")
        t0 = loop.time()
        await c.until("done")
        elapsed = loop.time() - t0
        if paced:  # 2 s of audio with 0.5 s of lead: at least ~1.5 s of wall time
            assert elapsed >= 1.3, elapsed
        else:
            assert elapsed < 1.0, elapsed


async def test_segment_started_says_what_is_spoken():
    # issue 13: the event shows the normalized text; normalize=false keeps it as written
    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a")
        await c.send(type="start", context_id="b", normalize=False)
        for cid in ("a", "b"):
            await c.send(type="text", context_id=cid, text="Call 911 now!")
            await c.send(type="end", context_id=cid)
            await c.until("done", cid)
        [a] = c.got.of("segment_started", "a")
        [b] = c.got.of("segment_started", "b")
        assert (a["text"], a["spoken"]) == ("Call 911 now!", "Call nine one one now.")
        assert (b["text"], b["spoken"]) == ("Call 911 now!", "Call 911 now!")
        await c.send(type="start", context_id="c", normalize="yes")
        err = await c.until("error")
        assert err["code"] == "invalid_params"


@pytest.mark.parametrize("fmt,codec", [("opus", "opus"), ("mp3", "mp3float"),
                                       ("wav", "pcm_s16le"), ("webm", "opus")])
async def test_native_encoded_formats_frame_a_decodable_stream_per_segment(fmt, codec):
    import io

    import av

    async with server() as (app, url), client(url) as c:
        await c.send(type="start", context_id="a", format=fmt)
        await c.send(type="text", context_id="a", text="Hello there. Encoded audio, please.")
        await c.send(type="end", context_id="a")
        await c.until("done", "a")
        seg_done = c.got.of("segment_done", "a")
        assert len(seg_done) >= 2
        for e in seg_done:
            frames = [(h, p) for h, p in c.got.frames if h.segment == e["segment"]]
            assert [h.sequence for h, _ in frames] == list(range(len(frames)))
            assert len(frames) == e["frames"]
            container = av.open(io.BytesIO(b"".join(p for _, p in frames)))
            assert container.streams.audio[0].codec_context.name == codec
            decoded = sum(f.samples for f in container.decode(audio=0))
            rate = container.streams.audio[0].rate
            assert abs(decoded / rate - e["duration_ms"] / 1000) < 0.08, (decoded, e)


async def test_native_mulaw_is_8khz_one_byte_a_sample():
    async with server() as (app, url), client(url) as c:
        assert "mulaw" in c.of_kind("ready")[0]["formats"]
        await c.send(type="start", context_id="a", format="mulaw")
        await c.send(type="text", context_id="a", text="Phone bridge audio.")
        await c.send(type="end", context_id="a")
        await c.until("done", "a")
        started = c.got.of("segment_started", "a")
        assert started and all(e["sample_rate"] == 8000 for e in started)
        samples = sum(e["samples"] for e in c.got.of("segment_done", "a"))
        audio = b"".join(p for _, p in c.got.frames)
        assert len(audio) == samples and samples > 8000
        await c.send(type="start", context_id="b", format="alaw", sample_rate=16000)
        err = await c.until("error")
        assert err["code"] == "invalid_params" and "8000" in err["message"]
