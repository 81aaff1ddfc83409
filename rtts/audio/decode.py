"""Uploaded audio clips decoded with PyAV (any container and codec FFmpeg reads), mixed to
mono and resampled, with every size bounded before and while it is expanded.

:func:`decode_clip` refuses a blob over ``max_bytes`` before opening it, a container whose
declared duration is over ``max_seconds``, and stops decoding (refusing) as soon as the
decoded audio passes ``max_seconds``, so a small file that inflates (a long silent Opus
stream) never costs more than the bound. Blocking (FFmpeg): run it off the event loop.
"""

from __future__ import annotations

import io
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["ClipError", "decode_clip"]

MAX_STREAM_SECONDS: Final = 3600.0  # a declared duration past this is not trusted at all


class ClipError(ValueError):
    """Not a usable clip (the message says why, for a 400)."""


def decode_clip(data: bytes, *, rate: int = 24000, max_seconds: float,
                max_bytes: int) -> npt.NDArray[np.float32]:
    """Mono float32 samples at ``rate`` of the first audio stream of ``data``."""
    import av

    if not data:
        raise ClipError("the audio is empty")
    if len(data) > max_bytes:
        raise ClipError(f"the audio is larger than {max_bytes} bytes")
    limit = int(max_seconds * rate)
    parts: list[npt.NDArray[np.float32]] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            streams = container.streams.audio
            if not streams:
                raise ClipError("the file has no audio stream")
            stream = streams[0]
            declared = _seconds(stream.duration, stream.time_base) or (
                container.duration / 1e6 if container.duration else None)
            if declared is not None and max_seconds < declared < MAX_STREAM_SECONDS:
                raise ClipError(f"the clip is {declared:.1f} s long; at most "
                                f"{max_seconds:g} s")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    total += _take(parts, out)
                if total > limit:
                    raise ClipError(f"the clip is longer than {max_seconds:g} s")
            for out in resampler.resample(None):
                total += _take(parts, out)
    except ClipError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, IndexError) as exc:
        raise ClipError(f"the audio could not be decoded: {type(exc).__name__}") from None
    if total > limit:
        raise ClipError(f"the clip is longer than {max_seconds:g} s")
    if total == 0:
        raise ClipError("the audio decoded to no samples")
    audio = np.concatenate(parts)
    if not np.isfinite(audio).all():
        raise ClipError("the audio has non-finite samples")
    return audio


def _take(parts: list[npt.NDArray[np.float32]], frame: object) -> int:
    arr = np.asarray(frame.to_ndarray(), dtype=np.float32).reshape(-1)  # type: ignore[attr-defined]
    parts.append(arr)
    return int(arr.size)


def _seconds(duration: int | None, time_base: object) -> float | None:
    if duration is None or time_base is None:
        return None
    return float(duration * time_base)  # type: ignore[operator]
