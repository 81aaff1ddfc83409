"""Speaker anchoring and voices from a sample, on the real ChatTTS code (tiny random
checkpoint): the anchored prompt at the token level, mixed batches, the DVAE encoder and the
registry round trip."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ChatTTS")

from rtts.config import EngineConfig  # noqa: E402
from rtts.core.params import NO_SPEAKER, SpeakerSample, SynthParams  # noqa: E402
from rtts.core.speaker import decode_codes  # noqa: E402
from rtts.core.voices import VoiceStore  # noqa: E402
from rtts.engines.base import SynthRequest  # noqa: E402
from rtts.engines.chattts import ChatTTSEngine  # noqa: E402

pytestmark = pytest.mark.chattts


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> ChatTTSEngine:
    eng = ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint, threads=2,
                                     stream_tokens=8, dtype="fp32", kernels="linear"))
    eng.load()
    return eng


def run(engine, requests):
    out: dict[int, list[np.ndarray]] = {i: [] for i in range(len(requests))}
    for row, chunk in engine.generate(requests):
        if chunk is not None:
            out[row].append(chunk)
    return {i: np.concatenate(c) if c else np.zeros(0, np.float32) for i, c in out.items()}


def first_segment(engine, text="Hello there, this is the first segment.", seed=3, n=40):
    req = SynthRequest(text, SynthParams(seed=seed), max_new_token=n)
    audio = run(engine, [req])[0]
    assert req.produced is not None and req.produced.frames > 0
    return req, audio


def test_engine_reports_the_codes_it_generated(engine):
    req, audio = first_segment(engine)
    produced = req.produced
    assert produced.num_vq == 4 and produced.frames <= 40
    # ChatTTS: T tokens -> (2T-1)*256 samples
    assert len(audio) == (2 * produced.frames - 1) * 256
    assert produced.text == engine.chat.normalizer(req.text, True, True, None)
    codes = np.frombuffer(produced.codes, "<u2")
    assert codes.max() < 625


def test_anchored_prompt_holds_the_first_segments_codes_and_text(engine):
    """Token level: ``[Stts][spk_emb]{first text}[speed_5]{text}[Ptts]`` then the codes."""
    first, _ = first_segment(engine)
    sample = first.produced
    second = SynthRequest("And this is the second one.", SynthParams(seed=4, sample=sample))
    plain = SynthRequest("And this is the second one.", SynthParams(seed=4))
    ids = engine.prompt_tokens(second)
    plain_ids = engine.prompt_tokens(plain)
    frames = sample.frames
    codes = np.frombuffer(sample.codes, "<u2").reshape(4, frames)
    # the last `frames` positions are the first segment's codes, one codebook per column
    assert np.array_equal(ids[-frames:].numpy(), codes.T)
    text_ids = ids[:-frames, 0].tolist()
    tok = engine.chat.tokenizer._tokenizer
    assert text_ids[:2] == tok.convert_tokens_to_ids(["[Stts]", "[spk_emb]"])
    assert text_ids[-1] == tok.convert_tokens_to_ids("[Ptts]")
    sample_ids = tok.encode(sample.text, add_special_tokens=False)
    speed = tok.convert_tokens_to_ids("[speed_5]")
    # the sample's text comes right after the speaker, before the speed prompt and the text
    assert text_ids[2:2 + len(sample_ids)] == sample_ids
    assert text_ids[2 + len(sample_ids)] == speed
    assert text_ids[2 + len(sample_ids):] == plain_ids[2:, 0].tolist()
    assert len(ids) == len(plain_ids) + len(sample_ids) + frames
    # a sample-only voice: [empty_spk] instead of the embedding
    only = engine.prompt_tokens(replace(second, params=replace(second.params,
                                                                voice=NO_SPEAKER)))
    assert only[1, 0] == tok.convert_tokens_to_ids("[empty_spk]")


def test_batch_mixing_anchored_and_plain_rows_matches_each_row_alone(engine):
    first, _ = first_segment(engine)
    sample = first.produced

    def requests():
        return [SynthRequest("Second, anchored.", SynthParams(seed=5, sample=sample),
                             max_new_token=24),
                SynthRequest("A plain row beside it.", SynthParams(seed=6), max_new_token=24),
                SynthRequest("另一个锚定的句子。", SynthParams(seed=7, sample=sample,
                                                      repetition_penalty=1.3),
                             max_new_token=24)]

    alone = []
    for req in requests():
        audio = run(engine, [req])[0]
        alone.append((audio, req.produced.codes))
    together = requests()
    mixed = run(engine, together)
    for k, req in enumerate(together):
        assert req.produced.codes == alone[k][1], f"row {k} drew other codes in the batch"
        assert len(mixed[k]) == len(alone[k][0])
        np.testing.assert_allclose(mixed[k], alone[k][0], atol=1e-4)
    # anchoring changes what is drawn (the prompt differs)
    plain = SynthRequest("Second, anchored.", SynthParams(seed=5), max_new_token=24)
    run(engine, [plain])
    assert plain.produced.codes != alone[0][1]


def test_sample_round_trips_through_the_dvae_encoder_and_the_registry(engine, tmp_path):
    from ChatTTS.model.speaker import Speaker

    _, audio = first_segment(engine, n=48)
    sample = engine.encode_sample(audio, "Hello there, this is the first segment.")
    # the same codes as ChatTTS's own sample_audio_speaker (its packed spk_smp string)
    ref = Speaker.decode_prompt(engine.chat.sample_audio_speaker(audio)).numpy()
    assert np.array_equal(np.frombuffer(sample.codes, "<u2").reshape(ref.shape), ref)
    assert abs(sample.frames - len(audio) / 512) <= 1

    # two servers sharing a voices directory: one stores, the other resolves
    a, b = VoiceStore(tmp_path), VoiceStore(tmp_path)
    a.create({"name": "clip", "sample": {"codes": _packed(sample), "text": sample.text}})
    pa = a.apply(SynthParams(voice="clip", seed=1))
    pb = b.apply(SynthParams(voice="clip", seed=1))
    assert pa == pb and pa.sample == sample and pa.voice == NO_SPEAKER
    ta = engine.prompt_tokens(SynthRequest("Speak in this voice.", pa))
    tb = engine.prompt_tokens(SynthRequest("Speak in this voice.", pb))
    assert np.array_equal(ta.numpy(), tb.numpy())
    assert np.array_equal(ta[-sample.frames:].numpy(),
                          np.frombuffer(sample.codes, "<u2").reshape(4, -1).T)
    # and it speaks
    req = SynthRequest("Speak in this voice.", pa, max_new_token=16)
    assert len(run(engine, [req])[0]) > 0


def test_refine_levels_reach_chattts_refine_prompt(engine):
    from rtts.engines.chattts import _refine_params

    params = SynthParams(oral=2, laugh=0, breaks=6)
    assert params.refines and params.refine_prompt == "[oral_2][laugh_0][break_6]"
    assert _refine_params(engine.chat, params).prompt == "[oral_2][laugh_0][break_6]"
    req = SynthRequest("Refine me, please.", params, max_new_token=16)
    assert len(run(engine, [req])[0]) > 0


def test_bad_samples_are_refused_by_the_engine(engine):
    bad = SpeakerSample(np.full((4, 3), 625, "<u2").tobytes(), "x")  # EOS is no code
    with pytest.raises(ValueError):
        engine.validate(SynthParams(sample=bad))
    with pytest.raises(ValueError):
        engine.validate(SynthParams(sample=SpeakerSample(b"\0" * 24, "x", num_vq=3)))
    with pytest.raises(ValueError):
        engine.validate(SynthParams(voice=NO_SPEAKER))


def _packed(sample: SpeakerSample) -> str:
    from rtts.core.speaker import encode_codes

    packed = encode_codes(sample.codes, sample.num_vq)
    assert decode_codes(packed, max_frames=1000) == (sample.codes, sample.num_vq)
    return packed


async def test_uploaded_clip_on_one_server_gives_identical_prompts_on_another(
        tiny_checkpoint: Path, tmp_path: Path):
    """A WAV through ``POST /v1/voices`` on server A (PyAV decode, ChatTTS's DVAE encoder);
    server B, sharing the voices directory, resolves it to the same sample and prompt."""
    import asyncio
    import base64
    import io
    import json
    import urllib.request

    import av

    from helpers import base_config, client, server
    from rtts.server import bound_port

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as c:
        stream = c.add_stream("pcm_s16le", rate=16000, layout="mono")
        t = np.arange(32000) / 16000
        pcm = (0.3 * np.sin(2 * np.pi * 200 * t) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm[None], format="s16", layout="mono")
        frame.sample_rate = 16000
        for p in [*stream.encode(frame), *stream.encode(None)]:
            c.mux(p)

    def engine() -> ChatTTSEngine:
        return ChatTTSEngine(EngineConfig(source="custom", model_dir=tiny_checkpoint,
                                          threads=2, kernels="linear"))

    cfg = base_config(voices_dir=tmp_path)
    async with server(cfg, engine()) as (a, _), server(cfg, engine()) as (b, url_b):
        body = json.dumps({"name": "clip", "transcript": "Hello there.",
                           "audio": base64.b64encode(buf.getvalue()).decode()}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{bound_port(a)}/v1/voices", body,
                                     {"Content-Type": "application/json"})
        with await asyncio.to_thread(urllib.request.urlopen, req, timeout=30) as r:
            assert r.status == 201
            described = json.loads(r.read())
        assert 1.9 < described["sample"]["seconds"] < 2.1
        pa = a.voices.apply(SynthParams(voice="clip", seed=3))
        pb = b.voices.apply(SynthParams(voice="clip", seed=3))
        assert pa == pb and pa.sample is not None and pa.voice == NO_SPEAKER
        req_a, req_b = (SynthRequest("Speak like this.", p) for p in (pa, pb))
        ta, tb = a.engine.prompt_tokens(req_a), b.engine.prompt_tokens(req_b)
        assert np.array_equal(ta.numpy(), tb.numpy())
        frames = pa.sample.frames
        assert np.array_equal(ta[-frames:].numpy(),
                              np.frombuffer(pa.sample.codes, "<u2").reshape(4, -1).T)
        async with client(url_b) as c:  # and B speaks with it
            await c.send(type="start", context_id="x", voice="clip", seed=3)
            await c.send(type="text", context_id="x", text="Speak like this.")
            await c.send(type="end", context_id="x")
            await c.until("done", "x", timeout=60)
            assert not c.got.of("error")
