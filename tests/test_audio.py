import io

import numpy as np
import pytest
import soundfile as sf

from rtts.audio import StreamingResampler, float_to_pcm16, pcm16_to_float, wav_bytes


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


@pytest.mark.parametrize("dst", [16000, 8000, 22050, 44100, 48000])
def test_resampler_chunked_equals_whole_and_keeps_pitch(dst):
    x = tone(440, 24000)
    whole = StreamingResampler(24000, dst)
    a = np.concatenate([whole.process(x), whole.flush()])
    chunked = StreamingResampler(24000, dst)
    rng = np.random.default_rng(0)
    parts, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 3000))
        parts.append(chunked.process(x[i:i + n]))
        i += n
    parts.append(chunked.flush())
    b = np.concatenate(parts)
    assert len(a) == len(b) == int(np.ceil(len(x) * dst / 24000))
    np.testing.assert_allclose(a, b, atol=1e-5)
    spectrum = np.abs(np.fft.rfft(b[len(b) // 10: -len(b) // 10]))
    peak_hz = np.argmax(spectrum) * dst / (len(b) - 2 * (len(b) // 10))
    assert abs(peak_hz - 440) < 10


def test_resampler_removes_content_above_new_nyquist():
    x = tone(7000, 24000)  # above 8 kHz / 2 = 4 kHz
    r = StreamingResampler(24000, 8000)
    y = np.concatenate([r.process(x), r.flush()])
    assert np.sqrt(np.mean(y[100:-100] ** 2)) < 0.02


def test_passthrough_when_rates_match():
    x = tone(300, 24000)
    r = StreamingResampler(24000, 24000)
    assert np.array_equal(r.process(x), x) and r.flush().size == 0


def test_wav_bytes_is_readable():
    data = wav_bytes(tone(440, 16000), 16000)
    y, rate = sf.read(io.BytesIO(data))
    assert rate == 16000 and len(y) == 8000
