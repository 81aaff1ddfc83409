"""The real ChatTTS code on the tiny random-weight checkpoint (no mocks)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ChatTTS")

from helpers import base_config, client, server  # noqa: E402
from rtts.config import EngineConfig  # noqa: E402
from rtts.core.params import SynthParams  # noqa: E402
from rtts.engines import kernels  # noqa: E402
from rtts.engines.base import SynthRequest  # noqa: E402
from rtts.engines.chattts import ChatTTSEngine  # noqa: E402

pytestmark = pytest.mark.chattts


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> ChatTTSEngine:
    # fp32: the exactness tests compare against ChatTTS's own (fp32) GPT
    eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     stream_tokens=8, dtype="fp32"))
    eng.load()
    eng.warmup()
    return eng


def run(engine, requests):
    out: dict[int, list[np.ndarray]] = {i: [] for i in range(len(requests))}
    ended = set()
    for row, chunk in engine.generate(requests):
        assert row not in ended, "no audio after a row's end marker"
        if chunk is None:
            ended.add(row)
        else:
            out[row].append(chunk)
    assert ended == set(range(len(requests)))
    return {i: np.concatenate(c) if c else np.zeros(0, np.float32) for i, c in out.items()}


def test_loads_through_chat_load_and_is_marked_random(engine):
    from ChatTTS import Chat

    assert isinstance(engine.chat, Chat)
    assert engine.random_weights and engine.chat.has_loaded()


def test_stream_length_matches_token_count(engine):
    audio = run(engine, [SynthRequest("Hello world.", SynthParams(seed=5), max_new_token=40)])[0]
    # ChatTTS: T tokens -> (2T-1)*256 samples (unless EOS came early)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) <= (2 * 40 - 1) * 256 and len(audio) % 256 == 0
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_windowed_decode_matches_whole_decode(engine):
    """Incremental decoding (linear work) must give the audio a whole-prefix decode gives."""
    import torch
    from ChatTTS.model import GPT, gen_logits

    chat = engine.chat
    req = SynthRequest("你好，世界。The quick brown fox.", SynthParams(seed=11), max_new_token=64)
    streamed = run(engine, [req])[0]
    # Same seed => same tokens: regenerate without streaming and decode everything at once.
    prompts = chat.speaker.decorate_code_prompts(
        [chat.normalizer(req.text, True, True, None)], "[speed_5]", None, "spk")
    ids, mask, tmask = chat.tokenizer.encode(prompts, 4, device=chat.device_gpt)
    emb = chat.embed(ids, tmask)
    chat.speaker.apply(emb, engine._voice_tensor(None), ids, chat.tokenizer.spk_emb_ids,
                       chat.gpt.device_gpt)
    warpers, procs = gen_logits(num_code=625, top_P=0.7, top_K=20, repetition_penalty=1.05)
    result = list(chat.gpt.generate(
        emb, ids, temperature=torch.tensor([0.3] * 4), eos_token=625, attention_mask=mask,
        max_new_token=64, min_new_token=0, logits_processors=(*procs, *warpers),
        infer_text=False, return_hidden=True, stream=False, show_tqdm=False,
        manual_seed=11, context=GPT.Context()))[-1]
    whole = chat._decode_to_wavs([result.hiddens[0]], True)[0]
    n = min(len(whole), len(streamed))
    assert abs(len(whole) - len(streamed)) <= 256
    err = np.sqrt(np.mean((whole[:n] - streamed[:n]) ** 2))
    rms = np.sqrt(np.mean(whole[:n] ** 2))
    assert err < 0.05 * rms, (err, rms)


def test_batch_rows_have_their_own_voice_speed_and_length(engine):
    reqs = [SynthRequest("Short.", SynthParams(voice="seed:1", speed=2), max_new_token=24),
            SynthRequest("A longer one here.", SynthParams(voice="seed:2", speed=8),
                         max_new_token=48)]
    audio = run(engine, reqs)
    assert len(audio[0]) <= (2 * 24 - 1) * 256 < len(audio[1]) or len(audio[1]) > 0
    assert len(audio[1]) <= (2 * 48 - 1) * 256


def test_cancelled_row_gets_no_more_audio(engine):
    reqs = [SynthRequest("one", SynthParams(seed=1), max_new_token=64),
            SynthRequest("two", SynthParams(seed=2), max_new_token=64)]
    seen = {0: 0, 1: 0}
    ended = set()
    for row, chunk in engine.generate(reqs):
        if chunk is None:
            ended.add(row)
        else:
            assert row not in ended
            seen[row] += 1
            if row == 0 and seen[0] == 1:
                reqs[0].cancel()
    assert seen[0] == 1 and seen[1] >= 1 and ended == {0, 1}


def test_custom_voice_string_and_validation(engine):
    voice = engine.random_speaker()
    engine.validate(SynthParams(voice=voice))
    with pytest.raises(ValueError):
        engine.validate(SynthParams(voice="definitely not an embedding"))


async def test_streams_through_the_server(tiny_checkpoint: Path):
    cfg = replace(base_config(), engine=EngineConfig(source="custom",
                                                     model_dir=tiny_checkpoint, threads=2))
    eng = ChatTTSEngine(cfg.engine)
    async with server(cfg, eng) as (app, url):
        assert app.state == "ready"

        async def speak(cid: str, text: str, rate: int):
            async with client(url) as c:
                await c.send(type="start", context_id=cid, voice="seed:3", seed=7,
                             sample_rate=rate)
                for i in range(0, len(text), 4):
                    await c.send(type="text", context_id=cid, text=text[i:i + 4])
                await c.send(type="end", context_id=cid)
                done = await c.until("done", cid, timeout=60)
                return c, done

        (c1, d1), (c2, d2) = await asyncio.gather(
            speak("en", "Hello there, streaming speech. It works well.", 24000),
            speak("zh", "你好，世界！今天天气很好。我们去公园散步吧。", 16000))
        for c, d in ((c1, d1), (c2, d2)):
            segs = c.got.of("segment_done")
            assert d["segments"] == len(segs) >= 2
            pcm = np.frombuffer(c.got.audio(1), dtype="<i2")
            assert len(pcm) == sum(e["samples"] for e in segs) > 0
            assert np.abs(pcm).max() > 100  # random weights still make sound
        assert c2.got.of("segment_started")[0]["sample_rate"] == 16000
        sched = app.scheduler
        # the two streams shared batches: together from the start, or one joined the other's
        assert max(sched.batch_sizes) >= 2 or sched.joined >= 1
        info = app.info()  # what /v1/info serves
        assert info["batching"] == {"mode": "continuous", "slots": 8, "first_segment_slots": 3}
        # the default --dtype auto: fp32 or bf16 paths (bf16p is oneDNN's prepacked bf16),
        # or fp16 weights where oneDNN has no bf16, whichever measured faster
        assert info["kernels"]["dtype"] == "auto" and 1 in info["kernels"]["chosen"]
        assert set(info["kernels"]["chosen"].values()) <= {"linear", "transposed", "bf16",
                                                            "bf16p", "fp16"}
        assert info["kernels"]["threads"] in (1, 2)  # what the ThreadTuner runs on now
        assert info["kernels"]["kv_dtype"] in ("fp32", "bf16")  # the faster one measured
        # the eager steps whose layers run in one C++ call: the rows that chose fp16
        assert info["kernels"]["layer_loop_rows"] == (
            [] if info["kernels"]["kv_dtype"] != "fp32" else
            sorted(r for r, p in info["kernels"]["chosen"].items()
                   if p == "fp16" and r != kernels.PREFILL_ROWS))
        # capacity measured from the steps and decodes that just ran
        kern = info["kernels"]
        assert kern["step_ms"] and all(ms > 0 for ms in kern["step_ms"].values())
        assert kern["decode_s_per_audio_s"] > 0 and kern["prefill_s_per_audio_s"] >= 0
        assert 0 <= kern["realtime_streams"] <= 8
        # the linears' ms per decode row count, timed at load and scaled to all of them
        assert set(kern["linear_ms"]) == set(range(1, 9))
        assert all(ms > 0 for ms in kern["linear_ms"].values())
        from rtts.metrics import render_metrics

        metrics = render_metrics(app)
        assert f"rtts_realtime_capacity_streams {kern['realtime_streams']}" in metrics
        assert "rtts_realtime_headroom_streams " in metrics


def test_int8_engine_measures_its_decoder_precision_and_decodes_audio(tiny_checkpoint):
    """For int8/int4 the decoder's precision (fp32, bf16 autocast or int8) is measured at load;
    the chosen one decodes finite audio close to the fp32 decode."""
    import torch

    eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     stream_tokens=8, dtype="int8", batch_rows=2))
    eng.load()
    try:
        assert eng.decode_dtype in ("fp32", "bf16", "int8")
        assert set(eng.decode_ms) == {"fp32", "bf16", "int8"}
        assert eng.info.kernels["decode_dtype"] == eng.decode_dtype
        assert eng.kernel_table.kv_dtype in ("fp32", "bf16")
        hidden = eng.chat.gpt.gpt.config.hidden_size
        window = torch.randn(24, hidden, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = eng.chat._decode_to_wavs([window.clone()], True)[0]
            eng.decode_dtype = "bf16"
            got = eng._decode([window.clone()])[0]
            # the bf16 twin (weights cast and prepacked once) computes what bf16 autocast
            # over the fp32 modules computes (which casts every weight at every decode)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = eng.chat._decode_to_wavs([window.clone()], True)[0]
            # the int8 twin (fbgemm dynamic int8 Linear layers), and two rows decoded
            # together (one activation scale per call) stay close to fp32 too
            eng.decode_dtype = "int8"
            q8 = eng._decode([window.clone()])[0]
            q8_pair = eng._decode([window.clone(), window[:16].clone()])[0]
        assert got.shape == ref.shape and np.isfinite(got).all()

        def snr(a, b):
            return 10 * np.log10((a ** 2).sum() / max(1e-30, ((b - a) ** 2).sum()))

        assert snr(ref, got) > 20, snr(ref, got)
        assert snr(auto, got) > 50, snr(auto, got)
        assert q8.shape == ref.shape and np.isfinite(q8).all()
        assert snr(ref, q8) > 20, snr(ref, q8)
        assert snr(ref, q8_pair) > 20, snr(ref, q8_pair)
    finally:
        eng.close()


def test_near_lossless_engines_time_a_bf16_decoder_but_never_int8(tiny_checkpoint):
    """--dtype auto (the default) and bf16 time the fp32 and bf16 decoders at load and keep
    the faster; int8 (lossy) is not a candidate for them. --dtype fp32 and forced fp32
    kernels keep the exact fp32 decoder, untimed."""
    def engine(**cfg: str) -> ChatTTSEngine:
        eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint,
                                         threads=2, batch_rows=2, **cfg))
        eng.load()
        return eng

    for cfg in ({}, {"dtype": "bf16"}):
        eng = engine(**cfg)
        try:
            assert set(eng.decode_ms) == {"fp32", "bf16"}, cfg
            assert eng.decode_dtype == min(eng.decode_ms, key=lambda k: eng.decode_ms[k])
            assert eng.info.kernels["decode_dtype"] == eng.decode_dtype
            assert set(eng._decoders) <= {eng.decode_dtype}  # the loser's twin is dropped
        finally:
            eng.close()
    for cfg in ({"dtype": "fp32"}, {"kernels": "linear"}):
        eng = engine(**cfg)
        try:
            assert eng.decode_dtype == "fp32" and eng.decode_ms == {}, cfg
            # and F.linear code heads (install_heads times others only beside a non-fp32 step)
            assert eng.chat.gpt._rtts_heads_fn is None and eng.kernel_table.heads == {}
        finally:
            eng.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_lossy_engines_time_an_int8_decoder_with_their_margin(tiny_checkpoint, dtype):
    """int8 and int4 time the fp32, bf16 and int8 decoders; int8's is kept where it is
    INT8_DECODE_MARGIN[dtype] times faster than the faster of the other two (1.25 for
    int8, 1.0 for int4: the fastest, its GPT being 23 dB from fp32 already)."""
    from rtts.engines.chattts import INT8_DECODE_MARGIN

    eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     batch_rows=2, dtype=dtype))
    eng.load()
    try:
        ms = eng.decode_ms
        assert set(ms) == {"fp32", "bf16", "int8"}
        near = min(("fp32", "bf16"), key=lambda k: ms[k])
        margin = INT8_DECODE_MARGIN[dtype]
        assert eng.decode_dtype == ("int8" if ms["int8"] * margin < ms[near] else near)
        table = eng.kernel_table
        assert set(table.heads) <= {r for r, p in table.chosen.items()
                                    if p not in kernels.FP32_PATHS}
        assert (eng.chat.gpt._rtts_heads_fn is None) == (set(table.heads.values()) <= {"linear"})
        # an eager step's attention on the thread count that measured faster at load
        assert {"fp32_threads", "bf16_threads"} <= set(table.kv_us)
        assert eng.batch(2).solo_attention == kernels.solo_attention(table.kv_dtype,
                                                                    table.kv_us)
    finally:
        eng.close()


def test_engine_identity_names_the_weights_not_the_path(engine, tiny_checkpoint, tmp_path):
    """The phrase-cache namespace: equal for a copy of the same weights, different for
    other weights or other decode settings."""
    import shutil

    from rtts.engines.chattts import _identity

    cfg = engine.config
    assert engine.identity == f"chattts:{_identity(cfg, tiny_checkpoint, 'custom')}"
    copy = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, copy)
    assert _identity(cfg, copy, "custom") == _identity(cfg, tiny_checkpoint, "custom")
    assert _identity(replace(cfg, decode_tokens=cfg.decode_tokens + 1), copy, "custom") != \
        _identity(cfg, copy, "custom")
    victim = next(p for p in sorted(copy.rglob("*.safetensors")))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert _identity(cfg, copy, "custom") != _identity(cfg, tiny_checkpoint, "custom")


def _prompt(engine, texts):
    chat = engine.chat
    prompts = []
    for t in texts:
        prompts += chat.speaker.decorate_code_prompts([t], "[speed_5]", None, "spk")
    ids, mask, text_mask = chat.tokenizer.encode(prompts, 4, device=chat.device_gpt)
    return ids, mask, chat.embed(ids, text_mask)


def _processors():
    from ChatTTS.model import gen_logits

    warpers, processors = gen_logits(num_code=625, top_P=0.7, top_K=20, repetition_penalty=1.05)
    return (*processors, *warpers)


TEXTS = ["Hello there, how are you?", "Hi.", "一个比较长的中文句子，用来测试填充。"]


def _reference(engine, text, n, seed=7, temperature=0.3):
    """ChatTTS's own GPT.generate, the row alone."""
    import torch
    from ChatTTS.model import GPT

    ids, mask, emb = _prompt(engine, [text])
    with torch.no_grad():
        return list(engine.chat.gpt.generate(
            emb, ids, temperature=torch.tensor([temperature] * 4), eos_token=625,
            attention_mask=mask, max_new_token=n, min_new_token=n,
            logits_processors=_processors(), infer_text=False, return_hidden=True,
            stream=False, show_tqdm=False, manual_seed=seed, context=GPT.Context()))[-1]


def _spec(engine, text, n, seed=7, **kw):
    from rtts.engines.gpt_loop import RowSpec

    _ids, _mask, emb = _prompt(engine, [text])
    return RowSpec(emb=emb[0].detach(), limit=n, min_tokens=n, seed=seed, **kw)


def _gpt(engine, slots=4, columns=256, kv_dtype=None):
    from rtts.engines.gpt_loop import BatchedGpt

    return BatchedGpt(engine.chat.gpt, 4, 625, slots=slots, columns=columns, kv_dtype=kv_dtype)


def _finish(gpt, rows):
    import torch

    with torch.no_grad():
        while not all(r.finished or r.evicted for r in rows):
            gpt.step()


def _joined(engine, gpt, first, later, n, steps=0):
    """``first`` alone for ``steps`` steps, then rows for ``later`` join; every row runs
    to ``n`` tokens. The rows, ``first``'s first."""
    import torch

    with torch.no_grad():
        rows = gpt.add([_spec(engine, first, n)])
        for _ in range(steps):
            gpt.step()
        if later:
            rows += gpt.add([_spec(engine, text, n) for text in later])
    _finish(gpt, rows)
    return rows


def test_own_gpt_loop_matches_chattts_generate_for_a_row_alone(engine):
    """Same seed, same recipe: rtts's loop reproduces GPT.generate's hidden states."""
    import torch

    n = 24
    for text in TEXTS:
        ref = _reference(engine, text, n)
        gpt = _gpt(engine)
        with torch.no_grad():
            [row] = gpt.add([_spec(engine, text, n)])
        _finish(gpt, [row])
        assert row.length == n
        assert torch.allclose(ref.hiddens[0], row.hiddens[:n], atol=1e-5)


def test_rows_started_together_or_joining_mid_batch_match_running_alone(engine):
    """Continuous batching: a row that joins a running batch (with a longer prompt than the
    history, so the columns shift; with a tiny buffer, so they compact and grow) produces
    the hidden states it produces alone, for a fixed seed."""
    import torch

    n = 24
    refs = [_reference(engine, t, n).hiddens[0] for t in TEXTS]
    gpt = _gpt(engine, columns=16)
    with torch.no_grad():
        together = gpt.add([_spec(engine, t, n) for t in TEXTS])  # left-padded prefill
    _finish(gpt, together)
    gpt = _gpt(engine, columns=8)
    with torch.no_grad():
        joined = gpt.add([_spec(engine, TEXTS[1], n)])
        for _ in range(5):
            gpt.step()
        joined += gpt.add([_spec(engine, TEXTS[2], n)])
        for _ in range(7):
            gpt.step()
        joined += gpt.add([_spec(engine, TEXTS[0], n)])
    _finish(gpt, joined)
    for k, row in enumerate(together):
        assert torch.allclose(refs[k], row.hiddens[:n], atol=1e-4)
    for k, row in zip([1, 2, 0], joined, strict=True):
        assert row.length == n
        assert torch.allclose(refs[k], row.hiddens[:n], atol=1e-4)
    # rows computed per forward: 1 alone, then 2, then 3, then falling as rows end
    assert gpt.forward_rows[:6] == [1] * 6 and gpt.forward_rows[7] == 2
    assert max(gpt.forward_rows) == 3 and gpt.forward_rows[-1] == 1


def _kv_alone_and_joined(engine, kv_dtype, n=12):
    """TEXTS[0] alone in a batch with ``kv_dtype`` keys/values, then the same text joining
    a batch of 8 columns after TEXTS[1]'s first 3 steps (the buffer shifts, compacts and
    grows). Returns (ChatTTS's fp32 hidden states alone, the first batch, its row, the
    second batch, its rows)."""
    import torch

    ref = _reference(engine, TEXTS[0], n).hiddens[0]
    gpt = _gpt(engine, kv_dtype=kv_dtype)
    with torch.no_grad():
        [alone] = gpt.add([_spec(engine, TEXTS[0], n)])
    _finish(gpt, [alone])
    small = _gpt(engine, columns=8, kv_dtype=kv_dtype)
    with torch.no_grad():
        rows = small.add([_spec(engine, TEXTS[1], n)])
        for _ in range(3):
            small.step()
        rows += small.add([_spec(engine, TEXTS[0], n)])
    _finish(small, rows)
    return ref, gpt, alone, small, rows


def test_bf16_keys_and_values_stay_close_to_fp32_and_keep_joins_consistent(engine):
    """bf16 keys/values (every --dtype but fp32): the first steps' hidden states stay close
    to the fp32 buffers' (the same codes are drawn while they do), and a row that joins
    mid-batch computes what it computes alone with the same bf16 buffers."""
    import torch

    n = 12
    ref, gpt, alone, _small, rows = _kv_alone_and_joined(engine, torch.bfloat16, n)
    assert gpt.keys[0].dtype == torch.bfloat16 and gpt.values[-1].dtype == torch.bfloat16
    cos = torch.nn.functional.cosine_similarity(ref[:4], alone.hiddens[:4], dim=-1)
    assert float(cos.min()) > 0.999
    assert torch.allclose(alone.hiddens[:n], rows[1].hiddens[:n], atol=1e-2)


def test_int8_keys_and_values_stay_close_and_keep_joins_consistent(engine):
    """int8 keys/values (--kv-dtype int8, or chosen for a compiled int8/int4 step): the
    first steps' hidden states stay close to ChatTTS's fp32 ones, and a row that joins
    a batch whose buffer shifts, compacts and grows (its scales moving with it) computes
    what it computes alone with the same int8 buffers."""
    import torch

    n = 12
    ref, gpt, alone, small, rows = _kv_alone_and_joined(engine, torch.int8, n)
    assert gpt.keys[0].dtype == torch.int8 and gpt.sdpa_dtype == torch.float32
    assert len(gpt.key_scales) == len(gpt.value_scales) == len(gpt.keys)
    assert gpt.key_scales[0].shape[-1] == 256
    cos = torch.nn.functional.cosine_similarity(ref[:4], alone.hiddens[:4], dim=-1)
    assert float(cos.min()) > 0.99
    assert small.columns > 8 and small.value_scales[0].shape[2] == small.columns
    assert torch.allclose(alone.hiddens[:n], rows[1].hiddens[:n], atol=2e-2)


def test_per_row_sampling_params_in_one_batch(engine):
    """Rows with different temperature / top-P / top-K / seed share one forward, and each
    draws the codes it draws alone with those settings."""
    import torch

    n = 16
    settings = [dict(seed=3, temperature=0.1, top_p=0.5, top_k=5),
                dict(seed=4, temperature=1.2, top_p=0.95, top_k=60),
                dict(seed=5, temperature=0.3, top_p=0.7, top_k=20)]
    alone = []
    for kw in settings:
        gpt = _gpt(engine)
        with torch.no_grad():
            [row] = gpt.add([_spec(engine, TEXTS[0], n, **kw)])
        _finish(gpt, [row])
        alone.append(row.codes[:n].clone())
    gpt = _gpt(engine)
    with torch.no_grad():
        rows = gpt.add([_spec(engine, TEXTS[0], n, **kw) for kw in settings])
    _finish(gpt, rows)
    assert set(gpt.forward_rows) == {3}  # one batch throughout
    for row, ref in zip(rows, alone, strict=True):
        assert torch.equal(row.codes[:n], ref)
    assert not torch.equal(rows[0].codes[:n], rows[1].codes[:n])
    # The seeded recipe is ChatTTS's: temperature 0.3 alone equals GPT.generate.
    ref = _reference(engine, TEXTS[0], n, seed=5)
    assert torch.allclose(ref.hiddens[0], rows[2].hiddens[:n], atol=1e-4)


def test_a_seeded_row_beside_unseeded_rows_draws_its_own_codes(engine):
    """A seeded row's draw is argmax(p / q) with its generator's Exp(1) noise q, drawn once
    (ChatTTS re-seeds every step, so q never changes): beside unseeded rows, which draw
    from the global generator, it still draws the codes it draws alone."""
    import torch

    n = 12
    gpt = _gpt(engine)
    with torch.no_grad():
        [alone] = gpt.add([_spec(engine, TEXTS[0], n, seed=5)])
    _finish(gpt, [alone])
    gpt = _gpt(engine)
    with torch.no_grad():
        rows = gpt.add([_spec(engine, TEXTS[1], n, seed=None),
                        _spec(engine, TEXTS[0], n, seed=5),
                        _spec(engine, TEXTS[2], n, seed=None)])
    _finish(gpt, rows)
    assert set(gpt.forward_rows) == {3}
    assert torch.equal(rows[1].codes[:n], alone.codes[:n])
    assert rows[1].noise is not None and rows[1].noise.shape[0] == 4
    assert rows[0].noise is None and rows[2].noise is None


def test_finished_and_cancelled_rows_leave_and_free_their_slot(engine):
    import torch

    gpt = _gpt(engine, slots=2)
    with torch.no_grad():
        a, b = gpt.add([_spec(engine, "one", 8), _spec(engine, "two", 40)])
        assert gpt.free_slots == 0
        for _ in range(4):
            gpt.step()
        gpt.cancel(lambda r: r is b)  # the client cancels b mid-batch
        gpt.step()  # b is evicted before this step computes
        assert b.evicted and 4 <= b.length <= 5 and gpt.free_slots == 1
        [c] = gpt.add([_spec(engine, "three", 8)])  # a waiting request takes the slot
        _finish(gpt, [a, c])
    assert a.length == 8 and c.length == 8
    assert gpt.forward_rows[:5] == [2] * 5  # prefill + 4 steps with both rows
    assert gpt.forward_rows[5] == 1  # the step right after the cancel: a alone
    assert 2 in gpt.forward_rows[7:]  # c joined a's batch
    assert gpt.forward_rows[-1] == 1


def test_engine_serve_admits_a_request_into_the_running_batch(engine):
    """ChatTTSEngine.serve: the second request arrives while the first is generating,
    joins its batch, and its audio is what it produces alone (same seed)."""
    a = SynthRequest("The first request is longer.", SynthParams(seed=4), max_new_token=48)
    b = SynthRequest("A late one.", SynthParams(seed=9, temperature=0.6), max_new_token=32)
    alone = run(engine, [SynthRequest(b.text, b.params, max_new_token=32)])[0]
    queue: list[SynthRequest] = [a]
    frees: list[int] = []

    def admit(free):
        frees.append(free)
        taken = queue[:free]
        del queue[:free]
        return taken

    audio: dict[int, list[np.ndarray]] = {id(a): [], id(b): []}
    ended = []
    for request, chunk in engine.serve(admit, 4):
        if chunk is None:
            ended.append(request)
            continue
        audio[id(request)].append(chunk)
        if request is a and len(audio[id(a)]) == 1:
            queue.append(b)  # arrives while a's batch runs
    assert ended.index(b) >= 0 and set(map(id, ended)) == {id(a), id(b)}
    joined = np.concatenate(audio[id(b)])
    assert len(joined) == len(alone)
    assert np.allclose(joined, alone, atol=1e-3 * max(1e-6, float(np.abs(alone).max())) + 1e-5)
    assert frees[0] == 4 and 3 in frees  # a took a slot, b took one of the 3 left


def test_engine_measured_and_installed_its_linear_kernels(engine):
    from rtts.engines import kernels

    table = engine.kernel_table
    assert table is not None and table.dtype == "fp32"
    assert sorted(table.chosen) == [*range(1, engine.config.batch_rows + 1),
                                    kernels.PREFILL_ROWS]
    assert set(table.chosen.values()) <= {"linear", "transposed"}
    assert table.kv_dtype == "fp32" and not table.kv_us  # fp32 stays exact: not timed
    attn = engine.chat.gpt.gpt.layers[0].self_attn
    assert hasattr(attn.rtts_qkv, "rtts_weights")  # the selected forward is installed
    assert hasattr(attn.o_proj, "rtts_weights")
    assert attn.rtts_qkv in kernels.linears(engine.chat.gpt.gpt)  # q/k/v fused: one matrix
    assert attn.q_proj not in kernels.linears(engine.chat.gpt.gpt)


async def test_numbers_reach_the_gpt_spoken_and_offsets_index_the_input(tiny_checkpoint: Path):
    """Issue 13 on the real path: what ChatTTS's GPT is given (after ChatTTS's own
    normalizer, which drops digits) spells the numbers out; the events' offsets still index
    the text as the client wrote it, even with a number split across text messages."""
    cfg = replace(base_config(), engine=EngineConfig(source="custom",
                                                     model_dir=tiny_checkpoint, threads=2))
    eng = ChatTTSEngine(cfg.engine)
    prompts: list[str] = []
    texts = eng._texts

    def spy(batch):
        out = texts(batch)
        prompts.extend(out)
        return out

    eng._texts = spy  # type: ignore[method-assign]
    written = "Call 911 now! It costs $12.50, about 20% off. 会议在下午3点30分。"
    async with server(cfg, eng) as (app, url), client(url) as c:
        await c.send(type="start", context_id="n", seed=3)
        for piece in ("Call 91", "1 now! It costs $12", ".50, about 2", "0% off. 会议在下午3",
                      "点30分。"):
            await c.send(type="text", context_id="n", text=piece)
        await c.send(type="end", context_id="n")
        await c.until("done", "n", timeout=60)
        started = c.got.of("segment_started", "n")
    said = " ".join(prompts)
    assert not any(ch.isdigit() for ch in said), said
    for words in ("nine one one", "twelve dollars", "fifty cents", "twenty percent", "三点"):
        assert words in said, (words, said)
    for e in started:
        assert written[e["text_start"]:e["text_end"]] == e["text"]
    assert "".join(e["text"] for e in started).replace(" ", "") == written.replace(" ", "")


@pytest.mark.long
def test_compiled_decode_step_matches_eager_and_never_recompiles_while_serving(
        tiny_checkpoint: Path) -> None:
    """--compile: the decode step's layer loop through torch.compile (gpt_loop.CompiledDecode)
    is compiled at warm-up for 1 and for 2+ rows of a serving batch; afterwards rows joining
    and leaving, any row count up to the slots and a growing buffer run on those two graphs
    (no further compile), and a row computes what the eager loop computes."""
    import torch
    from torch._dynamo.utils import counters

    eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     stream_tokens=8, dtype="fp32", batch_rows=4,
                                     compile=True))
    eng.load()
    eng.warmup()
    assert eng.compiled is not None and eng.compiled.ready and eng.compiled.compile_s > 0
    # compiled loops keep their thread count; the steps are still timed (capacity)
    assert eng.thread_tuner is not None and eng.thread_tuner.choices == [2]
    graphs = counters["stats"]["unique_graphs"]
    n = 16
    ref = _reference(eng, TEXTS[0], n).hiddens[0]
    gpt = eng.batch(4)
    assert gpt.decode is eng.compiled
    rows = _joined(eng, gpt, TEXTS[0], TEXTS[1:3], n, steps=3)
    cos = torch.nn.functional.cosine_similarity(ref[:n], rows[0].hiddens[:n], dim=-1)
    assert float(cos.min()) > 0.9999
    # a small buffer that compacts and grows, one row then three
    gpt = eng.batch(4)
    gpt._alloc(8)
    more = _joined(eng, gpt, TEXTS[2], TEXTS[0:2], n, steps=5)
    assert all(r.length == n for r in more)
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled again"
    # served through the engine, the steps are timed: the capacity is measured
    reqs = [SynthRequest("Hello there, how are you?", SynthParams(seed=1), max_new_token=24)]
    assert sum(len(c) for c in run(eng, reqs).values()) > 0
    assert eng.info.kernels is not None and "realtime_streams" in eng.info.kernels
    assert eng.info.kernels["threads"] == 2
    # a second compiled model in the same process compiles graphs of its own: sharing the
    # first one's (dynamo keeps graphs per code object, and module guards are skipped)
    # ran the first model's weights and kernels for the second
    # auto with oneDNN's bf16 linears (bf16p, as auto picks on a CPU with native bf16):
    # frozen bf16 weights through inductor's GEMM template or oneDNN, whichever it timed
    # faster (kernels.TEMPLATE_OPTIONS); its rows match the eager bf16p loop's
    template = kernels.bf16p_available()
    for dtype in ("auto", "int4"):  # (as `rtts bench realtime --dtypes auto+compile,int4+compile`)
        other = ChatTTSEngine(EngineConfig(
            source="custom", model_dir=tiny_checkpoint, threads=2, stream_tokens=8,
            dtype=dtype, batch_rows=4, compile=True,
            kernels="bf16p" if dtype == "auto" and template else "auto"))
        other.load()
        before = counters["stats"]["unique_graphs"]
        other.warmup()
        assert counters["stats"]["unique_graphs"] >= before + 2, dtype
        assert other.kernel_table is not None and other.compiled is not None
        if dtype == "auto" and template:
            assert other.kernel_table.template
            assert other.compiled.options == kernels.TEMPLATE_OPTIONS
            assert other.info.kernels is not None and other.info.kernels["template"]
            gpt, eager = other.batch(4), other.batch(4)
            eager.decode = None
            got = _joined(other, gpt, TEXTS[0], TEXTS[1:3], n, steps=3)
            ref_rows = _joined(other, eager, TEXTS[0], TEXTS[1:3], n, steps=3)
            for a, b in zip(got, ref_rows, strict=True):
                cos = torch.nn.functional.cosine_similarity(a.hiddens[:4], b.hiddens[:4],
                                                            dim=-1)
                assert float(cos.min()) > 0.999
    want = _reference(other, TEXTS[0], n).hiddens[0]
    gpt = other.batch(4)
    assert gpt.decode is other.compiled
    rows = _joined(other, gpt, TEXTS[0], [], n)
    cos = torch.nn.functional.cosine_similarity(want[:n], rows[0].hiddens[:n], dim=-1)
    assert float(cos.min()) > (0.9999 if gpt.kv_dtype != torch.int8 else 0.99)
    # int8 keys/values in a compiled step (kernels.decode_attention_int8): the same rows
    # as the eager loop over the same int8 buffers (dequantized for SDPA), joins included
    kv8 = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     stream_tokens=8, dtype="int4", batch_rows=4,
                                     compile=True, kv_dtype="int8"))
    kv8.load()
    kv8.warmup()
    assert kv8.kernel_table is not None and kv8.kernel_table.kv_dtype == "int8"
    gpt = kv8.batch(4)
    assert gpt.kv_int8 and gpt.decode is kv8.compiled
    eager = kv8.batch(4)
    eager.decode = None
    got = _joined(kv8, gpt, TEXTS[0], TEXTS[1:3], n, steps=3)
    ref_rows = _joined(kv8, eager, TEXTS[0], TEXTS[1:3], n, steps=3)
    for a, b in zip(got, ref_rows, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.hiddens[:4], b.hiddens[:4], dim=-1)
        assert float(cos.min()) > 0.999


def test_a_due_decode_takes_rows_with_half_a_window_ready():
    """Decoding has a fixed cost per call, so a decode that runs for one row also takes
    every row with at least half its window ready; those rows then stay in step."""
    from types import SimpleNamespace

    import torch

    from rtts.engines.chattts import _Live

    eng = ChatTTSEngine(EngineConfig(stream_tokens=8, decode_tokens=24, decode_lookahead=4))
    calls: list[int] = []

    def decode(windows, dtype=None):
        calls.append(len(windows))
        return np.zeros((len(windows), 512 * max(len(w) for w in windows)), np.float32)

    eng._decode = decode

    def live(length: int, emitted: int) -> _Live:
        row = SimpleNamespace(finished=False, evicted=False, length=length,
                              hiddens=torch.zeros(length, 4))
        return _Live(SynthRequest("x", SynthParams()), row, emitted=emitted)  # type: ignore[arg-type]

    # windows of 24 (emitted >= 24): 24 ready is due, 12 is half, 11 is not
    rows = [live(24 + 24 + 4, 24), live(24 + 12 + 4, 24), live(24 + 11 + 4, 24)]
    out = list(eng._decode_live(rows))
    assert calls == [2] and [x.emitted for x in rows] == [48, 36, 24]
    assert len(out) == 2
    # nothing due: no decode, even with half windows ready
    calls.clear()
    rows = [live(24 + 20 + 4, 24), live(24 + 12 + 4, 24)]
    assert list(eng._decode_live(rows)) == [] and calls == []


def test_benchmark_lengths_follow_the_text_with_tokens_per_char():
    """``fixed_tokens_per_char`` (rtts bench realtime --tokens-per-char): a segment's GPT
    steps in proportion to its characters, at least 8; ``fixed_tokens`` wins."""
    eng = ChatTTSEngine(EngineConfig(fixed_tokens_per_char=3.3))
    assert eng._max_tokens(SynthRequest("Good evening.", SynthParams())) == 43  # 13 x 3.3
    assert eng._max_tokens(SynthRequest("Hi.", SynthParams())) == 10  # ceil(9.9)
    assert eng._max_tokens(SynthRequest("Hi", SynthParams())) == 8  # not 7: at least 8
    assert eng._max_tokens(SynthRequest("Hi.", SynthParams(), max_new_token=5)) == 5
    both = ChatTTSEngine(EngineConfig(fixed_tokens=120, fixed_tokens_per_char=3.3))
    assert both._max_tokens(SynthRequest("Hi.", SynthParams())) == 120
