"""Estimated character timings of a segment: where each written character falls in its audio.

ChatTTS has no aligner, but rtts knows each segment's text and the length of its audio.
:func:`estimate` spreads the audio over the written characters by how long each kind of
character takes to say, so clients that need timings (ElevenLabs ``alignment``, the
native ``segment_done`` option, the text heard before a barge-in) get them. They are
**estimates within a segment**: exact at segment boundaries, approximate inside.

Weights, in "CJK syllables" (one CJK character is one syllable, about 0.2-0.25 s of speech):

=====================================  ======  =========================================
character                              weight  why
=====================================  ======  =========================================
CJK ideograph, kana, hangul            1.0     one syllable each
Latin letter (any script's letter)     0.3     English runs about 3 letters a syllable
digit                                  0.6     spoken as a word ("seven", "七") or more
other symbol (``% $ & @ + =`` ...)     0.6     spoken as a word ("percent")
space                                  0.1     word boundary, nearly no time
clause mark (``, ; : ， 、 ；``)          1.0     a short pause
sentence end (``. ! ? 。 ！ ？ …``)        1.5     a longer pause
quotes, brackets, dashes               0.05    not spoken
=====================================  ======  =========================================

Times are integer milliseconds; the durations of one segment add up exactly to its
length, and starts increase (never decrease). Pure: no I/O.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

__all__ = ["CharTimings", "char_weight", "estimate"]

_CLAUSE = set(",;:，、；：")
_SENTENCE = set(".!?。！？…")
_SILENT_CATEGORIES = {"Ps", "Pe", "Pi", "Pf", "Pd"}  # brackets, quotes, dashes


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (0x3040 <= cp <= 0x30FF or 0x3400 <= cp <= 0x4DBF or 0x4E00 <= cp <= 0x9FFF
            or 0xAC00 <= cp <= 0xD7AF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F)


def char_weight(ch: str) -> float:
    """How long ``ch`` takes to say, relative to one CJK syllable (see the module table)."""
    if _is_cjk(ch):
        return 1.0
    if ch in _SENTENCE:
        return 1.5
    if ch in _CLAUSE:
        return 1.0
    if ch.isspace():
        return 0.1
    if ch.isdigit():
        return 0.6
    if ch.isalpha():
        return 0.3
    if unicodedata.category(ch) in _SILENT_CATEGORIES or ch in "'\"":
        return 0.05
    return 0.6


@dataclass(frozen=True, slots=True)
class CharTimings:
    """One entry per character of ``text``: its start and duration in ms (estimated)."""

    chars: tuple[str, ...]
    start_ms: tuple[int, ...]
    duration_ms: tuple[int, ...]

    @property
    def text(self) -> str:
        return "".join(self.chars)

    @property
    def end_ms(self) -> int:
        return self.start_ms[-1] + self.duration_ms[-1] if self.chars else 0

    def shifted(self, offset_ms: int) -> CharTimings:
        """The same timings ``offset_ms`` later (a segment placed in its context's audio)."""
        return CharTimings(self.chars, tuple(s + offset_ms for s in self.start_ms),
                           self.duration_ms)

    def heard(self, played_ms: float) -> int:
        """How many characters were heard by ``played_ms``: those whose middle has played."""
        n = 0
        for start, dur in zip(self.start_ms, self.duration_ms, strict=True):
            if start + dur / 2 > played_ms:
                break
            n += 1
        return n

    def as_dict(self) -> dict[str, list[str] | list[int]]:
        """ElevenLabs' ``alignment`` shape."""
        return {"chars": list(self.chars), "charStartTimesMs": list(self.start_ms),
                "charDurationsMs": list(self.duration_ms)}


def estimate(text: str, duration_ms: float) -> CharTimings:
    """Spread ``duration_ms`` of audio over the characters of ``text`` by :func:`char_weight`."""
    chars = tuple(text)
    if not chars:
        return CharTimings((), (), ())
    total_ms = max(0, round(duration_ms))
    weights = [char_weight(ch) for ch in chars]
    total_w = sum(weights)
    starts: list[int] = []
    durations: list[int] = []
    acc = 0.0
    prev = 0
    for w in weights:
        acc += w
        edge = round(total_ms * acc / total_w)  # cumulative rounding: durations sum exactly
        starts.append(prev)
        durations.append(edge - prev)
        prev = edge
    return CharTimings(chars, tuple(starts), tuple(durations))
