"""Long-text jobs: the pure splitter, the scheduler's background class (fake engine in
continuous mode, a documented test double), and the job API, workers and queue against a
real redis-server: in-process servers, ``rtts worker`` processes (one SIGKILLed mid-job),
the ``rtts job`` CLI, and the real ChatTTS code on the tiny random checkpoint."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import base_config, server
from procs import free_port, start_rtts, wait_http
from rtts.api.auth import AuthConfig
from rtts.config import EngineConfig
from rtts.core.params import SynthParams
from rtts.core.scheduler import BACKGROUND, Preempted, Scheduler, SchedulerConfig
from rtts.engines.base import SynthRequest
from rtts.engines.fake import FakeEngine
from rtts.jobs.model import JobsConfig, JobSplitter, eta_seconds, parse_chapters
from rtts.jobs.store import JobStore
from rtts.server import bound_port
from rtts.text import SpokenText

TEXT = ("The old lighthouse keeper climbed the stairs every evening. He counted them, "
        "one hundred and twelve, and never once lost his place! The lamp was heavy; the "
        "oil was cold. Ships passed in the dark, and none of them knew his name. ")


# -- pure ------------------------------------------------------------------------------


def test_splitter_covers_the_text_in_order_across_any_byte_split():
    text = (TEXT + "你好，世界。这是一个很长的句子，用来测试分段。") * 5
    data = text.encode()
    splitter = JobSplitter(max_chars=200, min_chars=120)
    chunks = []
    for i in range(0, len(data), 7):  # splits inside multi-byte characters
        chunks += splitter.feed_bytes(data[i:i + 7])
    chunks += splitter.finish()
    assert splitter.chars == len(text) and splitter.segments == len(chunks)
    assert all(0 < len(c.text) <= 200 for c in chunks)
    assert [c.start for c in chunks[1:]] >= [c.end for c in chunks[:-1]]
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")


def test_chapters_cut_segments_and_map_to_segment_ranges():
    marks = [len(TEXT), {"start": 2 * len(TEXT) + 10, "title": "Three"}]
    splitter = JobSplitter(parse_chapters(marks), max_chars=200, min_chars=120)
    chunks = splitter.feed(TEXT * 3) + splitter.finish()
    table = splitter.chapter_table()
    assert [c.start for c in table] == [0, len(TEXT), 2 * len(TEXT) + 10]
    assert table[2].title == "Three"
    for c in table[1:]:  # no segment spans a mark; the chapter starts with a segment
        assert chunks[c.first_segment].start >= c.start
        assert chunks[c.first_segment - 1].end <= c.start


@pytest.mark.parametrize("bad", [[-1], ["x"], [True], [{"start": "3"}]])
def test_bad_chapter_marks_are_refused(bad):
    with pytest.raises(ValueError):
        parse_chapters(bad)


def test_eta_follows_the_average_rate():
    assert eta_seconds(10, 0, 100.0, 150.0) is None
    assert eta_seconds(10, 5, 100.0, 150.0) == 50.0
    assert eta_seconds(10, 10, 100.0, 150.0) == 0.0


# -- the scheduler's background class (continuous batching) ------------------------------


async def collect(stream):
    return np.concatenate([c async for c in stream] or [np.zeros(0, np.float32)])


def bg(text: str) -> SynthRequest:
    return SynthRequest(text, SynthParams(), priority=BACKGROUND)


async def test_background_rows_give_their_slot_to_a_live_stream_at_the_next_step():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)  # 100 ms steps
    sched = Scheduler(engine, SchedulerConfig(max_batch_size=4, max_wait_ms=10,
                                              first_segment_slots=0,
                                              background_rows_with_live=4))
    await sched.start()
    jobs = [sched.submit(bg("j" * 60)) for _ in range(4)]  # 3 s each, every slot
    await asyncio.sleep(0.35)
    assert all(s.first_audio_at is not None for s in jobs)
    assert sched.queue_depth == 0  # background is not load
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    live = sched.submit(SynthRequest("l" * 10, SynthParams(), priority=0))
    await live.__anext__()
    assert loop.time() - t0 < 0.35  # one step or two, not the 2.6 s left of the jobs
    preempted = [s for s in jobs if s.finished]
    assert len(preempted) == 1 and sched.preempted == 1
    with pytest.raises(Preempted):
        await collect(preempted[0])
    others = [s for s in jobs if s is not preempted[0]]
    await asyncio.gather(collect(live), *(collect(s) for s in others))
    # re-run from the start, it completes whole
    again = sched.submit(bg("j" * 60))
    assert len(await collect(again)) == engine.total_samples("j" * 60)
    await sched.stop()


async def test_beside_live_rows_a_batch_keeps_few_background_rows():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, continuous=True)
    sched = Scheduler(engine, SchedulerConfig(max_batch_size=8, max_wait_ms=10))
    await sched.start()
    assert sched.background_cap == 2 and sched.reserve == 3
    jobs = [sched.submit(bg("j" * 40)) for _ in range(8)]
    await asyncio.sleep(0.35)
    assert sum(s.first_audio_at is not None for s in jobs) == 5  # the reserve stays free
    live = sched.submit(SynthRequest("l" * 30, SynthParams(), priority=0))
    await live.__anext__()
    running = [s for s in jobs if s.first_audio_at is not None and not s.finished]
    assert sched.preempted == 3 and len(running) == 2  # 5 - cap
    await asyncio.sleep(0.5)  # the live row has audio: still at most the cap beside it
    assert sum(1 for s in jobs if s.admitted_at is not None and not s.finished) <= 2
    await collect(live)
    await sched.stop()


async def test_background_takes_only_slots_nobody_live_wants():
    engine = FakeEngine(ms_per_char=50, rtf=1.0, first_chunk_latency_ms=300, continuous=True)
    sched = Scheduler(engine, SchedulerConfig(max_batch_size=4, max_wait_ms=10))
    await sched.start()
    assert sched.reserve == 1
    first = sched.submit(SynthRequest("f" * 10, SynthParams(), priority=0))
    jobs = [sched.submit(bg("j" * 10)) for _ in range(4)]
    await collect(first)
    # none joined while the first segment warmed up; then 3 of 4 (one slot kept free)
    assert all(s.admitted_at is None or s.admitted_at >= first.first_audio_at for s in jobs)
    assert max(engine.batches) <= 3 + 1
    await asyncio.gather(*(collect(s) for s in jobs))
    await sched.stop()


# -- the job API with in-process servers and a real redis-server --------------------------


def http(method: str, url: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


async def ahttp(*args: Any, **kw: Any) -> tuple[int, dict[str, str], Any]:
    status, headers, body = await asyncio.to_thread(http, *args, **kw)
    if headers.get("Content-Type", "").startswith("application/json"):
        return status, headers, json.loads(body)
    return status, headers, body


def jobs_config(redis_url: str, tmp_path: Path, **kw: Any) -> JobsConfig:
    # a prefix per test: the session's redis-server is shared
    return JobsConfig(redis_url=redis_url, dir=tmp_path / "jobs", prefix=f"t{time.time_ns()}",
                      **kw)


async def wait_state(base: str, job: str, states: tuple[str, ...], timeout: float = 30,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        _, _, st = await ahttp("GET", f"{base}/v1/jobs/{job}", headers=headers)
        if st["state"] in states or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.1)


async def expected_samples(store: JobStore, job: str, engine: FakeEngine) -> list[int]:
    """What the fake engine makes of each stored segment text (after normalization)."""
    n = int((await store.get(job)).total)  # type: ignore[union-attr]
    texts = [await store.segment_text(job, i) for i in range(n)]
    return [engine.total_samples(SpokenText()(t or "")) for t in texts]


async def test_job_completes_and_its_audio_is_the_sum_of_its_segments(redis_url, tmp_path):
    engine = FakeEngine(ms_per_char=5, continuous=True)
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True))
    text = TEXT * 12  # ~2,600 characters
    marks = f"0,{len(TEXT) * 6}"
    async with server(cfg, engine) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        status, headers, st = await ahttp(
            "POST", f"{base}/v1/jobs?format=wav&voice=seed:3&chapters={marks}",
            text.encode(), {"Content-Type": "text/plain"})
        assert status == 202 and headers["Location"] == f"/v1/jobs/{st['id']}"
        assert st["characters"] == len(text) and st["segments_total"] >= 12
        done = await wait_state(base, st["id"], ("done", "failed"))
        assert done["state"] == "done" and done["segments_done"] == done["segments_total"]
        assert done["eta_seconds"] == 0.0
        status, _, body = await ahttp("GET", f"{base}/v1/jobs/{st['id']}/audio")
        assert status == 200
        with wave.open(io.BytesIO(body)) as w:
            frames = w.getnframes()
            assert w.getframerate() == 24000
        per_segment = await expected_samples(app.jobs, st["id"], engine)  # type: ignore[arg-type]
        assert frames == sum(per_segment) == round(done["audio_seconds"] * 24000)
        # each chapter is its own file; together they are the whole
        sizes = []
        for ch in done["chapters"]:
            _, _, part = await ahttp("GET", f"{base}{ch['audio_url']}")
            with wave.open(io.BytesIO(part)) as w:
                sizes.append(w.getnframes())
        assert sum(sizes) == frames and len(sizes) == 2 and all(sizes)
        assert app.job_worker is not None and app.job_worker.stats.segments == len(per_segment)
        _, _, metrics = await ahttp("GET", f"{base}/metrics")
        text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
        assert f'rtts_job_segments_total{{outcome="stored"}} {len(per_segment)}' in text
        assert "rtts_job_segments_running 0" in text


async def test_download_follows_a_running_job_and_mp3_plays(redis_url, tmp_path):
    import av

    engine = FakeEngine(ms_per_char=20, rtf=0.05, continuous=True)
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True))
    async with server(cfg, engine) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        _, _, st = await ahttp("POST", f"{base}/v1/jobs", json.dumps(
            {"text": TEXT * 4, "format": "mp3"}).encode(), {"Content-Type": "application/json"})
        status, headers, body = await ahttp("GET", f"{base}/v1/jobs/{st['id']}/audio")
        assert status == 200 and headers["Content-Type"] == "audio/mpeg"
        done = await wait_state(base, st["id"], ("done",))
        assert done["state"] == "done"
        with av.open(io.BytesIO(body)) as f:
            decoded = sum(fr.samples for fr in f.decode(audio=0))
        # every segment, in order (MP3 adds encoder padding per segment)
        assert decoded >= done["audio_seconds"] * 24000


async def test_live_stream_first_while_a_job_fills_the_batch(redis_url, tmp_path):
    from helpers import client

    engine = FakeEngine(ms_per_char=60, rtf=1.0, continuous=True)
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True),
                      scheduler=SchedulerConfig(max_batch_size=2, max_wait_ms=5,
                                                first_segment_slots=0))
    async with server(cfg, engine) as (app, url):
        base = f"http://127.0.0.1:{bound_port(app)}"
        _, _, st = await ahttp("POST", f"{base}/v1/jobs?format=pcm16", (TEXT * 4).encode())
        await wait_state(base, st["id"], ("running",))
        await asyncio.sleep(0.5)  # both slots are the job's now
        assert app.job_worker is not None and app.job_worker.stats.busy == 2
        async with client(url) as c:
            t0 = time.monotonic()
            await c.send(type="start", context_id="live")
            await c.send(type="text", context_id="live", text="Hello there.")
            await c.send(type="end", context_id="live")
            while not isinstance(await c.ws.recv(), bytes):
                pass
            ttfa = time.monotonic() - t0
            await c.until("done", "live")
        assert app.scheduler.preempted >= 1
        assert ttfa < 1.5
        await ahttp("DELETE", f"{base}/v1/jobs/{st['id']}")


async def test_cancel_stops_the_job_and_removes_its_audio(redis_url, tmp_path):
    engine = FakeEngine(ms_per_char=60, rtf=1.0, continuous=True)
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True))
    async with server(cfg, engine) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        _, _, st = await ahttp("POST", f"{base}/v1/jobs?format=pcm16", (TEXT * 10).encode())
        running = await wait_state(base, st["id"], ("running",))
        assert running["state"] == "running"
        status, _, cancelled = await ahttp("DELETE", f"{base}/v1/jobs/{st['id']}")
        assert status == 200 and cancelled["state"] == "cancelled"
        await asyncio.sleep(0.6)  # the worker notices within its housekeeping period
        worker = app.job_worker
        assert worker is not None and worker.stats.busy == 0
        assert app.scheduler.running_batches == 0 or app.scheduler.queue_depth == 0
        assert not (tmp_path / "jobs" / st["id"]).exists() or not any(
            (tmp_path / "jobs" / st["id"]).iterdir())
        status, _, err = await ahttp("GET", f"{base}/v1/jobs/{st['id']}/audio")
        assert status == 409 and err["error"]["code"] == "job_cancelled"
        status, _, _ = await ahttp("DELETE", f"{base}/v1/jobs/{st['id']}")
        assert status == 204  # a finished (here: cancelled) job is forgotten
        status, _, _ = await ahttp("GET", f"{base}/v1/jobs/{st['id']}")
        assert status == 404


async def test_auth_and_quota_on_every_job_endpoint(redis_url, tmp_path):
    engine = FakeEngine(ms_per_char=60, rtf=1.0, continuous=True)
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True),
                      auth=AuthConfig(api_keys=("key-a", "key-b"), max_sessions_per_key=1))
    a = {"Authorization": "Bearer key-a"}
    b = {"Authorization": "Bearer key-b"}
    async with server(cfg, engine) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        status, _, err = await ahttp("POST", f"{base}/v1/jobs", TEXT.encode())
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, _, st = await ahttp("POST", f"{base}/v1/jobs?format=pcm16", TEXT.encode() * 6,
                                    headers=a)
        assert status == 202
        job = st["id"]
        for method, path in (("GET", ""), ("GET", "/audio"), ("DELETE", "")):
            status, _, _ = await ahttp(method, f"{base}/v1/jobs/{job}{path}")
            assert status == 401, (method, path)
            status, _, err = await ahttp(method, f"{base}/v1/jobs/{job}{path}", headers=b)
            assert status == 404, (method, path)  # another key's job does not exist for b
        # quota: key-a may hold one session; a download following the running job holds it
        download = asyncio.create_task(ahttp("GET", f"{base}/v1/jobs/{job}/audio", headers=a))
        await asyncio.sleep(0.3)
        for method, path, body in (("POST", "", TEXT.encode()), ("GET", f"/{job}", None),
                                   ("GET", f"/{job}/audio", None), ("DELETE", f"/{job}", None)):
            status, headers, err = await ahttp(method, f"{base}/v1/jobs{path}", body, headers=a)
            assert status == 429 and headers["Retry-After"], (method, path)
        status, _, _ = await ahttp("DELETE", f"{base}/v1/jobs/{job}", headers=b)
        assert status == 404
        kid = app.auth.key_from_header(a["Authorization"])
        assert kid is not None and app.auth.active[kid] == 1  # the download's session
        app.auth.release(kid)  # let the cancel through while the download runs
        status, _, st = await ahttp("DELETE", f"{base}/v1/jobs/{job}", headers=a)
        assert status == 200 and st["state"] == "cancelled"
        status, _, _ = await download
        assert status == 200  # it ended where the job was cancelled


@pytest.mark.parametrize("request_, status, code", [
    (("", {}), 400, "empty_text"),
    ((" \n ... \n", {}), 400, "empty_text"),
    (("Hello.", {"voice": "no-such-voice"}), 404, "unknown_voice"),
    (("Hello.", {"format": "opus"}), 400, "invalid_format"),
    (("Hello.", {"chapters": "1,x"}), 400, None),
    (("x" * 3000, {}), 413, "body_too_large"),
    ((b"\xff\xfe not utf-8", {}), 400, "invalid_text"),
])
async def test_bad_input_gets_a_clear_4xx(redis_url, tmp_path, request_, status, code):
    import urllib.parse

    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, max_upload_bytes=2000))
    text, query = request_
    async with server(cfg, FakeEngine()) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        body = text if isinstance(text, bytes) else text.encode()
        got, _, err = await ahttp("POST", f"{base}/v1/jobs?{urllib.parse.urlencode(query)}",
                                  body, {"Content-Type": "text/plain"})
        assert got == status and err["error"]["message"]
        if code is not None:
            assert err["error"]["code"] == code
        got, _, err = await ahttp("POST", f"{base}/v1/jobs", b"{not json",
                                  {"Content-Type": "application/json"})
        assert got == 400 and err["error"]["code"] == "invalid_json"
        # absurd JSON numbers (found by the schemathesis fuzz: these were 500s)
        for field, value in (("top_K", 3925946075093535448788161789952), ("seed", True),
                             ("temperature", [1]), ("voice", 5), ("sample_rate", 1e300)):
            got, _, err = await ahttp(
                "POST", f"{base}/v1/jobs", json.dumps({"text": "Hi.", field: value}).encode(),
                {"Content-Type": "application/json"})
            assert got == 400 and err["error"]["param"] == field, (field, got, err)
        got, _, err = await ahttp("GET", f"{base}/v1/jobs/nope")
        assert got == 404


async def test_cli_submit_shows_progress_and_downloads(redis_url, tmp_path):
    engine = FakeEngine(ms_per_char=20, rtf=0.02, continuous=True)
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True),
                      auth=AuthConfig(api_keys=("cli-key",)))
    book = tmp_path / "book.txt"
    book.write_text("Chapter 1\n" + TEXT * 2 + "\nChapter 2\n" + TEXT, encoding="utf-8")
    async with server(cfg, engine) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rtts", "job", "--url", base, "submit", str(book),
            "--format", "wav", "--voice", "seed:4", "--chapters", "headings",
            "-o", str(tmp_path / "book.wav"), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "RTTS_API_KEY": "cli-key"})
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        job = out.decode().strip()
        lines = err.decode().splitlines()
        assert any("segments" in line and "done" in line for line in lines)
        st = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "rtts", "job", "--url", base, "--api-key", "cli-key",
            "status", job], capture_output=True, text=True, timeout=30)
        status = json.loads(st.stdout)
        assert status["state"] == "done" and len(status["chapters"]) == 2
        with wave.open(str(tmp_path / "book.wav")) as w:
            assert w.getnframes() == round(status["audio_seconds"] * 24000)


async def test_a_million_characters_upload_as_a_stream(redis_url, tmp_path):
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path))  # no worker: only the upload
    text = TEXT * (1_000_000 // len(TEXT) + 1)

    def chunks():  # a chunked upload: no Content-Length, read as it arrives
        data = text.encode()
        for i in range(0, len(data), 64 * 1024):
            yield data[i:i + 64 * 1024]

    async with server(cfg, FakeEngine()) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        t0 = time.monotonic()
        status, _, st = await ahttp("POST", f"{base}/v1/jobs?format=mp3", chunks(),
                                    {"Content-Type": "text/plain"})
        assert status == 202 and st["characters"] == len(text) >= 1_000_000
        assert st["state"] == "queued" and st["segments_total"] > 5000
        assert time.monotonic() - t0 < 30
        store = app.jobs
        assert store is not None
        assert await store.redis.xlen(store.queue_of("anonymous")) >= st["segments_total"]
        status, _, _ = await ahttp("DELETE", f"{base}/v1/jobs/{st['id']}")
        assert status == 200


async def test_unreachable_queue_is_a_503_not_a_crash(tmp_path):
    cfg = base_config(jobs=JobsConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0",
                                      dir=tmp_path / "jobs"))
    async with server(cfg, FakeEngine()) as (app, _):
        base = f"http://127.0.0.1:{bound_port(app)}"
        status, headers, err = await ahttp("POST", f"{base}/v1/jobs", b"Hello there.")
        assert status == 503 and err["error"]["code"] == "queue_unavailable"
        assert headers["Retry-After"]
        status, _, err = await ahttp("GET", f"{base}/v1/jobs/{'0' * 32}")  # a job id
        assert status == 503


# -- worker processes: one killed mid-job, the CLI ---------------------------------------


def start_worker(redis: str, jobs_dir: Path, log: Path, consumer: str) -> subprocess.Popen[bytes]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rtts", "worker", "--host", "127.0.0.1", "--port", str(port),
         "--engine", "fake", "--fake-rtf", "0.1", "--max-batch-size", "2",
         "--jobs-redis", redis, "--jobs-dir", str(jobs_dir), "--jobs-claim-idle", "1.5",
         "--instance-id", consumer], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return proc


def test_sigkilled_worker_job_finished_by_another_no_segment_lost_or_doubled(redis_url,
                                                                             tmp_path):
    jobs_dir = tmp_path / "jobs"
    db = redis_url.rsplit("/", 1)[0] + "/3"  # a database of its own (default prefix)
    import redis

    redis.Redis.from_url(db).flushdb()
    api_port = free_port()
    book = tmp_path / "book.txt"
    book.write_text("# One\n" + TEXT * 4 + "\n# Two\n" + TEXT * 4, encoding="utf-8")
    with start_rtts(["--engine", "fake", "--jobs-redis", db, "--jobs-dir", str(jobs_dir)],
                    api_port, tmp_path / "api.log"):
        base = f"http://127.0.0.1:{api_port}"
        out = subprocess.run(
            [sys.executable, "-m", "rtts", "job", "--url", base, "submit", str(book),
             "--format", "wav", "--chapters", "headings", "--no-wait"],
            capture_output=True, text=True, timeout=60, check=True)
        job = out.stdout.strip()
        worker_a = start_worker(db, jobs_dir, tmp_path / "a.log", "worker-a")
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = json.loads(http("GET", f"{base}/v1/jobs/{job}")[2])
                if st["segments_done"] >= 2:
                    break
                time.sleep(0.1)
            worker_a.send_signal(signal.SIGKILL)
            worker_a.wait()
        finally:
            if worker_a.poll() is None:
                worker_a.kill()
        st = json.loads(http("GET", f"{base}/v1/jobs/{job}")[2])
        total = st["segments_total"]
        assert 2 <= st["segments_done"] < total and st["state"] == "running"
        worker_b = start_worker(db, jobs_dir, tmp_path / "b.log", "worker-b")
        try:
            out = subprocess.run(
                [sys.executable, "-m", "rtts", "job", "--url", base, "download", job,
                 "-o", str(tmp_path / "book.wav")], capture_output=True, text=True,
                timeout=120, check=True)
        finally:
            worker_b.send_signal(signal.SIGTERM)
            worker_b.wait(15)
        st = json.loads(http("GET", f"{base}/v1/jobs/{job}")[2])
        assert st["state"] == "done" and st["segments_done"] == total
        assert len(st["chapters"]) == 2

    async def check() -> None:
        store = JobStore(JobsConfig(redis_url=db, dir=jobs_dir))
        try:
            log = await store.log(job)
            per_segment = await expected_samples(store, job, FakeEngine(ms_per_char=60))
        finally:
            await store.aclose()
        by_a = {s for s, c in log if c == "worker-a"}
        by_b = [s for s, c in log if c == "worker-b"]
        assert by_a and by_b and sorted(by_a | set(by_b)) == list(range(total))
        assert len(by_b) == len(set(by_b)) and not by_a & set(by_b)  # nothing stored twice
        # the download (it followed the job while B finished it) has every segment once
        data = (tmp_path / "book.wav").read_bytes()
        with wave.open(io.BytesIO(data)) as w:
            assert w.getframerate() == 24000
        assert (len(data) - 44) // 2 == sum(per_segment)  # streamed: header sizes unknown

    asyncio.run(check())
    assert "took over" in (tmp_path / "b.log").read_text()


# -- the worker Deployment ----------------------------------------------------------------


def test_worker_manifest_runs_a_worker_on_the_shared_volume(monkeypatch):
    import yaml

    from rtts.cli.main import build_parser, config_from_args

    path = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "rtts-workers.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    monkeypatch.setenv("RTTS_JOBS_REDIS", env["RTTS_JOBS_REDIS"])
    args = build_parser().parse_args(c["args"])
    cfg = config_from_args(args)
    assert args.command == "worker" and cfg.jobs.worker
    assert cfg.jobs.redis_url == env["RTTS_JOBS_REDIS"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert str(cfg.jobs.dir) == mounts["jobs"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]}
    pvc = docs["PersistentVolumeClaim"]
    assert claims["jobs"] == pvc["metadata"]["name"] and "ReadWriteMany" in pvc["spec"][
        "accessModes"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert cfg.port == c["ports"][0]["containerPort"]
    assert cfg.shutdown_grace_s + cfg.close_timeout_s < spec["terminationGracePeriodSeconds"]


# -- the bench ----------------------------------------------------------------------------


def test_jobs_bench_reports_ttfa_with_and_without_a_job_and_rss(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server not installed")
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "rtts", "--log-level", "WARNING", "bench", "jobs",
                    "--arrivals", "2", "--gap", "0.3", "--job-chars", "2000", "--slots", "4",
                    "--long-seconds", "4", "--sample-s", "0.5", "--repeat", "1",
                    "--json", str(out)], check=True, timeout=120, capture_output=True)
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert len(run["ttfa_no_job_s"]) == len(run["ttfa_with_job_s"]) == 2
    assert all(t > 0 for t in run["ttfa_no_job_s"] + run["ttfa_with_job_s"])
    assert run["preempted"] >= 1  # the live clients took slots from the job
    long = result["long_job"]
    assert long["segments_done"] >= 1 and long["throughput_audio_s_per_s"] > 0
    assert len(long["series"]) >= 4 and long["rss_mb_final"] > 0


# -- the real ChatTTS code ---------------------------------------------------------------


@pytest.mark.chattts
async def test_job_on_the_tiny_random_checkpoint(redis_url, tmp_path, tiny_checkpoint):
    cfg = base_config(jobs=jobs_config(redis_url, tmp_path, worker=True))
    cfg = replace(cfg, engine=EngineConfig(source="custom", model_dir=tiny_checkpoint,
                                           threads=2, max_new_token=24))
    text = (TEXT * 10)[:2000]
    async with server(cfg, engine=None) as (app, _):
        assert app.state == "ready", app.state_reason
        base = f"http://127.0.0.1:{bound_port(app)}"
        _, _, st = await ahttp("POST", f"{base}/v1/jobs?format=wav&voice=seed:2",
                               text.encode())
        done = await wait_state(base, st["id"], ("done", "failed"), timeout=240)
        assert done["state"] == "done", done
        _, _, body = await ahttp("GET", f"{base}/v1/jobs/{st['id']}/audio")
        with wave.open(io.BytesIO(body)) as w:
            frames = w.getnframes()
            audio = np.frombuffer(w.readframes(frames), "<i2")
        store = app.jobs
        assert store is not None
        seg_samples = await store.samples_of(st["id"], range(done["segments_total"]))
        assert frames == seg_samples > 0 and np.abs(audio).max() > 0
        assert done["segments_total"] >= 10


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    os.environ.setdefault("no_proxy", "127.0.0.1")


async def test_a_segment_finishing_after_its_job_was_cancelled_is_dropped_quietly(
        redis_url, tmp_path, monkeypatch):
    """Found by the schemathesis fuzz: DELETE removed the job's directory while a worker
    wrote a segment into it, and the worker logged a FileNotFoundError traceback and
    retried. The store now answers -1 (job gone) and leaves no directory behind."""
    store = JobStore(jobs_config(redis_url, tmp_path))
    try:
        await store.begin("j1", "anonymous", "wav", 24000, {})
        assert await store.cancel("j1")
        path = store.segment_path("j1", 0, "wav")
        assert not path.parent.exists()
        import rtts.jobs.store as store_mod

        def racing_write(p: Path, data: bytes, consumer: str) -> None:
            raise FileNotFoundError(2, "No such file or directory", str(p))

        with monkeypatch.context() as m:
            m.setattr(store_mod, "_write_atomic", racing_write)  # the rmtree lands mid-write
            assert await store.store_segment("j1", 0, "wav", b"x" * 10, 5, "w1") == -1
        assert await store.store_segment("j1", 0, "wav", b"x" * 10, 5, "w1") == -1
        assert not path.parent.exists()  # written, refused, removed with its directory
    finally:
        await store.aclose()


async def test_cancel_tries_again_when_a_worker_writes_the_job_meanwhile(
        redis_url, tmp_path, monkeypatch):
    """Found in CI: a worker wrote the job (its progress) between cancel's watched read
    and its transaction, the transaction aborted (WatchError) and DELETE answered 503. The
    cancel now reads and writes again."""
    store = JobStore(jobs_config(redis_url, tmp_path))
    other = store.redis.client()  # another connection: the worker's
    try:
        await store.begin("j1", "anonymous", "wav", 24000, {})
        real = store.redis.pipeline
        raced: list[int] = []

        def pipeline(*args, **kwargs):
            pipe = real(*args, **kwargs)
            hget = pipe.hget

            async def racing_hget(*a):
                out = await hget(*a)
                if not raced:  # the worker writes between the read and the transaction
                    raced.append(1)
                    await other.hset(store.key("j1"), "progress", 1)
                return out

            pipe.hget = racing_hget
            return pipe

        monkeypatch.setattr(store.redis, "pipeline", pipeline)
        assert await store.cancel("j1")
        assert raced == [1]
        assert (await store.redis.hget(store.key("j1"), "state")).decode() == "cancelled"
        assert not await store.cancel("j1")  # final now
    finally:
        await other.aclose()
        await store.aclose()
