"""What the vendor-compatible front-ends (Cartesia, Deepgram) share, free of I/O.

* :func:`compat_voice`: a vendor's voice or model id -> the rtts ``voice``: every name
  :func:`rtts.core.voicenames.resolve_voice` takes (OpenAI's names, named voices, ``seed:N``,
  ``piper:NAME``) as there; any other id of a vendor's shape (a UUID, ``aura-2-thalia-en``)
  a fixed speaker drawn from a seed derived from the id, so existing client configs work
  and one id always sounds the same; anything else is unknown (None).
* :class:`RawEncoder`: float32 engine audio -> raw PCM16 / float32 / G.711 at a rate.
* :class:`FlushMarks`: which flushes are complete, from the segments done so far.
* :func:`word_times`: a segment's character timings -> its words with start/end times.
"""

from __future__ import annotations

import re
import zlib
from collections import deque
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from rtts.audio.codecs import Codec, Encoder, open_encoder
from rtts.audio.pcm import StreamingResampler
from rtts.core.voicenames import resolve_voice
from rtts.errors import ProtocolError
from rtts.text.timings import CharTimings

if TYPE_CHECKING:
    from rtts.core.service import Service

__all__ = ["FlushMarks", "RawEncoder", "compat_voice", "word_times"]

_VENDOR_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]{0,62}$")
_SEEDS: Final = 100_000


def compat_voice(voice_id: object, service: Service, owner: str | None = None) -> str | None:
    """The rtts ``voice`` for a vendor voice id, or None when it is not one. A voice the
    engine refuses (a malformed speaker string) raises :class:`ProtocolError`. Named
    voices are ``owner``'s (the key's owner id) and the shared ones."""
    if not isinstance(voice_id, str) or not voice_id or len(voice_id) > 4096:
        return None
    try:
        return resolve_voice(voice_id, service, owner)
    except ProtocolError:
        if len(voice_id) >= 64:
            raise
    if not _VENDOR_ID.match(voice_id):
        return None
    return f"seed:{zlib.crc32(voice_id.encode()) % _SEEDS}"


class RawEncoder:
    """Headerless audio at any rate: ``s16`` (PCM16 LE), ``f32`` (float32 LE), ``mulaw`` and
    ``alaw`` (G.711; 8 kHz only, the codec's rate)."""

    def __init__(self, kind: str, input_rate: int, rate: int) -> None:
        if kind not in ("s16", "f32", "mulaw", "alaw"):
            raise ValueError(f"unknown raw encoding {kind!r}")
        if kind in ("mulaw", "alaw") and rate != 8000:
            raise ValueError(f"{kind} is 8000 Hz only")
        self.kind = kind
        self.sample_rate = rate
        self._codec: Encoder | None = None
        self._resampler: StreamingResampler | None = None
        self._f32_samples = 0
        if kind == "f32":
            self._resampler = StreamingResampler(input_rate, rate)
            self.codec = Codec("pcm_f32le", "audio/pcm")
        else:
            self._codec = open_encoder("pcm16" if kind == "s16" else kind, input_rate, rate)
            self.codec = self._codec.codec

    @property
    def samples(self) -> int:
        return self._codec.samples if self._codec is not None else self._f32_samples

    @samples.setter
    def samples(self, value: int) -> None:
        if self._codec is not None:
            self._codec.samples = value
        else:
            self._f32_samples = value

    def encode(self, samples: npt.NDArray[np.float32]) -> bytes:
        if self._codec is not None:
            return self._codec.encode(samples)
        assert self._resampler is not None
        out = self._resampler.process(samples)
        self._f32_samples += len(out)
        return np.clip(out, -1.0, 1.0).astype("<f4").tobytes()

    def finish(self) -> bytes:
        if self._codec is not None:
            return self._codec.finish()
        assert self._resampler is not None
        out = self._resampler.flush()
        self._f32_samples += len(out)
        return np.clip(out, -1.0, 1.0).astype("<f4").tobytes()


class FlushMarks:
    """Flushes waiting for their audio. A flush covers the input fed before it; it is
    complete once the segments done reach the end of that input's last non-blank
    character (a flush with nothing new is complete at once)."""

    def __init__(self) -> None:
        self._length = 0  # characters fed
        self._last = 0  # offset just after the last non-blank character fed
        self._done = 0  # input covered by completed segments
        self._marks: deque[tuple[int, int]] = deque()  # (flush id, input offset)

    @property
    def pending(self) -> int:
        """Flushes waiting for their audio."""
        return len(self._marks)

    @property
    def unspoken(self) -> int:
        """Characters fed that no completed segment covers yet."""
        return self._length - min(self._done, self._length)

    def feed(self, text: str) -> None:
        stripped = text.rstrip()
        if stripped:
            self._last = self._length + len(stripped)
        self._length += len(text)

    def flush(self, flush_id: int) -> list[int]:
        """Record a flush; the flush ids complete now (this one, if nothing is pending)."""
        self._marks.append((flush_id, self._last))
        return self._complete()

    def segment_done(self, end: int) -> list[int]:
        """A segment covering the input up to ``end`` finished (or failed)."""
        self._done = max(self._done, end)
        return self._complete()

    def all(self) -> list[int]:
        """Every pending flush (the context ended: its audio is all out)."""
        ids = [fid for fid, _ in self._marks]
        self._marks.clear()
        return ids

    def _complete(self) -> list[int]:
        ids = []
        while self._marks and self._marks[0][1] <= self._done:
            ids.append(self._marks.popleft()[0])
        return ids


def word_times(text: str, timings: CharTimings, offset_ms: float = 0.0
               ) -> tuple[list[str], list[float], list[float]]:
    """Words of ``text`` (runs of non-blank characters) with their start and end times in
    seconds, ``offset_ms`` added; ``timings`` are the text's character timings in ms."""
    words: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    n = min(len(text), len(timings.start_ms))
    i = 0
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        j = i
        while j < n and not text[j].isspace():
            j += 1
        words.append(text[i:j])
        starts.append(round((offset_ms + timings.start_ms[i]) / 1000, 3))
        ends.append(round((offset_ms + timings.start_ms[j - 1] + timings.duration_ms[j - 1])
                          / 1000, 3))
        i = j
    return words, starts, ends
