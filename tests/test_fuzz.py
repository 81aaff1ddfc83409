"""Fuzzing: the session state machine (hypothesis) and the socket layer (random abuse).

Invariants: nothing but ProtocolError escapes the session; segment numbers are dense per
context; ``done`` comes once, after every segment of an ended context; the server keeps
serving other clients and leaks no connection, queued request or running batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from helpers import client, server
from rtts.api.native.protocol import parse_client_message
from rtts.api.native.session import SendEvent, Session, SessionLimits, Synthesize
from rtts.engines.fake import FakeEngine
from rtts.errors import ProtocolError

CIDS = ["a", "b", "c", "default"]

message = st.one_of(
    st.builds(lambda c, sch: {"type": "start", "context_id": c, "chunk_schedule": sch},
              st.sampled_from(CIDS), st.lists(st.integers(1, 30), min_size=1, max_size=3)),
    st.builds(lambda c, t: {"type": "text", "context_id": c, "text": t},
              st.sampled_from(CIDS), st.text(alphabet="ab .,!?。，你好\n1", max_size=40)),
    st.builds(lambda c: {"type": "flush", "context_id": c}, st.sampled_from(CIDS)),
    st.builds(lambda c: {"type": "cancel", "context_id": c}, st.sampled_from(CIDS)),
    st.builds(lambda c: {"type": "end", "context_id": c}, st.sampled_from(CIDS)),
    st.builds(lambda c, ms: {"type": "playback", "context_id": c, "played_ms": ms},
              st.sampled_from(CIDS), st.one_of(st.floats(-10, 1e9), st.just("x"))),
    st.just({"type": "nonsense"}),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(message, st.booleans()), max_size=60))
def test_session_state_machine_invariants(steps):
    s = Session(SessionLimits(max_contexts=3, max_text_chars_per_context=200))
    queued: dict[str, list[int]] = {}  # live segments per context id
    done: list[str] = []
    starts: dict[str, int] = {}
    now = 0.0
    for msg, finish_audio in steps:
        now += 0.5
        try:
            actions = s.receive(parse_client_message(json.dumps(msg)), now=now)
        except ProtocolError:
            continue
        if msg["type"] in ("start", "cancel"):
            queued[msg["context_id"]] = []
        if msg["type"] == "start":
            starts[msg["context_id"]] = starts.get(msg["context_id"], 0) + 1
        actions += s.poll(now)
        for a in actions:
            if isinstance(a, Synthesize):
                seen = queued.setdefault(a.context_id, [])
                assert a.index == (seen[-1] + 1 if seen else 0)  # dense numbering
                seen.append(a.index)
                assert a.chunk.text.strip()
            elif isinstance(a, SendEvent) and a.event["type"] == "done":
                done.append(a.event["context_id"])
        assert len(s.contexts) <= 3
        if finish_audio:  # the audio of every queued segment arrives
            for cid, segs in list(queued.items()):
                ctx = s.contexts.get(cid)
                if ctx is None:
                    continue
                while ctx.segments_done < ctx.segments_queued:
                    i = ctx.segments_done
                    for a in s.segment_done(cid, i, _chunk(), 100, 1):
                        if isinstance(a, SendEvent) and a.event["type"] == "done":
                            done.append(cid)
                            assert a.event["segments"] == len(segs)
    for cid in set(done):  # `done` at most once per context lifetime
        assert done.count(cid) <= starts[cid]
    for cid, ctx in s.contexts.items():
        assert ctx.segments_done <= ctx.segments_queued, cid


def _chunk():
    from rtts.text.segmenter import Chunk

    return Chunk("x", 0, 1)


async def test_socket_fuzz_leaves_server_healthy():
    engine = FakeEngine(ms_per_char=5)
    tried = 0
    async with server(engine=engine) as (app, url):

        async def abuser(seed: int) -> int:
            r = random.Random(seed)
            n = 0
            try:
                async with connect(url, max_size=None, ping_interval=None) as ws:
                    await ws.recv()
                    for _ in range(r.randint(5, 40)):
                        n += 1
                        kind = r.random()
                        if kind < 0.15:
                            await ws.send(bytes(r.getrandbits(8) for _ in range(r.randint(0, 64))))
                        elif kind < 0.3:
                            await ws.send("".join(chr(r.randint(32, 0x2FFF))
                                                  for _ in range(r.randint(0, 50))))
                        elif kind < 0.45:  # a flood of one-character text messages
                            cid = r.choice(CIDS)
                            await ws.send(json.dumps({"type": "start", "context_id": cid}))
                            for ch in "Hello, flood. " * r.randint(1, 5):
                                await ws.send(json.dumps({"type": "text", "context_id": cid,
                                                          "text": ch}))
                                n += 1
                        elif kind < 0.6:  # cancel storm
                            for _ in range(r.randint(1, 20)):
                                await ws.send(json.dumps({"type": "cancel",
                                                          "context_id": r.choice(CIDS)}))
                                n += 1
                        elif kind < 0.7:  # oversize message (server closes 1009)
                            await ws.send("x" * (300 * 1024))
                        elif kind < 0.8:  # abrupt disconnect mid-stream
                            await ws.send(json.dumps({"type": "start", "context_id": "z"}))
                            await ws.send(json.dumps({"type": "text", "context_id": "z",
                                                      "text": "cut me off. " * 5}))
                            ws.transport.abort()
                            return n
                        else:
                            await ws.send(json.dumps(rng_message(r)))
                        if r.random() < 0.3:
                            await asyncio.sleep(0)
            except ConnectionClosed:
                pass
            return n

        for round_ in range(4):
            counts = await asyncio.gather(*(abuser(round_ * 100 + i) for i in range(25)))
            tried += sum(counts)
        # a well-behaved client is still served, fully
        async with client(url) as c:
            await c.send(type="start", context_id="good")
            await c.send(type="text", context_id="good", text="Still here after the storm.")
            await c.send(type="end", context_id="good")
            assert (await c.until("done", "good"))["segments"] == 1
        for _ in range(100):  # everything the abusers started winds down
            if not app.connections and app.scheduler.running_batches == 0:
                break
            await asyncio.sleep(0.05)
        assert not app.connections
        assert app.scheduler.running_batches == 0
        assert app.scheduler.queue_depth == 0
    print(f"socket fuzz: {tried} abusive inputs over 100 connections")
    assert tried > 500


def rng_message(r: random.Random) -> dict[str, object]:
    kinds = ["start", "text", "flush", "cancel", "end", "playback", "bogus"]
    msg: dict[str, object] = {"type": r.choice(kinds), "context_id": r.choice(CIDS + ["!!"])}
    for key in ("text", "temperature", "sample_rate", "top_K", "voice", "speed", "played_ms",
                "buffered_ms", "timings"):
        if r.random() < 0.3:
            msg[key] = r.choice([None, -1, 0, 1.5, "x", [], {}, 10**9, "seed:1", 16000])
    return msg


HTTP_PATHS = ["/v1/audio/speech", "/v1/tts", "/v1/models", "/v1/audio/voices",
              "/v1/audio/models", "/v1/models/x", "/v1/formats", "/v1/info", "/v1/token",
              "/v1/nope", "/healthz", "/metrics", "/", "/../etc/passwd", "/v1/stream"]


def http_abuse(r: random.Random) -> tuple[bytes, bool]:
    """One HTTP/1.1 request, well-formed or not, aimed at the HTTP surfaces."""
    path = "/v1/audio/speech" if r.random() < 0.5 else r.choice(HTTP_PATHS)
    kind = r.random()
    fields = {"model": r.choice(["tts-1", "", None, 7, "x" * 300]),
              "input": r.choice(["Hi there.", "", None, 5, "y" * 5000, "你好，世界。", "[fail]"]),
              "voice": r.choice(["alloy", "", None, "nobody", {"id": "ash"}, {"x": 1}, [],
                                 "seed:3", "seed:99999999999999"]),
              "response_format": r.choice(["mp3", "pcm", "opus", "wav", "flac", "aac",
                                           "mulaw", "bogus", None, 3]),
              "speed": r.choice([1.0, 0.1, 5, "fast", None, True, 4.0, float("nan")]),
              "stream_format": r.choice(["audio", "sse", "x", None])}
    body_obj = {k: v for k, v in fields.items() if r.random() < 0.8}
    if kind < 0.5:
        try:
            body = json.dumps(body_obj).encode()
        except ValueError:
            body = b"{}"
    elif kind < 0.65:
        body = bytes(r.getrandbits(8) for _ in range(r.randint(0, 200)))
    elif kind < 0.75:
        body = json.dumps([1, 2, 3]).encode()
    else:
        body = b""
    method = r.choice(["POST", "POST", "GET", "PUT", "DELETE", "OPTIONS", "HEAD", "BREW"])
    if path == "/v1/audio/speech" and r.random() < 0.8:
        method = "POST"
    if r.random() < 0.2:
        path += "?" + "&".join(f"{k}={r.choice(['1', 'x', '', '%ff', 'Hi%20there.'])}"
                               for k in ("text", "voice", "seed", "sample_rate", "format"))
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    roll = r.random()
    hangs = False  # the server rightly waits for a body that never comes
    if roll < 0.1:  # a lying Content-Length
        head += f"Content-Length: {len(body) + r.randint(1, 50)}\r\n"
        hangs = True
    elif roll < 0.2:  # announced chunked, then not chunked
        head += "Transfer-Encoding: chunked\r\n"
        hangs = True
    elif roll < 0.25:
        head += "X-Big: " + "z" * 20000 + "\r\n"
    elif roll < 0.3:
        junk = bytes(r.getrandbits(8) for _ in range(r.randint(1, 300))) + b"\r\n\r\n"
        return junk, False
    else:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body, hangs


async def test_http_fuzz_never_drops_or_500s_and_errors_are_openai_shaped(caplog):
    engine = FakeEngine(ms_per_char=5)
    async with server(engine=engine) as (app, url):
        port = int(url.split(":")[2].split("/")[0])
        statuses: dict[int, int] = {}

        async def one(seed: int) -> None:
            r = random.Random(seed)
            request, hangs = http_abuse(r)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(request)
                await writer.drain()
                if hangs or r.random() < 0.1:
                    await asyncio.sleep(r.random() * 0.2)
                    return  # hang up without reading (mid-body, or mid-response)
                async with asyncio.timeout(10):
                    data = await reader.read(-1)
            finally:
                writer.close()
            if not data:
                # only requests that are not HTTP at all (or lie about their body) may be
                # dropped without an answer
                return
            status_line, _, rest = data.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 "), status_line[:80]
            status = int(status_line.split()[1])
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500 or status == 503, (request[:200], data[:300])
            head, _, body = rest.partition(b"\r\n\r\n")
            path = request.split(b" ")[1] if request.count(b" ") > 1 else b""
            if (status >= 400 and path.startswith(b"/v1/") and not path.startswith(b"/v1/stream")
                    and not request.startswith(b"HEAD ")
                    and b"application/json" in head.lower() and b"chunked" not in head.lower()):
                err = json.loads(body)["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]

        for round_ in range(6):
            await asyncio.gather(*(one(round_ * 1000 + i) for i in range(40)))
        assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
        # still healthy, nothing left running
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.read(-1)).startswith(b"HTTP/1.1 200")
        writer.close()
        for _ in range(100):
            if app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0:
                break
            await asyncio.sleep(0.05)
        assert app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0
        async with client(url) as c:
            await c.send(type="start", context_id="good")
            await c.send(type="text", context_id="good", text="Still here.")
            await c.send(type="end", context_id="good")
            assert (await c.until("done", "good"))["segments"] == 1
    tracebacks = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not tracebacks, tracebacks[0].getMessage()
    print(f"http fuzz statuses: {statuses}")


# -- the ElevenLabs-compatible sockets and HTTP streams, and the Wyoming listener -----------

EL_FIELDS = {"text": [" ", "", "Hello there. ", "你好，世界。", None, 5, [], "x" * 30000],
             "context_id": ["a", "b", "", None, 7, "c" * 200],
             "flush": [True, False, "yes", None], "close_context": [True, False, 1],
             "try_trigger_generation": [True, 0], "voice_settings": [{"speed": 1.1},
                                                                     {"speed": "x"}, 3, None],
             "generation_config": [{"chunk_length_schedule": [50]},
                                   {"chunk_length_schedule": [0, "x"]}, "no"],
             "xi_api_key": ["k", 5], "close_socket": [False, False, False, True]}
EL_QUERIES = ["", "?output_format=pcm_16000", "?output_format=mp3_44100_128",
              "?output_format=ulaw_8000", "?output_format=nope", "?inactivity_timeout=0",
              "?auto_mode=true&model_id=x&sync_alignment=true&apply_text_normalization=off"]


def el_message(r: random.Random) -> str | bytes:
    roll = r.random()
    if roll < 0.08:
        return bytes(r.getrandbits(8) for _ in range(r.randint(0, 40)))
    if roll < 0.16:
        return "".join(chr(r.randint(32, 0x2FFF)) for _ in range(r.randint(0, 40)))
    msg = {k: r.choice(v) for k, v in EL_FIELDS.items() if r.random() < 0.35}
    return json.dumps(msg)


async def test_elevenlabs_and_wyoming_fuzz_leave_server_healthy(caplog):
    from dataclasses import replace

    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    from helpers import base_config

    engine = FakeEngine(ms_per_char=5)
    closes: dict[int, int] = {}
    tried = 0
    async with server(replace(base_config(), wyoming_port=0), engine) as (app, url):
        port = int(url.split(":")[2].split("/")[0])

        async def socket_abuser(seed: int) -> int:
            r = random.Random(seed)
            kind = r.choice(["stream-input", "multi-stream-input"])
            voice = r.choice(["alloy", "21m00Tcm4TlvDq8ikWAM", "seed:5", "bad%20id!"])
            target = (f"ws://127.0.0.1:{port}/v1/text-to-speech/{voice}/{kind}"
                      + r.choice(EL_QUERIES))
            n, last, ws = 0, None, None
            try:
                async with connect(target, max_size=None, ping_interval=None) as ws:
                    for _ in range(r.randint(3, 30)):
                        n += 1
                        await ws.send(el_message(r))
                        if r.random() < 0.05:
                            ws.transport.abort()
                            return n
                        if r.random() < 0.3:
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout(0.02):
                                    last = json.loads(await ws.recv())
                    await ws.send(json.dumps({"close_socket": True}))
                    async with asyncio.timeout(10):
                        async for raw in ws:
                            last = json.loads(raw)
            except InvalidStatus as exc:  # a bad voice or query: refused at the handshake
                status = exc.response.status_code
                assert status in (400, 422), status
                assert json.loads(exc.response.body)["detail"]["message"]
                closes[status] = closes.get(status, 0) + 1
                return n
            except ConnectionClosed as exc:
                with contextlib.suppress(ConnectionClosed):
                    while ws is not None:  # messages that arrived before the close
                        last = json.loads(await ws.recv())
                code = exc.rcvd.code if exc.rcvd is not None else 1006
                closes[code] = closes.get(code, 0) + 1
                assert code in (1000, 1008, 1009), (code, last)
                if code == 1008:  # the error message came first, in ElevenLabs' shape
                    assert last is not None and last["code"] == 1008 and last["message"]
                return n
            closes[1000] = closes.get(1000, 0) + 1
            return n

        async def wyoming_abuser(seed: int) -> int:
            r = random.Random(seed)
            reader, writer = await asyncio.open_connection("127.0.0.1", app.wyoming.port)
            n = 0
            try:
                for _ in range(r.randint(3, 20)):
                    n += 1
                    roll = r.random()
                    if roll < 0.2:
                        line = bytes(r.getrandbits(8) for _ in range(r.randint(0, 60)))
                        writer.write(line.replace(b"\n", b"") + b"\n")
                    else:
                        kind = r.choice(["synthesize", "synthesize-start", "synthesize-chunk",
                                         "synthesize-stop", "describe", "ping", "bogus"])
                        data = {k: r.choice(v) for k, v in {
                            "text": ["Hi there.", "", 5, None, "好。"],
                            "voice": [{"name": "alloy"}, {"name": "nobody"}, "x", None]}.items()
                            if r.random() < 0.7}
                        header: dict[str, object] = {"type": kind, "data": data}
                        if r.random() < 0.1:
                            header["data_length"] = r.choice([-1, "x", 5])
                        writer.write(json.dumps(header).encode() + b"\n")
                    await writer.drain()
                    if r.random() < 0.3:
                        await asyncio.sleep(0.01)
            except ConnectionError:
                pass
            finally:
                writer.close()
            return n

        for round_ in range(3):
            counts = await asyncio.gather(
                *(socket_abuser(round_ * 100 + i) for i in range(20)),
                *(wyoming_abuser(round_ * 100 + i) for i in range(10)))
            tried += sum(counts)
        # well-behaved clients are still served
        async with connect(f"ws://127.0.0.1:{port}/v1/text-to-speech/alloy/stream-input"
                           "?output_format=pcm_24000") as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": "Still here after the storm."}))
            await ws.send(json.dumps({"text": ""}))
            finals = [json.loads(m) for m in [m async for m in ws]]
            assert finals[-1] == {"isFinal": True}
        async with AsyncTcpClient("127.0.0.1", app.wyoming.port) as wc:
            await wc.write_event(Synthesize(text="Still here.").event())
            while (event := await asyncio.wait_for(wc.read_event(), 10)).type != "audio-stop":
                assert event.type in ("audio-start", "audio-chunk")
        for _ in range(100):
            if (not app.elevenlabs.sockets and not app.wyoming.connections
                    and app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0):
                break
            await asyncio.sleep(0.05)
        assert not app.elevenlabs.sockets and not app.wyoming.connections
        assert app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0
    tracebacks = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not tracebacks, tracebacks[0].getMessage()
    print(f"elevenlabs/wyoming fuzz: {tried} inputs, socket closes {closes}")
    assert tried > 300 and closes.get(1008, 0) > 5


CARTESIA_FIELDS = {
    "context_id": ["a", "b", "", None, 5, "x" * 300],
    "transcript": ["Hi there. ", "", " ", None, 7, "好。", "z" * 3000],
    "voice": [{"mode": "id", "id": "a0e99841-438c-4a64-b679-ae501e7d6091"},
              {"mode": "id", "id": "bad voice!"}, {"mode": "embedding", "embedding": [0.1]},
              {"mode": "clone"}, "alloy", None],
    "output_format": [{"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
                      {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16000},
                      {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000},
                      {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 24000},
                      {"container": "mp3"}, None, []],
    "continue": [True, False, "yes", None],
    "flush": [True, False, 1],
    "cancel": [True, False],
    "add_timestamps": [True, False, "x"],
    "max_buffer_delay_ms": [0, 50, -1, 10**9, "x"],
    "generation_config": [{"speed": 1.2}, {"speed": 99}, {"speed": "fast"}, 3, None],
    "model_id": ["sonic-3", None, 4],
}
DEEPGRAM_MESSAGES = [{"type": "Speak", "text": "Hello there. "}, {"type": "Speak", "text": 5},
                     {"type": "Speak", "text": "x" * 3000}, {"type": "Flush"},
                     {"type": "Clear"}, {"type": "Bogus"}, {"type": "Speak"}, [], "x",
                     {"type": "Interrupt"}, {"type": "Configure", "speed": 1.1},
                     {"type": "Configure", "speed": "fast"}]
DEEPGRAM_QUERIES = ["?model=aura-2-thalia-en", "?encoding=mulaw", "?encoding=mp3",
                    "?sample_rate=123", "?model=bad%20model!", "", "?speed=nan",
                    "?encoding=linear16&sample_rate=16000&speed=1.2"]


async def test_cartesia_and_deepgram_socket_fuzz_leave_server_healthy(caplog):
    engine = FakeEngine(ms_per_char=5)
    closes: dict[int, int] = {}
    refused = tried = 0
    async with server(engine=engine) as (app, url):
        port = int(url.split(":")[2].split("/")[0])

        def cartesia_message(r: random.Random) -> str:
            if r.random() < 0.1:
                return "".join(chr(r.randint(32, 0x2FFF)) for _ in range(r.randint(0, 40)))
            msg = {k: r.choice(v) for k, v in CARTESIA_FIELDS.items() if r.random() < 0.6}
            return json.dumps(msg)

        async def abuser(seed: int) -> int:
            nonlocal refused
            r = random.Random(seed)
            deepgram = r.random() < 0.5
            target = (f"ws://127.0.0.1:{port}" + r.choice(["/v1/speak", "/v2/speak"])
                      + r.choice(DEEPGRAM_QUERIES)
                      if deepgram else f"ws://127.0.0.1:{port}/tts/websocket")
            n, ws = 0, None
            try:
                async with connect(target, max_size=None, ping_interval=None) as ws:
                    for _ in range(r.randint(3, 25)):
                        n += 1
                        if deepgram:
                            await ws.send(json.dumps(r.choice(DEEPGRAM_MESSAGES)))
                        else:
                            await ws.send(cartesia_message(r))
                        if r.random() < 0.05:
                            await ws.send(b"\x00\x01")
                        if r.random() < 0.05:
                            ws.transport.abort()
                            return n
                        if r.random() < 0.3:
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout(0.02):
                                    raw = await ws.recv()
                                    if isinstance(raw, str):
                                        msg = json.loads(raw)
                                        assert msg["type"] in (
                                            "chunk", "timestamps", "flush_done", "done",
                                            "error", "Metadata", "Flushed", "Cleared",
                                            "Warning", "Error", "Connected",
                                            "SpeechStarted", "SpeechMetadata",
                                            "SpeechInterrupted", "ConfigureSuccess",
                                            "ConfigureFailure"), msg
                    if deepgram:
                        await ws.send(json.dumps({"type": "Close"}))
                        async with asyncio.timeout(10):
                            async for _ in ws:
                                pass
            except InvalidStatus as exc:
                assert exc.response.status_code == 400, exc.response.status_code
                refused += 1
                return n
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else 1006
                closes[code] = closes.get(code, 0) + 1
                assert code in (1000, 1008), code
                return n
            closes[1000] = closes.get(1000, 0) + 1
            return n

        for round_ in range(3):
            tried += sum(await asyncio.gather(*(abuser(round_ * 100 + i) for i in range(20))))
        # well-behaved clients are still served
        async with connect(f"ws://127.0.0.1:{port}/tts/websocket") as ws:
            await ws.send(json.dumps({"context_id": "ok", "transcript": "Still here.",
                                      "voice": {"mode": "id", "id": "seed:3"},
                                      "output_format": CARTESIA_FIELDS["output_format"][0]}))
            async with asyncio.timeout(10):
                while json.loads(await ws.recv())["type"] != "done":
                    pass
        async with connect(f"ws://127.0.0.1:{port}/v1/speak") as ws:
            await ws.send(json.dumps({"type": "Speak", "text": "Still here."}))
            await ws.send(json.dumps({"type": "Flush"}))
            async with asyncio.timeout(10):
                while not (isinstance(m := await ws.recv(), str)
                           and json.loads(m)["type"] == "Flushed"):
                    pass
        for _ in range(100):
            if (not app.cartesia.sockets and not app.deepgram.sockets
                    and app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0):
                break
            await asyncio.sleep(0.05)
        assert not app.cartesia.sockets and not app.deepgram.sockets
        assert app.scheduler.running_batches == 0 and app.scheduler.queue_depth == 0
    tracebacks = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not tracebacks, tracebacks[0].getMessage()
    print(f"cartesia/deepgram fuzz: {tried} inputs, {refused} refused upgrades, closes {closes}")
    assert tried > 200 and refused > 3
