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
        "bench", "kernels", "--model-dir", str(tiny_checkpoint), "--dtypes", "fp32,bf16,int4",
        "--rows", "1,2", "--steps", "6", "--tokens", "16", "--threads", "2"])
    out = await bench_kernels(args)
    fp32, bf16 = out["dtypes"]["fp32"], out["dtypes"]["bf16"]
    assert fp32["greedy_agreement"] == 1.0 and fp32["logits_cosine_min"] > 0.9999
    assert 0.5 < bf16["greedy_agreement"] <= 1.0 and bf16["logits_cosine_mean"] > 0.99
    assert set(bf16["step_ms"]) == {1, 2} and all(v > 0 for v in bf16["step_ms"].values())
    assert out["dtypes"]["int4"]["logits_cosine_mean"] > 0.9
    # the decoded audio of the same codes against the reference's: identical (None) or
    # rounding-close where only fp32 paths were chosen (on this tiny model they often
    # measure fastest), with fp32 keys/values and an fp32 decoder (int8/int4 decode in bf16
    # where that measured faster at load: not on a CPU without native bf16), else a finite
    # SNR
    for name, res in out["dtypes"].items():
        snr = res["audio_snr_db"]
        assert res["decode_dtype"] in ("fp32", "bf16", "int8")
        assert res["decode_dtype"] == "fp32" or name != "fp32"
        if (set(res["kernels"]["chosen"].values()) <= {"linear", "transposed"}
                and res["kernels"].get("kv_dtype", "fp32") == "fp32"
                and res["decode_dtype"] == "fp32"):
            assert snr is None or snr > 60
        else:
            assert isinstance(snr, float)


def test_arrival_times_fixed_gap_and_poisson():
    assert arrival_times(4, 1.5, False, 0) == [0.0, 1.5, 3.0, 4.5]
    poisson = arrival_times(200, 1.0, True, 7)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0.0 and all(g > 0 for g in gaps)
    assert 0.7 < sum(gaps) / len(gaps) < 1.3  # mean gap ~ 1 s
    assert arrival_times(200, 1.0, True, 7) == poisson  # seeded


def test_paced_player_counts_the_silence_a_listener_waits():
    from rtts.bench.realtime import play

    # arrivals (s) and durations: starts at 1.0 + 0.3 prebuffer; plays 0.5 s to 1.8;
    # the next chunk arrives at 2.0 (0.2 s silence), plays to 2.5; the last arrived early
    heard = play([(1.0, 0.5), (2.0, 0.5), (2.1, 0.4)], sent=0.5, prebuffer_s=0.3)
    assert heard.ttfa_s == pytest.approx(0.5) and heard.audio_s == pytest.approx(1.4)
    assert heard.silence_s == pytest.approx(0.2) and heard.stalls == 1
    assert heard.silence_per_audio_s == pytest.approx(0.2 / 1.4)
    assert heard.wall_s == pytest.approx(1.6)
    # a stream far ahead of its player never waits
    ahead = play([(0.0, 1.0)] + [(0.01 * i, 1.0) for i in range(1, 10)], 0.0, 0.3)
    assert ahead.silence_s == 0.0 and ahead.stalls == 0 and ahead.audio_s == 10.0
    assert play([], 0.0, 0.3).audio_s == 0.0


@pytest.mark.chattts
async def test_realtime_bench_reports_what_each_listener_heard(tiny_checkpoint: Path):
    from rtts.bench.realtime import bench_realtime

    args = build_parser().parse_args([
        "bench", "realtime", "--model-dir", str(tiny_checkpoint), "--streams", "1,2",
        "--dtypes", "fp32,int8", "--tokens", "16", "--stock-max-streams", "1",
        "--bandwidth-mb", "32", "--steps", "4", "--rows", "2", "--threads", "2",
        "--anchor", "both", "--text", "One short sentence. And a second one."])
    out = await bench_realtime(args)
    assert out["read_bandwidth_gb_s"] > 0 and out["prebuffer_s"] == 0.3
    assert set(out["runs"]) == {"rtts-fp32@1", "rtts-fp32@2", "rtts-int8@1", "rtts-int8@2",
                                "rtts-fp32-noanchor@1", "rtts-fp32-noanchor@2",
                                "rtts-int8-noanchor@1", "rtts-int8-noanchor@2", "stock@1"}
    for name in ("rtts-fp32", "rtts-int8"):  # anchored rows prefill the sample too
        for cost in out["anchor_cost"][name].values():
            frames = int(3.0 * 24000 / 512)  # the codes, plus the sample's text tokens
            assert cost["anchored"]["prompt_tokens"] > cost["plain"]["prompt_tokens"] + frames
            assert cost["anchored"]["prefill_ms"] > 0 and cost["anchored"]["step_ms"] > 0
    for [run] in out["runs"].values():
        assert run["next_segment_gap_max_s"] >= run["next_segment_gap_median_s"] >= 0
    for key, [run] in out["runs"].items():
        n = int(key.split("@")[1])
        assert run["streams"] == n == len(run["per_stream"])
        for s in run["per_stream"]:
            assert 0 < s["ttfa_s"] <= s["wall_s"] and s["silence_s"] >= 0 < s["audio_s"]
        assert run["audio_s"] == pytest.approx(sum(s["audio_s"] for s in run["per_stream"]))
        assert run["no_silence"] == all(
            s["silence_s"] <= args.silence_tolerance for s in run["per_stream"])
        summary = out["summary"][key]
        assert summary["silence_per_audio_s"] == pytest.approx(
            run["silence_s"] / run["audio_s"])
    # every setting produced the same audio per stream (equal work)
    audio = {k: r[0]["per_stream"][0]["audio_s"] for k, r in out["runs"].items()}
    assert max(audio.values()) == pytest.approx(min(audio.values()), rel=0.02)
    for name in ("rtts-fp32", "rtts-int8"):
        step = out["steps"][name]
        assert set(step["rows"]) == {1, 2} and step["dtype"] == name[5:]
        for r in step["rows"].values():
            assert r["step_ms"] > 0 and r["linear_ms"] > 0
            assert 0 <= r["outside_linear_share"] < 1
        assert 0 < step["read_bandwidth_gb_s"] <= out["read_bandwidth_gb_s"]  # the best
        assert step["read_limit_ms"] == pytest.approx(
            1000 * step["weight_bytes"] / (step["read_bandwidth_gb_s"] * 1e9))
        assert step["step1_over_limit"] == pytest.approx(
            step["rows"][1]["step_ms"] / step["read_limit_ms"])
        table = step["kernels"]  # the bytes of the path chosen at 1 row
        assert step["weight_bytes"] == table["bytes"][table["chosen"][1]] > 0
    for name, best in out["realtime_streams"].items():
        assert best in (0, 1, 2) and (best == 0 or out["summary"][f"{name}@{best}"]["no_silence"])


def test_bench_settings_name_dtype_compile_and_kv_precision():
    """``--dtypes`` entries of `bench realtime` and `bench kernels`: DTYPE, +compile and
    +kvKV and +kernels=K in any order after it; anything else is refused with the entry
    named."""
    from rtts.bench.realtime import setting

    assert setting("auto") == {"dtype": "auto", "compile": False}
    assert setting("int4+compile") == {"dtype": "int4", "compile": True}
    assert setting("int4+kvbf16+compile") == {"dtype": "int4", "compile": True,
                                              "kv_dtype": "bf16"}
    assert setting("auto+compile+kernels=fp16") == {"dtype": "auto", "compile": True,
                                                    "kernels": "fp16"}
    for bad in ("int4+kvfp16", "int4+fast", "auto+kernels=fp8"):
        with pytest.raises(ValueError, match="--dtypes"):
            setting(bad)


def test_step_report_leaves_the_linear_share_empty_where_inductor_holds_the_linears(
        monkeypatch):
    """A compiled step whose bf16 linears are inductor's (``kernels.template``): an eager
    pass of the linears would time other kernels, so ``linear_ms`` and the share outside
    them are None; the step and its multiple of the read limit are still reported."""
    from types import SimpleNamespace

    import rtts.bench.main as bench_main
    from rtts.bench import realtime
    from rtts.engines.kernels import KernelTable

    monkeypatch.setattr(realtime, "read_bandwidth", lambda mb, device="cpu": 1e9)
    monkeypatch.setattr(bench_main, "_step_ms", lambda engine, rows, steps: 10.0 * rows)
    monkeypatch.setattr(realtime, "linear_pass_ms", lambda engine, rows: 4.0 * rows)
    for template, share in ((True, None), (False, 0.6)):
        table = KernelTable("auto", {1: "bf16p", 2: "bf16p"}, bytes={"bf16p": 5_000_000},
                            template=template)
        rep = realtime.step_report(SimpleNamespace(kernel_table=table, device="cpu",
                                                   compiled=object() if template else None,
                                                   layer_loop_rows=[]),
                                   [1, 2], steps=4, bandwidth_mb=1)
        assert [r["step_ms"] for r in rep["rows"].values()] == [10.0, 20.0]
        assert rep["rows"][1]["outside_linear_share"] == (
            None if share is None else pytest.approx(share))
        assert (rep["rows"][2]["linear_ms"] is None) == template
        assert rep["read_limit_ms"] == pytest.approx(5.0)
        assert rep["step1_over_limit"] == pytest.approx(2.0)
    # fp16: a compiled 1-row step's linears are generated inside its graph; its 2+ rows,
    # and an eager step, run rtts's own kernel, which an eager pass times, except where
    # the eager step's layers run in one C++ call (fp16layers: engine.layer_loop_rows)
    table = KernelTable("auto", {1: "fp16", 2: "fp16"}, bytes={"fp16": 5_000_000})
    for compiled, looped, unknown in ((object(), (), [1]), (None, (), []),
                                      (None, (1, 2), [1, 2])):
        engine = SimpleNamespace(kernel_table=table, device="cpu", compiled=compiled,
                                 layer_loop_rows=list(looped))
        rep = realtime.step_report(engine, [1, 2], steps=4, bandwidth_mb=1)
        assert [r for r in (1, 2) if rep["rows"][r]["linear_ms"] is None] == unknown
