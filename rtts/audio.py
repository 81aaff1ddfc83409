"""Audio helpers: float32 -> PCM16, streaming rational resampling, WAV encoding. Pure numpy."""

from __future__ import annotations

import functools
import io
from math import gcd

import numpy as np
import numpy.typing as npt

__all__ = ["StreamingResampler", "float_to_pcm16", "pcm16_to_float", "wav_bytes"]

FloatArray = npt.NDArray[np.float32]


def float_to_pcm16(samples: npt.NDArray[np.floating]) -> bytes:
    """Clip to [-1, 1] and convert to little-endian 16-bit PCM bytes."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def pcm16_to_float(data: bytes) -> FloatArray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def wav_bytes(samples: npt.NDArray[np.floating], sample_rate: int) -> bytes:
    """A complete 16-bit mono WAV file (for the REST download endpoint)."""
    import soundfile as sf  # bundled libsndfile; imported lazily to keep import light

    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, dtype=np.float32), sample_rate, format="WAV",
             subtype="PCM_16")
    return buf.getvalue()


_PASSTHROUGH = np.zeros((1, 1), dtype=np.float32)


@functools.lru_cache(maxsize=64)
def _filter_bank(up: int, down: int, half: int) -> FloatArray:
    """Polyphase windowed-sinc bank: for output phase p, tap k applies to input
    x[base + k - half + 1]. Read-only; shared by every resampler of this rate pair."""
    cutoff = min(1.0, up / down)  # relative to the input Nyquist
    phases = np.arange(up, dtype=np.float64) / up
    k = np.arange(-half + 1, half + 1, dtype=np.float64)
    t = k[None, :] - phases[:, None]  # distance from the ideal position, in input samples
    window = np.kaiser(2 * half + 1, 8.0)
    w = np.interp(t, np.arange(-half, half + 1), window)
    bank: FloatArray = (cutoff * np.sinc(cutoff * t) * w).astype(np.float32)
    bank.flags.writeable = False
    return bank


class StreamingResampler:
    """Rational polyphase resampler (windowed sinc) that keeps state across chunks.

    Feeding a signal in pieces gives the same output as feeding it whole; the filter's
    group delay is compensated so output sample ``n`` lines up with input time
    ``n * src / dst``. Call :meth:`flush` once at the end to get the tail.
    """

    def __init__(self, src_rate: int, dst_rate: int, half_taps: int = 16) -> None:
        g = gcd(src_rate, dst_rate)
        self.up = dst_rate // g
        self.down = src_rate // g
        self.passthrough = self.up == self.down
        self.half = half_taps
        # One resampler per segment: the bank is built once per rate pair, not each time.
        self._bank = _PASSTHROUGH if self.passthrough else _filter_bank(self.up, self.down,
                                                                        half_taps)
        self._hist = np.zeros(self.half, dtype=np.float32)  # look-back context
        self._hist_len = 0  # how many real samples precede the buffer's start
        self._buf = np.zeros(0, dtype=np.float32)
        self._consumed = 0  # input samples before _buf[0]
        self._n_out = 0

    def process(self, chunk: npt.NDArray[np.floating]) -> FloatArray:
        x = np.asarray(chunk, dtype=np.float32).ravel()
        if self.passthrough:
            return x
        self._buf = np.concatenate([self._buf, x])
        return self._emit(final=False)

    def flush(self) -> FloatArray:
        if self.passthrough:
            return np.zeros(0, dtype=np.float32)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> FloatArray:
        total_in = self._consumed + len(self._buf)
        # Output n needs input up to floor(n*down/up) + half; at the end pad with zeros.
        if final:
            n_end = -(-total_in * self.up // self.down)
        else:
            n_end = max(0, ((total_in - self.half) * self.up) // self.down)
        if n_end <= self._n_out:
            return np.zeros(0, dtype=np.float32)
        n = np.arange(self._n_out, n_end, dtype=np.int64)
        base = (n * self.down) // self.up
        phase = (n * self.down) % self.up
        ext = np.concatenate([self._hist, self._buf, np.zeros(2 * self.half, np.float32)])
        offset = self._consumed - len(self._hist)  # input index of ext[0]
        idx = (base - offset)[:, None] + np.arange(-self.half + 1, self.half + 1)[None, :]
        out = np.einsum("ij,ij->i", ext[idx], self._bank[phase])
        self._n_out = n_end
        # Drop input no longer needed, keeping `half` samples of history.
        keep_from = int((n_end * self.down) // self.up) - self.half
        drop = max(0, keep_from - self._consumed)
        drop = min(drop, len(self._buf))
        if drop:
            merged = np.concatenate([self._hist, self._buf[:drop]])
            self._hist = merged[-self.half:]
            self._buf = self._buf[drop:]
            self._consumed += drop
        result: FloatArray = out.astype(np.float32)
        return result
