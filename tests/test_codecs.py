"""Streaming encoders (rtts.audio.codecs): every format decodes back (PyAV) with the right codec,
rate and length, and bytes come out while audio is still going in (no whole-clip buffer)."""

import io

import av
import numpy as np
import pytest

from rtts.audio.codecs import CODECS, codec_for, open_encoder, streaming_wav_header

RATE = 24000
TONE = (0.3 * np.sin(2 * np.pi * 440 * np.arange(2 * RATE) / RATE)).astype(np.float32)

DECODED = {  # format -> (decoder name, decoded rate)
    "wav": ("pcm_s16le", 24000), "mp3": ("mp3float", 24000), "opus": ("opus", 48000),
    "webm": ("opus", 48000), "aac": ("aac", 24000), "flac": ("flac", 24000),
}


def encode(name, input_rate=RATE, sample_rate=RATE, piece=2400):
    enc = open_encoder(name, input_rate, sample_rate)
    parts = [enc.encode(TONE[i:i + piece]) for i in range(0, len(TONE), piece)]
    parts.append(enc.finish())
    return enc, parts


@pytest.mark.parametrize("name", sorted(DECODED))
def test_container_formats_decode_and_stream(name):
    enc, parts = encode(name)
    data = b"".join(parts)
    container = av.open(io.BytesIO(data))
    stream = container.streams.audio[0]
    codec, rate = DECODED[name]
    assert stream.codec_context.name == codec and stream.rate == rate
    samples = sum(f.samples for f in container.decode(audio=0))
    seconds = samples / rate
    assert 1.95 <= seconds <= 2.15, seconds  # encoder priming adds a little at most
    # incremental: most pieces of input already produced output before the end
    assert sum(1 for p in parts[:-1] if p) >= len(parts) // 2
    assert CODECS[name].media_type.startswith("audio/")


def test_raw_formats_lengths_and_rates():
    enc, parts = encode("pcm16")
    assert len(b"".join(parts)) == 2 * len(TONE) and enc.sample_rate == RATE
    for name in ("mulaw", "alaw"):
        enc, parts = encode(name)
        assert enc.sample_rate == 8000
        assert abs(len(b"".join(parts)) - 16000) <= 16  # 2 s at 8 kHz, one byte a sample
    enc, parts = encode("pcm16", sample_rate=16000)
    assert abs(len(b"".join(parts)) - 2 * 32000) <= 64


def test_g711_known_codes():
    pcm = np.array([0, 1000, -1000, 32767, -32768], dtype=np.int16)
    f = pcm.astype(np.float32) / 32767
    mu = open_encoder("mulaw", 8000, 8000)
    a = open_encoder("alaw", 8000, 8000)
    # reference values of the ITU-T G.711 tables
    assert (mu.encode(f) + mu.finish()) == bytes([0xFF, 0xCE, 0x4E, 0x80, 0x00])
    assert (a.encode(f) + a.finish()) == bytes([0xD5, 0xFA, 0x7A, 0xAA, 0x2A])


def test_streaming_wav_header_and_aliases():
    head = streaming_wav_header(24000)
    assert head[:4] == b"RIFF" and head[8:16] == b"WAVEfmt " and len(head) == 44
    assert codec_for("pcm").name == "pcm16" and codec_for("ogg").name == "opus"
    assert codec_for("nope") is None
    with pytest.raises(ValueError):
        open_encoder("nope", RATE)
