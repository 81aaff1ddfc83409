import io

import numpy as np
import pytest
import soundfile as sf

from rtts.audio.pcm import (
    StreamingResampler,
    float_to_pcm16,
    pcm16_to_float,
    resampled_length,
    wav_bytes,
)


def tone(freq, rate, seconds=0.5):
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_pcm16_roundtrip_and_clipping():
    x = np.array([0.0, 0.5, -0.5, 1.5, -2.0], dtype=np.float32)
    data = float_to_pcm16(x)
    assert len(data) == 10
    y = pcm16_to_float(data)
    assert y[3] == pytest.approx(32767 / 32768) and y[4] == pytest.approx(-32767 / 32768)
    assert y[1] == pytest.approx(0.5, abs=1e-4)


RATES = [8000, 16000, 22050, 44100, 48000]


def resample(x, dst, seed=None, src=24000):
    """Through one StreamingResampler; whole (seed None) or in random chunks of 1-2000."""
    r = StreamingResampler(src, dst)
    if seed is None:
        return np.concatenate([r.process(x), r.flush()])
    rng = np.random.default_rng(seed)
    parts, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 2001))
        parts.append(r.process(x[i:i + n]))
        i += n
    parts.append(r.flush())
    return np.concatenate(parts)


def middle(y):
    k = len(y) // 10
    return y[k:len(y) - k]


@pytest.mark.parametrize("dst", RATES)
def test_resampler_chunked_equals_whole_with_exact_length(dst):
    x = tone(440, 24000, seconds=1.3) + tone(3100, 24000, seconds=1.3) * 0.3
    whole = resample(x, dst)
    assert len(whole) == resampled_length(len(x), 24000, dst) == round(len(x) * dst / 24000)
    for seed in range(4):
        np.testing.assert_array_equal(resample(x, dst, seed=seed), whole)
    # one sample at a time, and one big chunk plus an empty one
    r = StreamingResampler(24000, dst)
    ones = np.concatenate([r.process(x[i:i + 1]) for i in range(len(x))] + [r.flush()])
    np.testing.assert_array_equal(ones, whole)


@pytest.mark.parametrize("dst", RATES)
@pytest.mark.parametrize("n_in", [0, 1, 2, 3, 80, 240, 1001, 24001])
def test_resampler_length_rule_for_any_input_length(dst, n_in):
    # 80 and 240 samples give exact halves at 22.05 and 44.1 kHz (73.5, 147, 220.5, ...)
    x = np.random.default_rng(n_in).standard_normal(n_in).astype(np.float32) * 0.1
    for seed in (None, 1):
        assert len(resample(x, dst, seed=seed)) == resampled_length(n_in, 24000, dst)
    assert resampled_length(n_in, 24000, dst) == int(np.floor(n_in * dst / 24000 + 0.5))


@pytest.mark.parametrize("dst", [8000, 16000, 22050])
def test_resampler_stopband_past_the_new_nyquist(dst):
    # one kHz past the new Nyquist; for 22.05 kHz that is above the 24 kHz input's own
    # Nyquist (12 kHz), so the tone sits at 11.9 kHz, 0.875 kHz past 11.025 kHz
    freq = min(dst / 2 + 1000, 11900)
    x = tone(freq, 24000, seconds=2)
    y = resample(x, dst, seed=0).astype(np.float64)
    level = np.sqrt(np.mean(middle(y) ** 2)) / (0.5 / np.sqrt(2))
    assert 20 * np.log10(level) <= -90, 20 * np.log10(level)


@pytest.mark.parametrize("dst", [44100, 48000])
def test_resampler_upsampling_snr(dst):
    x = tone(1000, 24000, seconds=2)
    y = resample(x, dst, seed=0).astype(np.float64)
    ideal = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(len(y)) / dst)
    err = middle(y) - middle(ideal)
    snr = 10 * np.log10(np.sum(middle(ideal) ** 2) / np.sum(err ** 2))
    assert snr >= 100, snr


@pytest.mark.parametrize("dst", RATES)
def test_resampler_keeps_pitch_and_passband_level(dst):
    x = tone(440, 24000, seconds=1)
    y = resample(x, dst, seed=3)
    spectrum = np.abs(np.fft.rfft(middle(y)))
    peak_hz = np.argmax(spectrum) * dst / len(middle(y))
    assert abs(peak_hz - 440) < 3
    assert np.sqrt(np.mean(middle(y) ** 2)) == pytest.approx(0.5 / np.sqrt(2), rel=1e-3)


def test_resampler_other_source_rates():
    # the engine rate is not always 24 kHz (another engine, or a cached entry)
    x = tone(440, 22050, seconds=0.5)
    y = resample(x, 48000, src=22050, seed=2)
    assert len(y) == resampled_length(len(x), 22050, 48000)
    np.testing.assert_array_equal(y, resample(x, 48000, src=22050))


def test_passthrough_when_rates_match():
    x = tone(300, 24000)
    r = StreamingResampler(24000, 24000)
    assert np.array_equal(r.process(x), x) and r.flush().size == 0


def test_wav_bytes_is_readable():
    data = wav_bytes(tone(440, 16000), 16000)
    y, rate = sf.read(io.BytesIO(data))
    assert rate == 16000 and len(y) == 8000
