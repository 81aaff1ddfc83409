"""``rtts bench realtime``: what a listener hears, N streams at once, beside stock ChatTTS.

Each stream is one WebSocket session on the real server's native ``/v1/stream`` socket
that sends a paragraph (``--text``) at once and reads the PCM frames back. A **paced
player** models the listener: it starts ``--prebuffer`` seconds after the first frame
arrives, plays continuously, and when its buffer runs dry it waits (silence) until the
next frame arrives, then plays on. Per stream the bench reports time to first audio
(TTFA), seconds of audio, the silence heard while waiting and the silence per second of
audio; per setting the largest stream count at which no stream heard silence ("real-time
streams").

Settings, all in one process and run alternately (``--repeat`` times per stream count, so
drift in machine speed hits all alike):

- ``rtts-DTYPE`` for each ``--dtypes``: rtts's engine (continuous batching, early
  windowed decode) with that GPT weight precision;
- ``stock``: an unmodified ``Chat`` serving stock ``Chat.infer(stream=True)`` one request
  at a time (``--stock-max-streams`` caps the counts it runs; ``0`` skips it).

``--anchor both`` runs every rtts setting twice, with speaker anchoring (the ``anchor`` start
option, on by default: later segments conditioned on the first one's codes and text) and
without (``rtts-DTYPE-noanchor``), so its cost shows in the same run: each stream also
reports the gap between a segment's last frame and the next segment's first
(``next_segment_gap_s``: the wait the anchor can add), and the prefill and decode step of
a batch with anchored rows are timed beside plain ones (``anchor_cost``).

Every segment is forced to ``--tokens`` GPT steps, so random weights give equal work in
every setting; or, with ``--tokens-per-char``, to a length in proportion to its text, as
speech's is (the segmenter's first segments are short, so an anchor made of a first
segment's codes is short too, where ``--tokens`` makes it as long as any). With
``--decode-tokens 24,96`` every rtts setting also runs at each steady decode size. The
same run measures the machine's read bandwidth (one pass over a
``--bandwidth-mb`` buffer) and, per dtype, the GPT decode step at 1 and ``--rows`` rows:
its multiple of the weight-read limit (bytes of the GPT's linear weights as the installed
kernels hold them, divided by the bandwidth measured just before) and the share of the
step spent outside the linear layers (one pass of the same rows through the linear layers
alone, subtracted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from rtts.engines.kernels import KERNEL_CHOICES, KV_CHOICES

__all__ = ["PlayerResult", "add_parser", "bench_realtime", "play", "run", "setting"]

# ~10 s of speech at ChatTTS's pace; with --tokens 120 its segments make ~10-12 s of audio
PARAGRAPH = ("Good evening, and thanks for calling. Your table for four is booked for "
             "Friday at eight. We will send a reminder the day before, and if your plans "
             "change, just reply to that message. Is there anything else I can help with?")


@dataclass(frozen=True)
class PlayerResult:
    """What one paced listener heard."""

    ttfa_s: float  # request sent -> first frame
    audio_s: float  # audio received
    silence_s: float  # waiting for audio after playback started (prebuffer excluded)
    stalls: int  # times the buffer ran dry
    wall_s: float  # request sent -> last frame
    # per later segment: its first frame's arrival minus the previous segment's last one
    gaps_s: tuple[float, ...] = ()

    @property
    def silence_per_audio_s(self) -> float:
        return self.silence_s / self.audio_s if self.audio_s else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"ttfa_s": self.ttfa_s, "audio_s": self.audio_s, "silence_s": self.silence_s,
                "stalls": self.stalls, "silence_per_audio_s": self.silence_per_audio_s,
                "wall_s": self.wall_s}


def setting(name: str) -> dict[str, Any]:
    """EngineConfig fields of a ``--dtypes`` entry: ``DTYPE[+compile][+kvKV][+kernels=K]``
    (``int4+compile+kvbf16``: ``--dtype int4 --compile --kv-dtype bf16``;
    ``auto+kernels=fp16``: ``--dtype auto --kernels fp16``)."""
    dtype, *extra = name.split("+")
    out: dict[str, Any] = {"dtype": dtype, "compile": False}
    for part in extra:
        if part == "compile":
            out["compile"] = True
        elif part.startswith("kv") and part[2:] in KV_CHOICES:
            out["kv_dtype"] = part[2:]
        elif part.startswith("kernels=") and part[8:] in KERNEL_CHOICES:
            out["kernels"] = part[8:]
        else:
            raise ValueError(f"--dtypes {name!r}: +{part} is neither +compile, "
                             f"+kv{{{','.join(KV_CHOICES)}}} nor "
                             f"+kernels={{{','.join(KERNEL_CHOICES)}}}")
    return out


def segment_gaps(frames: Sequence[tuple[float, int]]) -> tuple[float, ...]:
    """``(arrival, segment)`` per frame -> the wait before each later segment's first
    frame after the previous segment's last one (0 when it was already there)."""
    last: dict[int, float] = {}
    first: dict[int, float] = {}
    for at, seg in frames:
        first.setdefault(seg, at)
        last[seg] = at
    return tuple(max(0.0, first[k] - last[k - 1]) for k in sorted(first) if k - 1 in last)


def play(chunks: Sequence[tuple[float, float]], sent: float, prebuffer_s: float
         ) -> PlayerResult:
    """The paced player over ``chunks`` ((arrival time, seconds of audio), in order).

    Playback starts ``prebuffer_s`` after the first arrival and runs continuously; a chunk
    that has not arrived when the previous one finishes playing is waited for (silence)."""
    if not chunks:
        return PlayerResult(0.0, 0.0, 0.0, 0, 0.0)
    clock = chunks[0][0] + prebuffer_s  # when the next chunk would start playing
    silence, stalls = 0.0, 0
    for arrival, seconds in chunks:
        if arrival > clock:
            silence += arrival - clock
            stalls += 1
            clock = arrival
        clock += seconds
    return PlayerResult(chunks[0][0] - sent, sum(s for _, s in chunks), silence, stalls,
                        chunks[-1][0] - sent)


async def listen(url: str, text: str, index: int, prebuffer_s: float,
                 anchor: bool | None = None) -> PlayerResult:
    """One session: send ``text``, record every frame's arrival, play it back paced.
    ``anchor`` None leaves the start option unset (the server's default)."""
    async with connect(url, max_size=None, ping_interval=None) as ws:
        await ws.recv()  # ready
        start: dict[str, object] = {"type": "start", "voice": f"seed:{index % 5}",
                                    "seed": 1 + index}
        if anchor is not None:
            start["anchor"] = anchor
        await ws.send(json.dumps(start))
        sent = time.perf_counter()
        await ws.send(json.dumps({"type": "text", "text": text}))
        await ws.send(json.dumps({"type": "end"}))
        chunks: list[tuple[float, float]] = []
        frames: list[tuple[float, int]] = []
        rate = 24000
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):  # 12-byte header, then PCM16
                now = time.perf_counter()
                chunks.append((now, (len(msg) - 12) / 2 / rate))
                frames.append((now, int.from_bytes(msg[4:8], "little")))
                continue
            event = json.loads(msg)
            if event["type"] == "segment_started":
                rate = event["sample_rate"]
            elif event["type"] == "error":
                raise RuntimeError(f"stream {index}: {event}")
            elif event["type"] == "done":
                return replace(play(chunks, sent, prebuffer_s), gaps_s=segment_gaps(frames))


def summarize(results: Sequence[PlayerResult], wall_s: float, tolerance_s: float
              ) -> dict[str, Any]:
    """One run of N streams: medians and totals, and whether nobody heard silence."""
    audio = sum(r.audio_s for r in results)
    silence = sum(r.silence_s for r in results)
    return {
        "streams": len(results),
        "ttfa_median_s": statistics.median(r.ttfa_s for r in results),
        "ttfa_max_s": max(r.ttfa_s for r in results),
        "audio_s": audio,
        "silence_s": silence,
        "silence_max_s": max(r.silence_s for r in results),
        "silence_per_audio_s": silence / audio if audio else 0.0,
        "wall_s": wall_s,
        "no_silence": all(r.silence_s <= tolerance_s for r in results),
        "next_segment_gap_max_s": max((g for r in results for g in r.gaps_s), default=0.0),
        "next_segment_gap_median_s": statistics.median(
            [g for r in results for g in r.gaps_s] or [0.0]),
        "per_stream": [r.as_dict() for r in results],
    }


def realtime_streams(runs: dict[str, list[dict[str, Any]]], name: str,
                     counts: Sequence[int]) -> int:
    """The largest count up to which every run of every count had no silence (0: none)."""
    best = 0
    for n in sorted(counts):
        rows = runs.get(f"{name}@{n}")
        if not rows or not all(r["no_silence"] for r in rows):
            break
        best = n
    return best


# -- the machine and the step ---------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def read_bandwidth(mb: int, repeat: int = 5, device: str = "cpu") -> float:
    """Bytes per second of one pass reading a ``mb`` MiB fp32 buffer (``sum``; best of
    ``repeat``), with torch's current threads (or on the GPU's memory)."""
    import torch

    x = torch.ones(mb * 2**20 // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def linear_pass_ms(engine: Any, rows: int, repeat: int = 5) -> float:
    """One pass of ``rows`` rows through the GPT's linear layers as installed (best of
    ``repeat``), i.e. the linear-layer part of a decode step."""
    import torch

    from rtts.engines.kernels import linears

    mods = linears(engine.chat.gpt.gpt)
    dev = engine.device
    xs = {int(m.in_features): torch.randn(rows, 1, int(m.in_features), device=dev,
                                          dtype=engine.chat.gpt.gpt.dtype) for m in mods}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeat + 1):
            _sync(dev)
            t0 = time.perf_counter()
            for m in mods:
                m(xs[int(m.in_features)])
            _sync(dev)
            best = min(best, time.perf_counter() - t0)
    return 1000 * best


def step_report(engine: Any, rows: Sequence[int], steps: int, bandwidth_mb: int
                ) -> dict[str, Any]:
    """The decode step at each row count: ms, its linear layers' ms, the share outside
    them, and (1 row) its multiple of the weight-read limit, against the read bandwidth
    measured just before (on a shared machine both move together)."""
    from rtts.bench.main import _step_ms

    table = engine.kernel_table
    bandwidth = read_bandwidth(bandwidth_mb, device=engine.device)
    out: dict[str, Any] = {"kernels": table.as_dict() if table else None, "rows": {},
                           "read_bandwidth_gb_s": bandwidth / 1e9}
    # a compiled step whose linears are inductor's (kernels.TEMPLATE_OPTIONS, or the
    # generated dot products of ``fp16`` at 1 row): an eager pass of the linears times
    # other kernels, so the share is not known (None) (table.template is set only for a
    # compiled step; fp16 at 2+ rows, and eager, is rtts's kernel either way)
    compiled = engine.compiled is not None
    # eager steps whose layers run in one C++ call (fp16layers): their linears have no
    # torch op around them, so a pass through the layers' torch calls times more
    looped = engine.layer_loop_rows if table is not None else ()

    def inside(r: int) -> bool:
        return table is not None and (table.template or r in looped or (
            compiled and r == 1 and table.chosen.get(r) == "fp16"))

    for r in rows:
        step = _step_ms(engine, r, steps)
        lin = None if inside(r) else linear_pass_ms(engine, r)
        out["rows"][r] = {"step_ms": step, "linear_ms": lin,
                          "outside_linear_share": None if lin is None else
                          max(0.0, 1 - lin / step)}
    if table is not None and table.bytes:
        wbytes = table.bytes[table.chosen[1]]
        limit = 1000 * wbytes / bandwidth
        out["weight_bytes"] = wbytes
        out["read_limit_ms"] = limit
        out["step1_over_limit"] = out["rows"][rows[0]]["step_ms"] / limit
    return out


def anchor_cost(engine: Any, rows: int, steps: int, sample_s: float) -> dict[str, Any]:
    """Prefill and decode step of ``rows`` rows, plain and anchored on a ``sample_s``
    second sample (as a context's later segments are): ms each, median of ``steps``."""
    import torch

    from rtts.core.params import SpeakerSample, SynthParams
    from rtts.engines.base import SynthRequest

    frames = max(1, int(sample_s * 24000 / 512))
    codes = torch.randint(0, 625, (4, frames), generator=torch.Generator().manual_seed(1))
    sample = SpeakerSample(codes.numpy().astype("<u2").tobytes(),
                           "Good evening, and thanks for calling.", 4)
    out: dict[str, Any] = {"rows": rows, "sample_s": frames * 512 / 24000}
    for label, smp in (("plain", None), ("anchored", sample)):
        reqs = [SynthRequest(PARAGRAPH[:80], SynthParams(seed=k, sample=smp),
                             max_new_token=steps + 8) for k in range(rows)]
        gpt = engine.batch(rows)
        with torch.no_grad():
            t0 = time.perf_counter()
            specs = engine._specs(reqs)
            gpt.add(specs)
            prefill = time.perf_counter() - t0
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                gpt.step()
                times.append(time.perf_counter() - t0)
        out[label] = {"prompt_tokens": int(specs[0].emb.shape[0]),
                      "prefill_ms": 1000 * prefill,
                      "step_ms": 1000 * statistics.median(times)}
    return out


# -- the run ---------------------------------------------------------------------------


async def bench_realtime(args: argparse.Namespace) -> dict[str, Any]:
    from rtts.engines.chattts import configure_threads_env

    configure_threads_env()
    import torch

    from rtts.bench.main import _cpu_model
    from rtts.config import EngineConfig, ServerConfig
    from rtts.core.cache import CacheConfig
    from rtts.core.scheduler import SchedulerConfig
    from rtts.engines.chattts import ChatTTSEngine, StockChatTTSEngine
    from rtts.engines.threads import run_in_own_thread
    from rtts.server import bound_port, run_server

    torch.set_num_threads(args.threads)
    counts = sorted({int(n) for n in args.streams.split(",")})
    dtypes = [d for d in args.dtypes.split(",") if d]
    # the batch `rtts serve` has (8 slots, 3 of them kept for first segments), or more
    # for more streams: with as many slots as streams, the reserve would leave one
    # stream's next segment waiting for a slot whenever every stream is speaking
    slots = max(max(counts), SchedulerConfig.max_batch_size)
    # as `rtts serve` (pacing on, GIL switch interval), but no phrase cache: every run
    # synthesizes the same text again; and N streams always run together: the governor
    # does not hold the batch at the measured capacity (streams beyond it would wait,
    # which shows as TTFA, not silence, and hides what N rows cost)
    sys.setswitchinterval(ServerConfig.gil_switch_interval_s)
    base = ServerConfig(port=0, ping_interval_s=None, web_dir=None,
                        cache=CacheConfig(memory_mb=0))
    base = replace(base, governor=replace(base.governor, degrade_streams_over_capacity=None))
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ecfg = EngineConfig(source="custom", model_dir=args.model_dir, device=device,
                        threads=args.threads, batch_rows=slots,
                        fixed_tokens=None if args.tokens_per_char else args.tokens,
                        fixed_tokens_per_char=args.tokens_per_char or None)
    out: dict[str, Any] = {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
        "device": device if device == "cpu" else torch.cuda.get_device_name(device),
        "torch": torch.__version__, "model_dir": str(args.model_dir), "text": args.text,
        "tokens": None if args.tokens_per_char else args.tokens,
        "tokens_per_char": args.tokens_per_char or None, "prebuffer_s": args.prebuffer,
        "silence_tolerance_s": args.silence_tolerance, "counts": counts, "repeat": args.repeat,
        "decode_tokens": args.decode_tokens or str(EngineConfig.decode_tokens),
        "steps": {}, "runs": {}, "load_s": {}}
    bandwidth = await run_in_own_thread(functools.partial(read_bandwidth, args.bandwidth_mb,
                                                          device=device))
    out["read_bandwidth_gb_s"] = bandwidth / 1e9
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({device}, {args.threads} threads)",
          file=sys.stderr, flush=True)
    setups: list[tuple[str, Any, SchedulerConfig, int]] = [
        (f"rtts-{d}", replace(ecfg, **setting(d)), SchedulerConfig(
            max_batch_size=slots, request_timeout_s=3600), slots) for d in dtypes]
    if args.stock_max_streams > 0:
        setups.append(("stock", ecfg, SchedulerConfig(
            max_batch_size=1, concurrency=1, request_timeout_s=3600), args.stock_max_streams))
    urls: dict[str, str] = {}
    engines: dict[str, Any] = {}
    step_rows = sorted({1, args.rows})
    async with contextlib.AsyncExitStack() as stack:
        for name, cfg, sched, _ in setups:
            t0 = time.perf_counter()
            engine = (StockChatTTSEngine if name == "stock" else ChatTTSEngine)(cfg)
            engines[name] = engine
            # threads that end with each call, as `rtts serve` does (rtts.engines.threads)
            await run_in_own_thread(engine.load)
            await run_in_own_thread(engine.warmup)
            out["load_s"][name] = time.perf_counter() - t0
            if name != "stock":
                rep = await run_in_own_thread(step_report, engine, step_rows, args.steps,
                                              args.bandwidth_mb)
                out["read_bandwidth_gb_s"] = max(out["read_bandwidth_gb_s"],
                                                 rep["read_bandwidth_gb_s"])
                rep["dtype"] = engine.config.dtype
                out["steps"][name] = rep
                if args.anchor == "both":
                    cost = {r: await run_in_own_thread(anchor_cost, engine, r, args.steps,
                                                       args.anchor_sample_s)
                            for r in step_rows}
                    out.setdefault("anchor_cost", {})[name] = cost
                    for r, c in cost.items():
                        print(f"{name}: {r} rows, prefill plain {c['plain']['prefill_ms']:.0f}"
                              f" ms / anchored {c['anchored']['prefill_ms']:.0f} ms "
                              f"({c['anchored']['prompt_tokens']} prompt tokens), step "
                              f"{c['plain']['step_ms']:.1f} / {c['anchored']['step_ms']:.1f} ms",
                              file=sys.stderr, flush=True)
                print(f"{name}: step " + ", ".join(
                    f"{r} rows {v['step_ms']:.1f} ms ("
                    + ("linears inside the compiled graph or the fp16 layer loop"
                       if v["outside_linear_share"] is None
                       else f"{100 * v['outside_linear_share']:.0f}% outside linears") + ")"
                    for r, v in rep["rows"].items())
                    + (f"; 1 row = {rep['step1_over_limit']:.2f}x its read limit "
                       f"{rep['read_limit_ms']:.1f} ms" if "read_limit_ms" in rep else ""),
                    file=sys.stderr, flush=True)
            app = await stack.enter_async_context(
                run_server(replace(base, scheduler=sched), engine, load=False))
            await app.start_serving()
            urls[name] = f"ws://127.0.0.1:{bound_port(app)}{base.ws_path}"
        modes: dict[str, list[tuple[str, bool | None]]] = {
            "auto": [("", None)], "on": [("", True)], "off": [("-noanchor", False)],
            "both": [("", True), ("-noanchor", False)]}
        variants = modes[args.anchor]
        # --decode-tokens: each rtts setting at each steady decode size (the engine's
        # config is switched between runs, so one loaded engine serves them all)
        sizes: list[int | None] = [int(d) for d in args.decode_tokens.split(",") if d] \
            if args.decode_tokens else [None]
        runs = [(name + suffix + (f"/d{size}" if size and len(sizes) > 1 else ""), name,
                 anchor, most, size) for name, _, _, most in setups
                for suffix, anchor in (variants if name != "stock" else [("", None)])
                for size in (sizes if name != "stock" else [None])]
        # Stock ChatTTS runs after every rtts run: its static batches run on the
        # scheduler's long-lived executor thread, and that thread's OpenMP team would slow
        # every rtts run after it (rtts.engines.threads), which no `rtts serve` has.
        ordered = [(n, rep_i, run) for last in (False, True) for n in counts
                   for rep_i in range(args.repeat) for run in runs
                   if (run[1] == "stock") == last]
        for n, rep_i, (label, name, anchor, most, size) in ordered:
            if n > most:
                continue
            if size is not None:
                engine = engines[name]
                engine.config = replace(engine.config, decode_tokens=size)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                listen(urls[name], args.text, i, args.prebuffer, anchor)
                for i in range(n)))
            row = summarize(results, time.perf_counter() - t0, args.silence_tolerance)
            # the real-time capacity the server measured from its own steps so far (what
            # /v1/info reports, and what holds lookahead rows back)
            kern = engines[name].info.kernels or {}
            row["server_capacity"] = kern.get("realtime_streams")
            out["runs"].setdefault(f"{label}@{n}", []).append(row)
            print(f"{label:>10} streams={n} run {rep_i + 1}: TTFA median "
                  f"{row['ttfa_median_s']:.2f}s, audio {row['audio_s']:.1f}s, "
                  f"silence {row['silence_s']:.2f}s "
                  f"({row['silence_per_audio_s']:.2f}/s of audio), next-segment gap "
                  f"max {row['next_segment_gap_max_s']:.2f}s; server-measured capacity "
                  f"{row['server_capacity']}", file=sys.stderr, flush=True)
    # the step times and decoding cost the servers measured while serving (ThreadTuner)
    out["served"] = {name: {k: (e.info.kernels or {}).get(k) for k in (
        "step_ms", "decode_s_per_audio_s", "realtime_streams")}
        for name, e in engines.items() if name != "stock"}
    out["summary"] = {key: {k: statistics.median(r[k] for r in rows) for k in (
        "ttfa_median_s", "ttfa_max_s", "audio_s", "silence_s", "silence_per_audio_s",
        "wall_s", "next_segment_gap_median_s", "next_segment_gap_max_s")}
        | {"no_silence": all(r["no_silence"] for r in rows)}
        for key, rows in out["runs"].items()}
    out["realtime_streams"] = {label: realtime_streams(out["runs"], label, counts)
                               for label, *_ in runs}
    return out


def add_parser(bench: argparse.ArgumentParser) -> None:
    """Add ``realtime`` to the ``rtts bench`` subcommands."""
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.add_parser("realtime", help="N streams through the native socket, each with a "
                       "paced player: TTFA, silence heard; stock ChatTTS beside")
    p.add_argument("--model-dir", type=Path, required=True,
                   help="checkpoint (e.g. from `rtts model make-random --size full`)")
    p.add_argument("--streams", default="1,2,4", help="stream counts (comma-separated)")
    p.add_argument("--dtypes", default="fp32", help="rtts settings: --dtype values, each "
                   "optionally with +compile (int4+compile: --dtype int4 --compile) and "
                   "+kvKV (int4+compile+kvbf16: also --kv-dtype bf16) and +kernels=K "
                   "(auto+kernels=fp16: also --kernels fp16)")
    p.add_argument("--tokens", type=int, default=120, help="GPT steps per segment")
    p.add_argument("--tokens-per-char", type=float, default=0.0,
                   help="instead of --tokens: each segment ceil(this x its characters) "
                   "GPT steps (speech-like lengths: 3.3 for English at ChatTTS's pace)")
    p.add_argument("--prebuffer", type=float, default=0.3,
                   help="seconds a player buffers after its first audio before playing")
    p.add_argument("--silence-tolerance", type=float, default=0.05,
                   help="a stream counts as without silence up to this many seconds")
    p.add_argument("--stock-max-streams", type=int, default=4,
                   help="run stock ChatTTS up to this many streams (0: not at all)")
    p.add_argument("--rows", type=int, default=4, help="also time the step at this many rows")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per row count")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="read-bandwidth buffer")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    p.add_argument("--text", default=PARAGRAPH)
    p.add_argument("--repeat", type=int, default=1, help="alternating runs per stream count")
    p.add_argument("--anchor", choices=("auto", "on", "off", "both"), default="auto",
                   help="speaker anchoring (the start option) in the rtts runs; auto: the "
                   "option unset (the server anchors where the engine has real-time "
                   "headroom); both: each rtts setting with and without, plus the "
                   "prefill/step of anchored rows")
    p.add_argument("--anchor-sample-s", type=float, default=3.0,
                   help="sample length for the anchored prefill/step timing (seconds)")
    p.add_argument("--decode-tokens", default="", help="steady decode sizes to compare "
                   "(comma-separated, e.g. 24,96; each rtts setting runs at each); default: "
                   "the engine's")
    p.add_argument("--json", type=Path, default=None, help="also write results here")


def run(args: argparse.Namespace) -> int:
    out = asyncio.run(bench_realtime(args))
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    return 0
