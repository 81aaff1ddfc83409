"""`rtts bench` runs end to end (its numbers are for the README, not asserted here)."""

import argparse
import socket
from pathlib import Path

import pytest

from rtts.bench import bench_chattts, bench_fake


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    args = argparse.Namespace(streams=10, idle=50, idle_hold=0.2, fake_rtf=0.2, max_lead=2.0,
                              ramp=0.1, port=free_port(), text="Ten streams at once. Then idle.")
    out = await bench_fake(args)
    assert out["streams"] == 10 and out["audio_s"] > 0
    assert out["frames"] > 0 and out["frame_latency_p99_ms"] >= out["frame_latency_p50_ms"]
    assert out["idle_alive_after_hold"] == 50
