"""``rtts bench``: real WebSocket clients against a real rtts server, measured side by side.

Two modes:

``rtts bench chattts --model-dir DIR``
    Starts two servers in one process, each with its own copy of the checkpoint: a
    serialized baseline (an unmodified ``Chat`` serving stock ``Chat.infer(stream=True)``
    one request at a time, as the ChatTTS example API does) and rtts (cross-stream
    batching, early windowed decode). Their runs alternate, ``--repeat`` times per
    stream count, so drift in machine speed hits both. Prints time to first audio
    p50/p95, aggregate audio-seconds per wall-second, RTF and peak RSS (medians over the
    repeats) and the ratios. Every segment is forced to ``--tokens`` GPT steps so random
    weights give equal work in both runs.

``rtts bench soak --minutes 10``
    Starts ``rtts serve --engine fake`` in a subprocess and runs sessions back to back
    (``--concurrency`` at a time; every fifth cancelled mid-way, some phrases repeated so
    the cache is exercised) for ``--minutes``. Samples the server's RSS every
    ``--sample-s``, and reports its growth after the warm-up (the first ``--warmup``
    fraction of the time), errors, and whether anything leaked.

``rtts bench piper --voice-model PATH [--model-dir DIR]``
    How many streams the piper engine serves in real time: for each stream count, that
    many sessions at once each stream a paragraph; a stream is in real time when its time
    to first audio is under ``--ttfa-limit`` and no frame arrives later than playback
    started at its first frame would need it (``--late-limit``). No pacing, no cache. With
    ``--model-dir`` the same runs go to a ChatTTS server (rtts's engine, ``--tokens`` GPT
    steps per segment) in the same process, alternating with piper's.

``rtts bench jobs [--model-dir DIR]``
    One rtts server (ChatTTS on ``DIR``, else the fake engine) with a job worker, a
    redis-server started for the run. Live clients arriving one by one, alternately with
    no job and with a long-text job running in the background (``--repeat`` pairs): time to
    first audio of each, their ratio, and the job's progress meanwhile; then the job alone
    for ``--long-seconds``: its throughput and the server's RSS over time (flat).

``rtts bench fake --streams 200 --idle 1000``
    Starts ``rtts serve --engine fake`` (paced at real time) in a subprocess, runs
    ``--streams`` concurrent streaming sessions, and reads the server-added latency per
    frame (engine output -> socket) from ``/metrics``; then holds ``--idle`` idle
    connections open and checks they all still answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
from websockets.asyncio.client import connect

__all__ = ["add_parser", "run_bench"]

BENCH_TEXT = "Streaming speech should start quickly and keep flowing"


@dataclass
class StreamResult:
    ttfa_s: float
    audio_s: float
    wall_s: float


@dataclass
class LoadResult:
    name: str
    streams: int
    results: list[StreamResult]
    wall_s: float
    peak_rss_mb: float

    def row(self) -> dict[str, float]:
        ttfa = sorted(r.ttfa_s for r in self.results)
        audio = sum(r.audio_s for r in self.results)
        return {
            "ttfa_p50_s": statistics.median(ttfa),
            "ttfa_p95_s": ttfa[min(len(ttfa) - 1, int(0.95 * len(ttfa)))],
            "audio_s": audio,
            "wall_s": self.wall_s,
            "throughput": audio / self.wall_s,  # audio-seconds per wall-second
            "rtf": self.wall_s / (audio / self.streams),  # wall per stream's audio
            "peak_rss_mb": self.peak_rss_mb,
        }


class RssSampler:
    """Peak RSS of this process (and children), sampled on a thread."""

    def __init__(self, pid: int | None = None) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        total: int = self.proc.memory_info().rss
        for child in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssSampler:
        self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def one_stream(url: str, text: str, index: int, pieces: int = 1) -> StreamResult:
    """Open a session, stream ``text`` in ``pieces``, wait for ``done``."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()  # ready
        await ws.send(json.dumps({"type": "start", "voice": f"seed:{index % 5}", "seed": 1}))
        t0 = time.perf_counter()
        step = max(1, len(text) // pieces)
        for i in range(0, len(text), step):
            await ws.send(json.dumps({"type": "text", "text": text[i:i + step]}))
        await ws.send(json.dumps({"type": "end"}))
        first, audio, _ = await receive_audio(ws, index)
        return StreamResult(first - t0 if first else 0.0, audio, time.perf_counter() - t0)


async def receive_audio(ws: Any, index: int) -> tuple[float | None, float, float]:
    """Read one context's PCM16 frames until ``done``: the first frame's arrival
    (``perf_counter``, None if none came), the seconds of audio, and the worst lateness of
    a frame against playback started at the first frame."""
    first: float | None = None
    audio = late = 0.0
    rate = 24000
    while True:
        msg = await ws.recv()
        if isinstance(msg, bytes):
            now = time.perf_counter()
            if first is None:
                first = now
            late = max(late, (now - first) - audio)  # due at first + audio so far
            audio += (len(msg) - 12) / 2 / rate
            continue
        event = json.loads(msg)
        if event["type"] == "segment_started":
            rate = event["sample_rate"]
        elif event["type"] == "error":
            raise RuntimeError(f"stream {index}: {event}")
        elif event["type"] == "done":
            return first, audio, late


async def run_load(url: str, streams: int, text: str,
                   ramp_s: float = 0.0) -> tuple[list[StreamResult], float]:
    """Run ``streams`` sessions at once; with ``ramp_s``, their starts spread evenly."""

    async def start(i: int) -> StreamResult:
        await asyncio.sleep(ramp_s * i / max(1, streams))
        return await one_stream(url, text, i)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(start(i) for i in range(streams)))
    return list(results), time.perf_counter() - t0


# -- chattts mode ---------------------------------------------------------------------


async def bench_chattts(args: argparse.Namespace) -> dict[str, Any]:
    from rtts.engines.chattts import configure_threads_env

    configure_threads_env()  # the same for both servers: they share this process
    import torch

    from rtts.config import EngineConfig, ServerConfig
    from rtts.core.cache import CacheConfig
    from rtts.core.params import SynthParams
    from rtts.core.scheduler import SchedulerConfig
    from rtts.engines.base import SynthRequest
    from rtts.engines.chattts import ChatTTSEngine, StockChatTTSEngine
    from rtts.server import bound_port, run_server

    torch.set_num_threads(args.threads)
    ecfg = EngineConfig(source="custom", model_dir=args.model_dir, device=args.device,
                        threads=args.threads, fixed_tokens=args.tokens,
                        stream_tokens=args.stream_tokens, dtype=args.dtype,
                        batch_rows=args.streams)
    # No phrase cache: every run must synthesize (the runs repeat the same text).
    base = ServerConfig(port=0, ping_interval_s=None, web_dir=None,
                        cache=CacheConfig(memory_mb=0))
    setups = [
        ("stock-serialized", StockChatTTSEngine,
         SchedulerConfig(max_batch_size=1, concurrency=1, request_timeout_s=3600)),
        ("rtts", ChatTTSEngine,
         SchedulerConfig(max_batch_size=args.streams, max_wait_ms=20, request_timeout_s=3600)),
    ]
    out: dict[str, Any] = {"tokens": args.tokens, "threads": args.threads, "cpu": _cpu_model(),
                           "dtype": args.dtype, "repeat": args.repeat, "model_rss_mb": {},
                           "runs": {}}
    proc = psutil.Process()
    urls: dict[str, str] = {}
    samples: dict[str, list[dict[str, float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        # Both servers stay up, each with its own copy of the model, and their runs
        # alternate, so drift in machine speed hits both alike.
        for name, engine_cls, sched in setups:
            rss0 = proc.memory_info().rss
            t = time.perf_counter()
            engine = engine_cls(ecfg)
            engine.load()
            engine.warmup()
            for _ in engine.generate([SynthRequest("warm up", SynthParams(),
                                                   max_new_token=16)]):
                pass
            out["device"] = engine.info.device
            if engine.kernel_table is not None:
                out["kernels"] = engine.kernel_table.as_dict()
            out["model_rss_mb"][name] = (proc.memory_info().rss - rss0) / 2**20
            print(f"{name}: loaded {args.model_dir} on {engine.info.device} in "
                  f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
            cfg = replace(base, scheduler=sched)
            app = await stack.enter_async_context(run_server(cfg, engine, load=False))
            await app.start_serving()
            urls[name] = f"ws://127.0.0.1:{bound_port(app)}{cfg.ws_path}"
        for streams in sorted({1, args.streams}):
            for rep in range(args.repeat):
                for name, _, _ in setups:
                    with RssSampler() as rss:
                        results, wall = await run_load(urls[name], streams, args.text)
                    row = LoadResult(name, streams, results, wall, rss.peak / 2**20).row()
                    samples.setdefault(f"{name}@{streams}", []).append(row)
                    print(f"{name:>17} streams={streams} run {rep + 1}: " + ", ".join(
                        f"{k}={v:.3f}" for k, v in row.items()), file=sys.stderr)
    for key, rows in samples.items():  # medians over the repeats
        out["runs"][key] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    n = args.streams
    out["throughput_ratio_per_pair"] = [
        a["throughput"] / b["throughput"]
        for a, b in zip(samples[f"rtts@{n}"], samples[f"stock-serialized@{n}"], strict=True)]
    r = out["runs"]
    n = args.streams
    stock_n = r[f"stock-serialized@{n}"]
    out["throughput_ratio"] = r[f"rtts@{n}"]["throughput"] / stock_n["throughput"]
    out["ttfa1_ratio"] = r["rtts@1"]["ttfa_p50_s"] / r["stock-serialized@1"]["ttfa_p50_s"]
    return out


# -- piper: streams in real time, beside ChatTTS ------------------------------------------


@dataclass
class TimedStream:
    ttfa_s: float
    audio_s: float
    late_s: float  # worst lateness of a frame against playback from the first frame


async def timed_stream(url: str, text: str, index: int) -> TimedStream:
    """One session: stream ``text`` in word-sized pieces, time every frame's arrival."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()  # ready
        await ws.send(json.dumps({"type": "start", "voice": f"seed:{index % 5}"}))
        t0 = time.perf_counter()
        for word in text.split(" "):
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
        await ws.send(json.dumps({"type": "end"}))
        first, audio, late = await receive_audio(ws, index)
        return TimedStream((first or time.perf_counter()) - t0, audio, late)


def realtime_row(results: list[TimedStream], wall_s: float, ttfa_limit: float,
                 late_limit: float) -> dict[str, Any]:
    ttfa = sorted(r.ttfa_s for r in results)
    late = max(r.late_s for r in results)
    audio = sum(r.audio_s for r in results)
    return {"ttfa_p50_s": statistics.median(ttfa),
            "ttfa_max_s": ttfa[-1], "late_max_s": late,
            "audio_s": audio, "wall_s": wall_s,
            "rtf": wall_s / (audio / len(results)),  # wall per stream's audio
            "realtime": ttfa[-1] <= ttfa_limit and late <= late_limit}


async def bench_piper(args: argparse.Namespace) -> dict[str, Any]:
    from rtts.config import EngineConfig, ServerConfig
    from rtts.core.cache import CacheConfig
    from rtts.core.scheduler import SchedulerConfig
    from rtts.server import bound_port, run_server

    counts = sorted({int(n) for n in args.streams.split(",")})
    # as `rtts serve`: no pacing (the bench measures how fast audio can arrive), no cache
    # (every run synthesizes), the GIL switch interval and gc.freeze() after loading
    sys.setswitchinterval(ServerConfig.gil_switch_interval_s)
    base = ServerConfig(port=0, ping_interval_s=None, web_dir=None, max_lead_s=None,
                        cache=CacheConfig(memory_mb=0), freeze_gc=True)
    setups: list[tuple[str, ServerConfig]] = [(
        "piper", replace(base, engine=EngineConfig(
            name="piper", voice_models=(args.voice_model,), piper_workers=args.workers),
            scheduler=SchedulerConfig(request_timeout_s=3600, max_queue=4096)))]
    if args.model_dir is not None:
        from rtts.engines.chattts import configure_threads_env

        configure_threads_env()
        setups.append(("chattts", replace(base, engine=EngineConfig(
            source="custom", model_dir=args.model_dir, device="cpu",
            fixed_tokens=args.tokens, batch_rows=max(counts)),
            scheduler=SchedulerConfig(max_batch_size=max(counts), request_timeout_s=3600,
                                      max_queue=4096))))
    out: dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "text": args.text,
                           "ttfa_limit_s": args.ttfa_limit, "late_limit_s": args.late_limit,
                           "tokens": args.tokens if args.model_dir else None, "runs": {}}
    urls: dict[str, str] = {}
    async with contextlib.AsyncExitStack() as stack:
        for name, cfg in setups:
            t = time.perf_counter()
            app = await stack.enter_async_context(run_server(cfg))
            if app.state != "ready":
                raise RuntimeError(f"{name}: {app.state_reason}")
            print(f"{name}: ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
            urls[name] = f"ws://127.0.0.1:{bound_port(app)}{cfg.ws_path}"
        for streams in counts:
            for rep in range(args.repeat):
                for name in urls:
                    if name == "chattts" and streams > args.chattts_max_streams:
                        continue
                    t0 = time.perf_counter()
                    results = await asyncio.gather(*(
                        timed_stream(urls[name], args.text, i) for i in range(streams)))
                    row = realtime_row(list(results), time.perf_counter() - t0,
                                       args.ttfa_limit, args.late_limit)
                    out["runs"].setdefault(f"{name}@{streams}", []).append(row)
                    print(f"{name:>8} streams={streams:<3} run {rep + 1}: " + ", ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()), file=sys.stderr)
    out["max_realtime_streams"] = {name: _realtime_up_to(out["runs"], name, counts)
                                    for name in urls}
    return out


def _realtime_up_to(runs: dict[str, list[dict[str, Any]]], name: str,
                    counts: list[int]) -> int:
    """The largest stream count up to which every run (of every smaller count) was in
    real time; 0 if even one stream was not."""
    best = 0
    for n in counts:
        rows = runs.get(f"{name}@{n}")
        if not rows or not all(r["realtime"] for r in rows):
            break
        best = n
    return best


# -- staggered arrivals: continuous vs static batching ----------------------------------

PARAGRAPH = ("Hello, thanks for waiting. The weather today is sunny with a light breeze. "
             "Tomorrow brings rain in the afternoon, so take an umbrella.")


def arrival_times(clients: int, gap_s: float, poisson: bool, seed: int) -> list[float]:
    """Start offsets: every ``gap_s`` seconds, or a Poisson process of mean gap ``gap_s``."""
    if not poisson:
        return [i * gap_s for i in range(clients)]
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(clients):
        out.append(t)
        t += rng.expovariate(1.0 / gap_s)
    return out


async def run_staggered(url: str, starts: list[float], text: str) -> list[StreamResult]:
    async def client(i: int, at: float) -> StreamResult:
        await asyncio.sleep(at)
        return await one_stream(url, text, i)

    return list(await asyncio.gather(*(client(i, at) for i, at in enumerate(starts))))


def staggered_row(results: list[StreamResult]) -> dict[str, float]:
    first = results[0].ttfa_s
    late = [r.ttfa_s for r in results[1:]]
    return {"first_ttfa_s": first, "late_ttfa_median_s": statistics.median(late),
            "late_ttfa_max_s": max(late),
            "late_median_ratio": statistics.median(late) / first,
            "late_max_ratio": max(late) / first,
            "wall_s": max(r.wall_s for r in results)}


async def bench_staggered(args: argparse.Namespace) -> dict[str, Any]:
    """Clients arriving one by one (``--arrivals N --gap S [--poisson]``), each streaming
    a short paragraph, against two rtts servers in this process that differ only in
    batching: static (a batch runs to its end; today's behaviour before continuous
    batching) and continuous (arrivals join at the next step)."""
    from rtts.engines.chattts import configure_threads_env

    configure_threads_env()
    import torch

    from rtts.config import EngineConfig, ServerConfig
    from rtts.core.cache import CacheConfig
    from rtts.core.scheduler import SchedulerConfig
    from rtts.engines.chattts import ChatTTSEngine
    from rtts.server import bound_port, run_server

    torch.set_num_threads(args.threads)
    ecfg = EngineConfig(source="custom", model_dir=args.model_dir, device=args.device,
                        threads=args.threads, fixed_tokens=args.tokens, dtype=args.dtype,
                        stream_tokens=args.stream_tokens, batch_rows=args.slots)
    base = ServerConfig(port=0, ping_interval_s=None, web_dir=None,
                        cache=CacheConfig(memory_mb=0))
    starts = arrival_times(args.arrivals, args.gap, args.poisson, args.seed)
    out: dict[str, Any] = {"cpu": _cpu_model(), "threads": args.threads, "tokens": args.tokens,
                           "slots": args.slots, "dtype": args.dtype, "arrivals": starts,
                           "text": args.paragraph, "runs": {}}
    urls: dict[str, str] = {}
    modes = tuple(args.modes.split(","))
    async with contextlib.AsyncExitStack() as stack:
        for mode in modes:
            engine = ChatTTSEngine(ecfg)
            engine.load()
            engine.warmup()
            if engine.kernel_table is not None:
                out["kernels"] = engine.kernel_table.as_dict()
            sched = SchedulerConfig(max_batch_size=args.slots, max_wait_ms=20,
                                    request_timeout_s=3600, batching=mode,
                                    first_segment_slots=args.first_segment_slots,
                                    later_hold_s=args.later_hold)
            app = await stack.enter_async_context(
                run_server(replace(base, scheduler=sched), engine, load=False))
            await app.start_serving()
            urls[mode] = f"ws://127.0.0.1:{bound_port(app)}{base.ws_path}"
        for rep in range(args.repeat):
            for mode in modes:
                results = await run_staggered(urls[mode], starts, args.paragraph)
                row = staggered_row(results)
                row["ttfa_s"] = [r.ttfa_s for r in results]  # type: ignore[assignment]
                out["runs"].setdefault(mode, []).append(row)
                print(f"{mode:>10} run {rep + 1}: ttfa=" +
                      ", ".join(f"{r.ttfa_s:.2f}" for r in results) +
                      f"  late/first median {row['late_median_ratio']:.2f}x "
                      f"max {row['late_max_ratio']:.2f}x", file=sys.stderr, flush=True)
    for mode in modes:
        rows = out["runs"][mode]
        out[mode] = {k: statistics.median(r[k] for r in rows)
                     for k in rows[0] if k != "ttfa_s"}
    return out


# -- kernels mode: GPT step time and accuracy per weight precision ---------------------


def _step_ms(engine: Any, rows: int, steps: int) -> float:
    """Median wall time of one decode step of ``rows`` rows (the engine's GPT, real
    prompts, the installed kernels)."""
    import torch

    from rtts.core.params import SynthParams
    from rtts.engines.base import SynthRequest

    # as many slots as a serving batch has (a compiled decode step is compiled for it)
    gpt = engine.batch(max(rows, engine.config.batch_rows))
    reqs = [SynthRequest(f"{BENCH_TEXT}, {i}.", SynthParams(seed=i), max_new_token=steps + 8)
            for i in range(rows)]
    times = []
    cuda = engine.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        gpt.add(engine._specs(reqs))
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            gpt.step()
            sync()
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


def _forced_logits(engine: Any, codes: Any | None, tokens: int) -> tuple[Any, Any, Any]:
    """Run one row for ``tokens`` steps; with ``codes`` (tokens, vq), feed those instead of
    the drawn ones (teacher forcing). Returns (logits (tokens, vq, V), codes, hiddens)."""
    import torch

    from rtts.core.params import SynthParams
    from rtts.engines.base import SynthRequest

    chat = engine.chat
    gpt = engine.batch(1)
    req = SynthRequest(BENCH_TEXT + ".", SynthParams(seed=3), max_new_token=tokens)
    with torch.no_grad():
        spec = engine._specs([req])[0]
        spec.min_tokens = tokens
        [row] = gpt.add([spec])
        while not row.finished:
            if codes is not None:
                row.codes[row.length - 1] = codes[row.length - 1]
                row.last = codes[row.length - 1]
            gpt.step()
        h = row.hiddens[:tokens]
        logits = torch.stack([head(h) for head in chat.gpt.head_code], 1).float()
    return logits, row.codes[:tokens].clone(), h.clone()


async def bench_kernels(args: argparse.Namespace) -> dict[str, Any]:
    from rtts.engines.chattts import configure_threads_env

    configure_threads_env()
    import torch

    from rtts.bench.realtime import setting
    from rtts.config import EngineConfig
    from rtts.engines.chattts import ChatTTSEngine

    torch.set_num_threads(args.threads)
    cpu = _cpu_model()
    out: dict[str, Any] = {"cpu": cpu, "threads": args.threads, "tokens": args.tokens,
                           "dtypes": {}}
    ref_logits = ref_codes = ref_wav = None
    rows_list = [int(r) for r in args.rows.split(",")]
    for dtype in args.dtypes.split(","):
        engine = ChatTTSEngine(EngineConfig(source="custom", model_dir=args.model_dir,
                                            device=args.device, threads=args.threads,
                                            batch_rows=max(rows_list),
                                            **{"kernels": args.kernels, **setting(dtype)}))
        engine.load()
        if engine.config.compile:  # its step as served: compiled before it is timed
            engine.warmup()
        table = engine.kernel_table
        res: dict[str, Any] = {"kernels": table.as_dict() if table else None}
        res["step_ms"] = {r: _step_ms(engine, r, args.steps) for r in rows_list}
        logits, codes, hiddens = _forced_logits(engine, ref_codes, args.tokens)
        if ref_logits is None:
            ref_logits, ref_codes = logits, codes
        cos = torch.nn.functional.cosine_similarity(
            logits.flatten(0, 1), ref_logits.flatten(0, 1), dim=-1)
        res["logits_cosine_mean"] = float(cos.mean())
        res["logits_cosine_min"] = float(cos.min())
        res["greedy_agreement"] = float(
            (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        # the decoded audio of the teacher-forced run against fp32's (same codes fed),
        # decoded as the engine serves (bf16 where chosen at load for int8/int4)
        wav = engine._decode([hiddens])[0]
        res["decode_dtype"] = engine.decode_dtype
        if ref_wav is None:
            ref_wav = wav
        err = float(((wav - ref_wav) ** 2).sum())
        res["audio_snr_db"] = (10 * math.log10(float((ref_wav ** 2).sum()) / err)
                               if err > 0 else None)  # None: identical
        out["dtypes"][dtype] = res
        print(f"{dtype}: {json.dumps(res)}", file=sys.stderr, flush=True)
        engine.close()
        del engine
    base = out["dtypes"].get("fp32")
    if base:
        for res in out["dtypes"].values():
            res["speedup_vs_fp32"] = {r: base["step_ms"][r] / ms
                                      for r, ms in res["step_ms"].items()}
    return out


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


# -- fake mode --------------------------------------------------------------------------


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@contextlib.asynccontextmanager
async def _fake_server(port: int,
                       *serve_args: str) -> AsyncIterator[tuple[str, str, psutil.Process]]:
    """``rtts serve --engine fake`` in a subprocess; yields (ws url, http base, process)
    once ``/readyz`` answers; terminates it on exit."""
    # Every simulated client comes from 127.0.0.1: lift the per-client connection cap.
    cmd = [sys.executable, "-m", "rtts", "--log-level", "WARNING", "serve", "--engine", "fake",
           "--port", str(port), "--max-connections-per-client", "0", *serve_args]
    server = await asyncio.create_subprocess_exec(
        *cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_http_get, base + "/readyz")
                break
            await asyncio.sleep(0.1)
        yield f"ws://127.0.0.1:{port}/v1/stream", base, psutil.Process(server.pid)
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 30)


async def bench_fake(args: argparse.Namespace) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (args.idle + args.streams) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    serve = ("--fake-rtf", str(args.fake_rtf), "--max-queue", "100000",
             "--max-batch-size", str(args.batch), "--concurrency", str(args.concurrency),
             "--max-lead", str(args.max_lead), "--cache-mb", "0")
    async with _fake_server(args.port, *serve) as (url, base, proc):
        me = psutil.Process()
        proc.cpu_percent(None)
        me.cpu_percent(None)
        results, wall = await run_load(url, args.streams, args.text, args.ramp)
        server_cpu, client_cpu = proc.cpu_percent(None), me.cpu_percent(None)
        metrics = await asyncio.to_thread(_http_get, base + "/metrics")
        out: dict[str, Any] = {
            "streams": args.streams, "wall_s": wall,
            "audio_s": sum(r.audio_s for r in results),
            "ttfa_p50_s": statistics.median(r.ttfa_s for r in results),
            "frame_latency_p50_ms": 1000 * _metric(
                metrics, 'rtts_frame_latency_seconds{quantile="0.5"}'),
            "frame_latency_p99_ms": 1000 * _metric(
                metrics, 'rtts_frame_latency_seconds{quantile="0.99"}'),
            "frames": _metric(metrics, "rtts_frame_latency_seconds_count"),
            "server_rss_mb": proc.memory_info().rss / 2**20,
            "server_cpu_percent": server_cpu,  # of one core
            "client_cpu_percent": client_cpu,
        }
        print(f"streaming: {out}", file=sys.stderr, flush=True)
        if args.idle:
            conns = []
            for i in range(args.idle):
                ws = await connect(url, ping_interval=None)
                await ws.recv()
                conns.append(ws)
                if i % 200 == 199:
                    await asyncio.sleep(0)
            await asyncio.sleep(args.idle_hold)
            alive = 0
            for ws in conns:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(await ws.ping(), 10)
                    alive += 1
            out["idle_connections"] = args.idle
            out["idle_alive_after_hold"] = alive
            out["server_rss_mb_idle"] = proc.memory_info().rss / 2**20
            for ws in conns:
                await ws.close()
        return out


# -- jobs mode: live streams first, jobs in the gaps -------------------------------------


def _http_json(method: str, url: str, body: bytes | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@contextlib.contextmanager
def _redis_server(workdir: Path) -> Any:
    import shutil
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


async def bench_jobs(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from rtts.config import EngineConfig, ServerConfig
    from rtts.core.cache import CacheConfig
    from rtts.core.scheduler import SchedulerConfig
    from rtts.engines.fake import FakeEngine
    from rtts.jobs.model import JobsConfig
    from rtts.server import bound_port, run_server

    engine: Any
    if args.model_dir is not None:
        from rtts.engines.chattts import ChatTTSEngine, configure_threads_env

        configure_threads_env()
        engine = ChatTTSEngine(EngineConfig(
            source="custom", model_dir=args.model_dir, device=args.device,
            threads=args.threads, fixed_tokens=args.tokens, batch_rows=args.slots))
    else:  # the documented test double, paced at 4x real time
        engine = FakeEngine(ms_per_char=60, chunk_ms=100, rtf=0.25, continuous=True)
    book = (PARAGRAPH + " ") * (args.job_chars // len(PARAGRAPH) + 1)
    starts = arrival_times(args.arrivals, args.gap, False, 1)
    me = psutil.Process()
    out: dict[str, Any] = {"cpu": _cpu_model(), "engine": engine.name, "slots": args.slots,
                           "tokens": args.tokens, "rows_with_live": args.rows_with_live,
                           "arrivals": starts, "runs": []}
    with tempfile.TemporaryDirectory() as tmp, _redis_server(Path(tmp)) as redis_url:
        cfg = ServerConfig(
            port=0, ping_interval_s=None, web_dir=None, cache=CacheConfig(memory_mb=0),
            scheduler=SchedulerConfig(max_batch_size=args.slots, max_wait_ms=20,
                                      request_timeout_s=3600,
                                      background_rows_with_live=args.rows_with_live),
            jobs=JobsConfig(redis_url=redis_url, dir=Path(tmp) / "jobs", worker=True))
        await asyncio.to_thread(engine.load)
        await asyncio.to_thread(engine.warmup)
        async with run_server(cfg, engine, load=False) as app:
            await app.start_serving()
            await app.start_jobs()
            base = f"http://127.0.0.1:{bound_port(app)}"
            url = f"ws://127.0.0.1:{bound_port(app)}{cfg.ws_path}"

            async def submit(text: str) -> str:
                st = await asyncio.to_thread(_http_json, "POST", base + "/v1/jobs?format=mp3",
                                             text.encode())
                return str(st["id"])

            async def status(job: str) -> dict[str, Any]:
                return await asyncio.to_thread(_http_json, "GET", f"{base}/v1/jobs/{job}")

            for rep in range(args.repeat):
                alone = await run_staggered(url, starts, PARAGRAPH)
                job = await submit(book)
                for _ in range(600):  # until its first segment is stored
                    if (await status(job))["segments_done"] >= 1:
                        break
                    await asyncio.sleep(0.2)
                before, t0 = await status(job), time.monotonic()
                busy_before = app.scheduler.preempted
                beside = await run_staggered(url, starts, PARAGRAPH)
                after, wall = await status(job), time.monotonic() - t0
                await asyncio.to_thread(_http_json, "DELETE", f"{base}/v1/jobs/{job}")
                row = {
                    "ttfa_no_job_s": [round(r.ttfa_s, 3) for r in alone],
                    "ttfa_with_job_s": [round(r.ttfa_s, 3) for r in beside],
                    "ttfa_median_no_job_s": statistics.median(r.ttfa_s for r in alone),
                    "ttfa_median_with_job_s": statistics.median(r.ttfa_s for r in beside),
                    "job_audio_s_during_live": after["audio_seconds"] - before["audio_seconds"],
                    "job_segments_during_live": after["segments_done"] - before["segments_done"],
                    "live_wall_s": wall,
                    "preempted": app.scheduler.preempted - busy_before}
                row["ttfa_ratio"] = row["ttfa_median_with_job_s"] / row["ttfa_median_no_job_s"]
                out["runs"].append(row)
                print(f"run {rep + 1}: TTFA median {row['ttfa_median_no_job_s']:.3f}s without "
                      f"a job, {row['ttfa_median_with_job_s']:.3f}s with one "
                      f"({row['ttfa_ratio']:.2f}x); job meanwhile "
                      f"{row['job_segments_during_live']} segments, "
                      f"{row['job_audio_s_during_live']:.1f}s audio, "
                      f"{row['preempted']} preempted", file=sys.stderr, flush=True)
            # the job alone: throughput and RSS over time
            job = await submit(book * args.long_repeat)
            t0 = time.monotonic()
            first = await status(job)
            series: list[tuple[float, float, float]] = []
            while (t := time.monotonic() - t0) < args.long_seconds:
                st = await status(job)
                series.append((round(t, 1), round(me.memory_info().rss / 2**20, 1),
                               st["audio_seconds"]))
                if st["state"] != "running" and st["state"] != "queued":
                    break
                await asyncio.sleep(args.sample_s)
            last = await status(job)
            wall = time.monotonic() - t0
            await asyncio.to_thread(_http_json, "DELETE", f"{base}/v1/jobs/{job}")
            warm = [r for t, r, _ in series if t >= args.long_seconds * 0.2] or [series[-1][1]]
            out["long_job"] = {
                "characters": first["characters"], "segments_total": first["segments_total"],
                "segments_done": last["segments_done"], "wall_s": wall,
                "audio_s": last["audio_seconds"],
                "throughput_audio_s_per_s": last["audio_seconds"] / wall,
                "segments_per_s": last["segments_done"] / wall,
                "rss_mb_after_warmup": warm[0], "rss_mb_max_after_warmup": max(warm),
                "rss_mb_final": series[-1][1],
                "rss_growth_after_warmup_pct": 100 * (series[-1][1] / warm[0] - 1),
                "series": series}
    runs = out["runs"]
    out["ttfa_ratio_median"] = statistics.median(r["ttfa_ratio"] for r in runs)
    return out


# -- soak mode -----------------------------------------------------------------------------


async def soak_session(url: str, i: int) -> str:
    """One short session: start, text, then end (or, every fifth, cancel). Returns how it
    ended: ``done`` or ``cancelled``. A few phrases repeat, so cache hits happen too."""
    text = (f"Session {i}, short and sweet." if i % 3 else
            f"A phrase heard often, number {i % 10}.")
    async with connect(url, max_size=None, ping_interval=None) as ws:
        await ws.recv()  # ready
        await ws.send(json.dumps({"type": "start", "voice": f"seed:{i % 7}", "seed": 3}))
        await ws.send(json.dumps({"type": "text", "text": text}))
        await ws.send(json.dumps({"type": "cancel" if i % 5 == 0 else "end"}))
        async for msg in ws:
            if isinstance(msg, str):
                kind = json.loads(msg)["type"]
                if kind in ("done", "cancelled"):
                    return str(kind)
                if kind == "error":
                    raise RuntimeError(f"session {i}: {msg}")
    raise RuntimeError(f"session {i}: closed before done")


async def bench_soak(args: argparse.Namespace) -> dict[str, Any]:
    async with _fake_server(args.port, "--cache-mb", str(args.cache_mb)) as (url, base, proc):
        duration = args.minutes * 60
        t0 = time.monotonic()
        warm_end = t0 + duration * args.warmup
        counts = {"done": 0, "cancelled": 0, "errors": 0}
        series: list[tuple[float, float, int]] = []  # (t, rss MB, sessions so far)
        next_id = 0

        async def worker() -> None:
            nonlocal next_id
            while time.monotonic() - t0 < duration:
                i, next_id = next_id, next_id + 1
                try:
                    counts[await soak_session(url, i)] += 1
                except Exception as exc:
                    counts["errors"] += 1
                    print(f"soak: {type(exc).__name__}: {exc}", file=sys.stderr)

        async def sampler() -> None:
            while True:
                series.append((time.monotonic() - t0, proc.memory_info().rss / 2**20,
                               counts["done"] + counts["cancelled"]))
                print(f"soak: t={series[-1][0]:.0f}s rss={series[-1][1]:.1f}MB "
                      f"sessions={series[-1][2]}", file=sys.stderr, flush=True)
                await asyncio.sleep(args.sample_s)

        sample_task = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        finally:
            sample_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sample_task
        await asyncio.sleep(1.0)
        metrics = await asyncio.to_thread(_http_get, base + "/metrics")
        final = proc.memory_info().rss / 2**20
        series.append((time.monotonic() - t0, final, counts["done"] + counts["cancelled"]))
        after = [rss for t, rss, _ in series if t0 + t >= warm_end]
        warm_rss = after[0] if after else series[0][1]
        sessions = counts["done"] + counts["cancelled"]
        return {
            "minutes": args.minutes, "concurrency": args.concurrency, "sessions": sessions,
            "sessions_after_warmup": sessions - next(
                (n for t, _, n in series if t0 + t >= warm_end), 0),
            **counts,
            "rss_mb_at_warmup_end": warm_rss, "rss_mb_final": final,
            "rss_mb_max_after_warmup": max(after) if after else final,
            "rss_growth_after_warmup_pct": 100 * (final / warm_rss - 1),
            "cache_hits": _metric(metrics, 'rtts_cache_hits_total{tier="memory"}'),
            "open_connections_after": _metric(metrics, "rtts_active_connections"),
            "queue_depth_after": _metric(metrics, "rtts_queue_depth"),
            "rss_series": [(round(t), round(r, 1), n) for t, r, n in series],
        }


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="load benchmarks with real WebSocket clients")
    bsub = b.add_subparsers(dest="bench_mode", required=True)
    c = bsub.add_parser("chattts", help="rtts vs serialized stock ChatTTS, same run")
    c.add_argument("--model-dir", type=Path, required=True,
                   help="checkpoint (e.g. from `rtts model make-random --size full`)")
    c.add_argument("--streams", type=int, default=4)
    c.add_argument("--tokens", type=int, default=128, help="GPT steps per segment")
    c.add_argument("--stream-tokens", type=int, default=8)
    c.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="fp32", help="the rtts server's --dtype")
    c.add_argument("--text", default=BENCH_TEXT)
    c.add_argument("--repeat", type=int, default=2, help="alternating runs per setting")
    c.add_argument("--json", type=Path, default=None, help="also write results here")
    st = bsub.add_parser("staggered", help="clients arriving one by one: continuous vs "
                         "static batching, time to first audio of the first vs the rest")
    st.add_argument("--model-dir", type=Path, required=True)
    st.add_argument("--arrivals", type=int, default=6, help="clients")
    st.add_argument("--gap", type=float, default=1.5, help="seconds between arrivals (mean)")
    st.add_argument("--poisson", action="store_true", help="Poisson arrivals, mean --gap")
    st.add_argument("--seed", type=int, default=1, help="Poisson arrival seed")
    st.add_argument("--slots", type=int, default=8, help="the servers' --max-batch-size")
    st.add_argument("--tokens", type=int, default=64, help="GPT steps per segment")
    st.add_argument("--first-segment-slots", type=int, default=None,
                    help="as rtts serve --first-segment-slots")
    st.add_argument("--later-hold", type=float, default=3.0, help="as rtts serve --later-hold")
    st.add_argument("--stream-tokens", type=int, default=8)
    st.add_argument("--dtype", default="fp32")
    st.add_argument("--paragraph", default=PARAGRAPH)
    st.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    st.add_argument("--device", default="auto")
    st.add_argument("--repeat", type=int, default=1)
    st.add_argument("--modes", default="static,continuous",
                    help="batching modes compared (comma-separated)")
    st.add_argument("--json", type=Path, default=None)
    kn = bsub.add_parser("kernels", help="GPT step time and accuracy per --dtype")
    kn.add_argument("--model-dir", type=Path, required=True)
    kn.add_argument("--dtypes", default="fp32,auto,bf16,int8,int4",
                    help="the first is the reference the others are compared with; each "
                    "optionally with +compile, +kvKV and +kernels=K, as bench realtime "
                    "--dtypes")
    kn.add_argument("--rows", default="1,4", help="batch sizes to time")
    kn.add_argument("--steps", type=int, default=24, help="decode steps timed per batch size")
    kn.add_argument("--tokens", type=int, default=128, help="decode length for accuracy")
    kn.add_argument("--kernels", default="auto", help="as rtts serve --kernels")
    kn.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    kn.add_argument("--device", default="auto")
    kn.add_argument("--json", type=Path, default=None)
    pp = bsub.add_parser("piper", help="streams the piper engine serves in real time, "
                         "beside ChatTTS (--model-dir) on the same machine")
    pp.add_argument("--voice-model", type=Path, required=True, help="a piper .onnx voice")
    pp.add_argument("--model-dir", type=Path, default=None,
                    help="also run a ChatTTS checkpoint (e.g. make-random --size full)")
    pp.add_argument("--streams", default="1,2,4,8,16", help="stream counts (comma-separated)")
    pp.add_argument("--workers", type=int, default=None,
                    help="piper segments at once (rtts serve --piper-workers)")
    pp.add_argument("--tokens", type=int, default=128,
                    help="ChatTTS: GPT steps per segment (128: 2.7 s of audio)")
    pp.add_argument("--chattts-max-streams", type=int, default=4,
                    help="ChatTTS: skip stream counts above this (it is far slower)")
    pp.add_argument("--text", default=PARAGRAPH)
    pp.add_argument("--ttfa-limit", type=float, default=1.0,
                    help="real time: every stream's first audio within this many seconds")
    pp.add_argument("--late-limit", type=float, default=0.1,
                    help="real time: no frame later than this behind playback")
    pp.add_argument("--repeat", type=int, default=1)
    pp.add_argument("--json", type=Path, default=None)
    f = bsub.add_parser("fake", help="server overhead with the fake engine")
    f.add_argument("--streams", type=int, default=200)
    f.add_argument("--idle", type=int, default=1000)
    f.add_argument("--idle-hold", type=float, default=5.0)
    f.add_argument("--fake-rtf", type=float, default=1.0)
    f.add_argument("--port", type=int, default=8799)
    f.add_argument("--max-lead", type=float, default=2.0, help="the server's --max-lead")
    f.add_argument("--batch", type=int, default=64, help="the server's --max-batch-size")
    f.add_argument("--concurrency", type=int, default=4,
                   help="the server's --concurrency (batches running at once)")
    f.add_argument("--ramp", type=float, default=0.0,
                   help="spread session starts over this many seconds")
    f.add_argument("--text", default=BENCH_TEXT + ". " + BENCH_TEXT + ".")
    f.add_argument("--json", type=Path, default=None)
    jb = bsub.add_parser("jobs", help="live TTFA with vs without a background job; job "
                         "throughput; RSS over a long job")
    jb.add_argument("--model-dir", type=Path, default=None,
                    help="ChatTTS checkpoint (default: the fake engine at real time)")
    jb.add_argument("--slots", type=int, default=8, help="the server's --max-batch-size")
    jb.add_argument("--tokens", type=int, default=64, help="GPT steps per segment (ChatTTS)")
    jb.add_argument("--rows-with-live", type=int, default=None,
                    help="as rtts serve --jobs-rows-with-live")
    jb.add_argument("--arrivals", type=int, default=4, help="live clients per phase")
    jb.add_argument("--gap", type=float, default=1.0, help="seconds between live arrivals")
    jb.add_argument("--job-chars", type=int, default=20000, help="the background job's text")
    jb.add_argument("--long-repeat", type=int, default=10,
                    help="the long job is the background text this many times")
    jb.add_argument("--long-seconds", type=float, default=60.0,
                    help="how long the long job runs alone (RSS sampled)")
    jb.add_argument("--sample-s", type=float, default=2.0)
    jb.add_argument("--repeat", type=int, default=2, help="alternating no-job/job pairs")
    jb.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    jb.add_argument("--device", default="auto")
    jb.add_argument("--json", type=Path, default=None)
    k = bsub.add_parser("soak", help="sessions back to back for minutes; RSS must stay flat")
    k.add_argument("--minutes", type=float, default=10.0)
    k.add_argument("--concurrency", type=int, default=20)
    k.add_argument("--warmup", type=float, default=0.2, help="fraction of the time")
    k.add_argument("--sample-s", type=float, default=10.0)
    k.add_argument("--cache-mb", type=float, default=8.0, help="the server's --cache-mb")
    k.add_argument("--port", type=int, default=8798)
    k.add_argument("--json", type=Path, default=None)


def run_bench(args: argparse.Namespace) -> int:
    runner = {"chattts": bench_chattts, "fake": bench_fake, "soak": bench_soak,
              "kernels": bench_kernels, "staggered": bench_staggered,
              "piper": bench_piper, "jobs": bench_jobs}[args.bench_mode]
    out = asyncio.run(runner(args))
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0
