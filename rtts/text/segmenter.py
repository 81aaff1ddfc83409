"""Incremental text segmenter: streamed text in, speakable chunks out. Pure, no I/O.

Rules, in order of preference, once the buffer holds at least the current *minimum*
(``schedule[i]`` characters for the i-th chunk, the last entry repeating):

1. cut after the first sentence end past the minimum (``。！？!?；;…`` and newlines,
   or ``.`` followed by whitespace, or a ``.`` that joins two sentences with no space:
   ``dog.Please``, a lowercase word then a capital), keeping closing quotes/brackets
   with the sentence;
2. else cut after the first clause mark past the minimum (``，、：,:`` and dashes);
   for the first chunk of a context, whichever of 1 and 2 comes first;
3. if the buffer exceeds ``max_chars`` with neither, cut at its last whitespace, or
   hard-cut at ``max_chars`` (CJK text without punctuation).

A small first minimum gives fast first audio; larger later minimums give longer, more
natural chunks (the idea of ElevenLabs' ``chunk_length_schedule``). An English ``.``
at the very end of the buffer is not a boundary yet (``3.`` may become ``3.14``); it is
at :meth:`Segmenter.flush`. Numbers are never cut while they may still grow: ``1,000``,
``10:30``, ``5, 2026`` (also when the buffer ends after the comma), and forced cuts move
back to before a number ("12" + ".5%" arriving later) and never fall between a number and
its unit. A ChatTTS control tag (``[uv_break]``, ``[laugh]``, ``[break_3]``) is never cut:
a forced cut that would fall inside one (also one still arriving: ``…[la``) moves to before
it, or past it if it starts the buffer. A ``.`` after an abbreviation (``Dr.``, ``ext.``,
``Jan.``) or a list item's number (``1. 首先``, ``2、其次``) is not a boundary.
Together this lets :mod:`rtts.text` normalize each chunk exactly as the whole text.
Chunks with nothing to say (punctuation, spaces) are dropped; their characters still
count in the offsets of later chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DEFAULT_SCHEDULE", "Chunk", "Segmenter", "is_speakable"]

DEFAULT_SCHEDULE: tuple[int, ...] = (8, 40, 80, 120)
DEFAULT_MAX_CHARS = 200

_SENTENCE_END = frozenset("。！？!?；;…\n")
_CLAUSE = frozenset("，、：,:—－")
_CLOSERS = frozenset("\"'”’」』）)]】》")
_IN_NUMBER = frozenset(".,:%/")  # inside or right after a number: 3.14 1,000 10:30 20% 1/2
# characters that join a word to what precedes it: domains, paths, addresses, identifiers
_IN_WORD = frozenset("./\\@:_-#~+=&?")
# a ChatTTS control tag, as the normalizer keeps it: "[" + name + "]" (names are short)
_TAG_NAME_MAX = 32
_TAG = re.compile(rf"\[[A-Za-z_]\w{{0,{_TAG_NAME_MAX - 1}}}\]", re.ASCII)
_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
# the only characters :meth:`Segmenter._boundary_after` may cut after: the scans jump from
# one to the next (in C) instead of testing every character in Python (a 20,000-character
# text without any took ~10 ms of the event loop to segment)
_CANDIDATE = re.compile("[" + re.escape("".join(sorted(_SENTENCE_END | _CLAUSE | {"."}))) + "]")
_ABBREVIATION = re.compile(
    r"(?<![A-Za-z.])(?:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|No|Nos|ext|Ext|vs|etc|approx|Fig|Inc|"
    r"e\.g|i\.e|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)$")


def is_speakable(text: str) -> bool:
    """True when ``text`` has at least one letter, digit or CJK character."""
    return any(ch.isalnum() for ch in text)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk of text and its ``[start, end)`` character offsets in the context's input."""

    text: str
    start: int
    end: int


class Segmenter:
    """Stateful chunker for one context. ``push`` text pieces, ``flush`` at the end."""

    def __init__(
        self, schedule: tuple[int, ...] = DEFAULT_SCHEDULE, max_chars: int = DEFAULT_MAX_CHARS
    ) -> None:
        if not schedule or any(n < 1 for n in schedule):
            raise ValueError("schedule must be non-empty positive lengths")
        if max_chars < 8:
            raise ValueError("max_chars must be at least 8")
        self.schedule = tuple(min(n, max_chars) for n in schedule)
        self.max_chars = max_chars
        self._buf = ""
        self._buf_start = 0  # offset of _buf[0] in the whole input
        self._emitted = 0

    @property
    def buffered(self) -> str:
        return self._buf

    @property
    def total_chars(self) -> int:
        return self._buf_start + len(self._buf)

    def _minimum(self) -> int:
        return self.schedule[min(self._emitted, len(self.schedule) - 1)]

    def push(self, text: str) -> list[Chunk]:
        """Add text; return the chunks that are ready."""
        self._buf += text
        out: list[Chunk] = []
        while True:
            cut = self._find_cut(final=False)
            if cut is None:
                return out
            chunk = self._take(cut)
            if chunk is not None:
                out.append(chunk)

    def flush(self) -> list[Chunk]:
        """Emit everything buffered (on ``flush``/``end`` or an idle timeout)."""
        out: list[Chunk] = []
        while self._buf:
            cut = self._find_cut(final=True)
            if cut is None:
                cut = len(self._buf)
            chunk = self._take(cut)
            if chunk is not None:
                out.append(chunk)
        return out

    def _take(self, cut: int) -> Chunk | None:
        raw = self._buf[:cut]
        start = self._buf_start
        self._buf = self._buf[cut:]
        self._buf_start += cut
        stripped = raw.strip()
        if not is_speakable(stripped):
            return None  # punctuation or spaces only: no sound, offsets still counted
        lead = len(raw) - len(raw.lstrip())
        self._emitted += 1
        return Chunk(stripped, start + lead, start + lead + len(stripped))

    def _find_cut(self, *, final: bool) -> int | None:
        buf = self._buf
        n = len(buf)
        if n == 0:
            return None
        minimum = self._minimum()
        if n < minimum and not final:
            return None
        limit = min(n, self.max_chars)
        # 1. first sentence end (else clause end) at or past the minimum, within max_chars;
        #    for the very first chunk any of the two, whichever comes first (first audio fast)
        candidates = [m.start() for m in _CANDIDATE.finditer(buf, 0, limit)]
        first = min(minimum, limit) - 1
        for sentence in ((False,) if self._emitted == 0 else (True, False)):
            for i in candidates:
                if i < first:
                    continue
                end = self._boundary_after(buf, i, final=final, sentence=sentence)
                if end is not None and end <= self.max_chars:
                    return end
        if n <= self.max_chars:
            return n if final else None
        # 2. too long: any clause mark (even before the minimum), then the last whitespace
        for i in reversed(candidates):  # (limit == max_chars here)
            end = self._boundary_after(buf, i, final=final, sentence=False)
            if end is not None and end <= self.max_chars:
                return end
        for pos in range(self.max_chars, max(self.max_chars // 2, 1), -1):
            if buf[pos - 1].isspace():
                j = pos - 2
                while j >= 0 and buf[j].isspace():
                    j -= 1
                if j < 0 or not buf[j].isdigit():
                    return pos  # (not between "5" and "km": they are read together)
        # 3. hard cut, but not inside a number ("…123|45" would read as two numbers) nor
        #    inside a control tag ("…[la|ugh]" would be read out as letters)
        return self._outside_tag(buf, self._outside_number(buf, self.max_chars), final=final)

    @staticmethod
    def _outside_tag(buf: str, cut: int, *, final: bool) -> int | None:
        """``cut``, moved to before the control tag it would split (a complete one, or one
        that may still be arriving at the buffer's end); past the tag if the tag starts the
        buffer; None (wait for more) if that tag is not complete yet."""
        start = buf.rfind("[", max(0, cut - _TAG_NAME_MAX - 1), cut)
        if start < 0 or not all(ch in _TAG_CHARS for ch in buf[start + 1:cut]):
            return cut  # not inside "[name" (tag names are ASCII word characters)
        if start + 1 < cut and buf[start + 1].isdigit():
            return cut
        match = _TAG.match(buf, start)
        if match is None:
            # "[name" not closed: a tag still arriving if the buffer ends inside its name
            rest = buf[cut:]
            j = 0
            while j < len(rest) and rest[j] in _TAG_CHARS:
                j += 1
            if final or j < len(rest) or cut - start + j > _TAG_NAME_MAX:
                return cut  # not a tag: "[abc def", "[1", or too long to be one
            return start if start > 0 else None
        if match.end() <= cut:
            return cut  # the tag ends before the cut
        return start if start > 0 else match.end()

    @staticmethod
    def _outside_number(buf: str, cut: int) -> int:
        """``cut``, moved back to the start of the number it would split (if not to 0)."""
        if not (buf[cut - 1].isdigit() and (buf[cut].isdigit() or buf[cut] in _IN_NUMBER)):
            return cut
        start = cut
        while start > 0 and (buf[start - 1].isdigit() or (
                buf[start - 1] in _IN_NUMBER and start > 1 and buf[start - 2].isdigit())):
            start -= 1
        return start if start > 0 else cut

    @staticmethod
    def _list_number_before(buf: str, i: int) -> bool:
        """True if ``buf[i]`` follows a 1-3 digit number that starts a line, clause or buffer."""
        j = i
        while j > 0 and buf[j - 1].isdigit():
            j -= 1
        if not 1 <= i - j <= 3:
            return False
        before = buf[:j].rstrip(" \t")
        return not before or before[-1] in _SENTENCE_END or before[-1] in _CLAUSE

    @staticmethod
    def _joined_sentences(buf: str, i: int) -> bool:
        """True if the ``.`` at ``buf[i]`` ends a sentence that the next one follows with no
        space (``dog.Please``: pipecat sends each sentence of an LLM reply without its
        trailing space): a lowercase word of two or more letters before it, standing on its
        own (not part of a domain, path, address or ``U.S.``), and an uppercase letter
        after it. ``3.5``, ``example.com``, ``node.js``, ``ASP.NET`` and ``U.S.Army`` are
        not; abbreviations (``Mr.Smith``) are ruled out by the caller."""
        if i + 1 >= len(buf) or not buf[i + 1].isupper() or not buf[i - 1].islower():
            return False
        j = i
        while j > 0 and buf[j - 1].isalpha():
            j -= 1
        if i - j < 2:
            return False
        return j == 0 or not (buf[j - 1].isalnum() or buf[j - 1] in _IN_WORD)

    @staticmethod
    def _boundary_after(buf: str, i: int, *, final: bool, sentence: bool) -> int | None:
        """If ``buf[i]`` ends a sentence (or clause), return the cut index after it."""
        ch = buf[i]
        n = len(buf)
        marks = _SENTENCE_END if sentence else (_SENTENCE_END | _CLAUSE)
        if ch in ".、" and Segmenter._list_number_before(buf, i):
            return None  # "1. 首先" / "2、其次": the item's number goes with its text
        if ch in marks:
            if ch in ",:" and i > 0 and buf[i - 1].isdigit():
                j = i + 1
                while ch == "," and j < n and buf[j] in " \t":
                    j += 1  # "May 5, 2026" and "1, 2, 3" are read as one expression
                if (j < n and buf[j].isdigit()) or (j >= n and not final):
                    return None  # 1,000 or 10:30 or 5, 2026, perhaps still arriving
        elif ch == ".":
            if i + 1 >= n:
                if not final:
                    return None  # may be a decimal point or an abbreviation still arriving
            elif not (buf[i + 1].isspace() or buf[i + 1] in _CLOSERS
                      or Segmenter._joined_sentences(buf, i)):
                return None
            if _ABBREVIATION.search(buf, 0, i):
                return None  # "Dr. Smith", "ext. 204", "Jan. 5": not a sentence end
        else:
            return None
        j = i + 1
        while j < n and (buf[j] in _CLOSERS or (buf[j] in marks and buf[j] != "\n")):
            j += 1
        return j
