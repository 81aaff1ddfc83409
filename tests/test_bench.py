"""`rtts bench` runs end to end (its numbers are for the README, not asserted here)."""

import argparse
from pathlib import Path

import pytest

from procs import free_port
from rtts.bench import bench_chattts, bench_fake, bench_soak
from rtts.cli import build_parser


@pytest.mark.chattts
async def test_chattts_bench_compares_equal_work(tiny_checkpoint: Path):
    args = argparse.Namespace(model_dir=tiny_checkpoint, streams=2, tokens=24, repeat=1,
                              stream_tokens=8, threads=2, device="cpu",
                              text="A short benchmark sentence")
    out = await bench_chattts(args)
    runs = out["runs"]
    assert set(runs) == {"rtts@1", "rtts@2", "stock-serialized@1", "stock-serialized@2"}
    # every segment is forced to 24 tokens: both servers produced the same audio
    for n in (1, 2):
        a, b = runs[f"rtts@{n}"]["audio_s"], runs[f"stock-serialized@{n}"]["audio_s"]
        assert a == pytest.approx(b, rel=0.02) and a > 0
    assert out["throughput_ratio"] > 0 and out["ttfa1_ratio"] > 0


async def test_fake_bench_streams_and_holds_idle_connections():
    args = build_parser().parse_args([
        "bench", "fake", "--streams", "10", "--idle", "50", "--idle-hold", "0.2",
        "--fake-rtf", "0.2", "--ramp", "0.1", "--port", str(free_port()),
        "--text", "Ten streams at once. Then idle."])
    out = await bench_fake(args)
    assert out["streams"] == 10 and out["audio_s"] > 0
    assert out["frames"] > 0 and out["frame_latency_p99_ms"] >= out["frame_latency_p50_ms"]
    assert out["idle_alive_after_hold"] == 50


async def test_soak_bench_reports_sessions_rss_and_leaks():
    args = build_parser().parse_args([
        "bench", "soak", "--minutes", "0.05", "--concurrency", "5", "--sample-s", "0.5",
        "--port", str(free_port())])
    out = await bench_soak(args)
    assert out["sessions"] > 20 and out["errors"] == 0
    assert out["done"] > 0 and out["cancelled"] > 0  # every fifth session cancels
    assert out["cache_hits"] > 0  # recurring phrases
    assert out["open_connections_after"] == 0 and out["queue_depth_after"] == 0
    assert len(out["rss_series"]) >= 3 and out["rss_mb_final"] > 0
