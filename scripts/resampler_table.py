"""The resampler table in README.md (issue 19): quality and speed of rtts.audio.pcm.StreamingResampler.

    .venv/bin/python scripts/resampler_table.py

A 2 s sine at 24 kHz is fed in random chunks of 1-2000 samples (seeded). Downsampling
rows put the tone above the new Nyquist, so everything in the output is alias: the level
is the output RMS over the middle 80% relative to the input tone's RMS. Upsampling rows
compare the output with the ideal sine at the output rate: SNR over the middle 80%.
The time is the best of 20 runs over the whole clip (construction, chunks, flush).
"""

from __future__ import annotations

import time

import numpy as np

from rtts.audio.pcm import StreamingResampler

SRC = 24000
AMP = 0.5
# (output rate, tone Hz, kind): "alias" rows measure a tone above the new Nyquist.
ROWS = [(8000, 5000, "alias"), (16000, 9000, "alias"), (22050, 11900, "alias"),
        (44100, 1000, "snr"), (48000, 1000, "snr")]


def chunked(x: np.ndarray, dst: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = StreamingResampler(SRC, dst)
    parts, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 2001))
        parts.append(r.process(x[i:i + n]))
        i += n
    parts.append(r.flush())
    return np.concatenate(parts)


def middle(y: np.ndarray) -> np.ndarray:
    k = len(y) // 10
    return y[k:len(y) - k]


def measure(dst: int, freq: float, kind: str) -> tuple[float, float]:
    """(dB figure, best time in ms)."""
    t = np.arange(2 * SRC) / SRC
    x = (AMP * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    y = chunked(x, dst).astype(np.float64)
    if kind == "alias":
        db = 20 * np.log10(max(np.sqrt(np.mean(middle(y) ** 2)), 1e-30) / (AMP / np.sqrt(2)))
    else:
        ideal = AMP * np.sin(2 * np.pi * freq * np.arange(len(y)) / dst)
        err = middle(y) - middle(ideal)
        db = 10 * np.log10(np.sum(middle(ideal) ** 2) / max(np.sum(err ** 2), 1e-300))
    best = min(_timed(x, dst) for _ in range(20))
    return float(db), best * 1000


def _timed(x: np.ndarray, dst: int) -> float:
    t0 = time.perf_counter()
    chunked(x, dst)
    return time.perf_counter() - t0


def main() -> None:
    print("| conversion | tone | measure | result | time for the 2 s clip |")
    print("|---|---|---|---|---|")
    for dst, freq, kind in ROWS:
        db, ms = measure(dst, freq, kind)
        what = "alias level" if kind == "alias" else "SNR"
        print(f"| 24 → {dst / 1000:g} kHz | {freq / 1000:g} kHz | {what} | {db:.1f} dB "
              f"| {ms:.2f} ms |")


if __name__ == "__main__":
    main()
