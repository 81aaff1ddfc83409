"""`rtts bench` runs end to end (its numbers are for the README, not asserted here)."""

from pathlib import Path

import pytest

from procs import free_port
from rtts.bench.main import (
    arrival_times,
    bench_chattts,
    bench_fake,
    bench_kernels,
    bench_soak,
    bench_staggered,
)
from rtts.cli.main import build_parser


@pytest.mark.chattts
async def test_chattts_bench_compares_equal_work(tiny_checkpoint: Path):
    args = build_parser().parse_args([
        "bench", "chattts", "--model-dir", str(tiny_checkpoint), "--streams", "2",
        "--tokens", "24", "--repeat", "1", "--threads", "2", "--device", "cpu",
        "--text", "A short benchmark sentence"])
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


@pytest.mark.chattts
async def test_staggered_bench_compares_static_and_continuous(tiny_checkpoint: Path):
    args = build_parser().parse_args([
        "bench", "staggered", "--model-dir", str(tiny_checkpoint), "--arrivals", "3",
        "--gap", "0.2", "--tokens", "24", "--slots", "4", "--threads", "2"])
    out = await bench_staggered(args)
    assert out["arrivals"] == pytest.approx([0.0, 0.2, 0.4])
    for mode in ("static", "continuous"):
        run = out["runs"][mode][0]
        assert len(run["ttfa_s"]) == 3 and all(t > 0 for t in run["ttfa_s"])
        assert out[mode]["late_max_ratio"] >= out[mode]["late_median_ratio"] > 0
    assert out["kernels"]["dtype"] == "fp32"


@pytest.mark.chattts
async def test_kernels_bench_reports_step_times_and_accuracy(tiny_checkpoint: Path):
    args = build_parser().parse_args([
        "bench", "kernels", "--model-dir", str(tiny_checkpoint), "--dtypes", "fp32,bf16",
        "--rows", "1,2", "--steps", "6", "--tokens", "16", "--threads", "2"])
    out = await bench_kernels(args)
    fp32, bf16 = out["dtypes"]["fp32"], out["dtypes"]["bf16"]
    assert fp32["greedy_agreement"] == 1.0 and fp32["logits_cosine_min"] > 0.9999
    assert 0.5 < bf16["greedy_agreement"] <= 1.0 and bf16["logits_cosine_mean"] > 0.99
    assert set(bf16["step_ms"]) == {1, 2} and all(v > 0 for v in bf16["step_ms"].values())


def test_arrival_times_fixed_gap_and_poisson():
    assert arrival_times(4, 1.5, False, 0) == [0.0, 1.5, 3.0, 4.5]
    poisson = arrival_times(200, 1.0, True, 7)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0.0 and all(g > 0 for g in gaps)
    assert 0.7 < sum(gaps) / len(gaps) < 1.3  # mean gap ~ 1 s
    assert arrival_times(200, 1.0, True, 7) == poisson  # seeded
