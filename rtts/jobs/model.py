"""The pure part of long-text jobs: configuration, splitting, states, progress. No I/O.

A job's text is cut into segments by the live path's :class:`~rtts.text.segmenter.Segmenter`
(sentence ends first, at most ``segment_chars`` characters), fed piece by piece as the
upload arrives, so nothing holds the whole text. Chapter marks are character offsets into
the text: a segment never spans one (the segmenter is flushed at each mark), so every
chapter is a contiguous run of segments and can be downloaded on its own.
"""

from __future__ import annotations

import codecs
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Final

from rtts.text.segmenter import Chunk, Segmenter

__all__ = ["JOB_FORMATS", "Chapter", "JobState", "JobSplitter", "JobsConfig", "default_jobs_dir",
           "eta_seconds", "parse_chapters", "wav_header"]

# Formats whose per-segment files concatenate into one valid stream: raw PCM and G.711,
# WAV (segments stored as PCM16, one header in front), MP3 frames and AAC ADTS frames.
# Ogg/WebM/FLAC have one header per stream and are refused for jobs.
JOB_FORMATS: Final = ("wav", "pcm16", "mp3", "aac", "mulaw", "alaw")


def default_jobs_dir() -> Path:
    base = os.environ.get("RTTS_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rtts")
    return Path(os.environ.get("RTTS_JOBS_DIR") or Path(base) / "jobs")


@dataclass(frozen=True)
class JobsConfig:
    """Jobs are on when ``redis_url`` is set (the API); ``worker`` also runs a worker."""

    redis_url: str | None = None
    dir: Path = field(default_factory=default_jobs_dir)  # segment audio; shared by instances
    worker: bool = False
    concurrency: int | None = None  # segments a worker runs at once; None = batch slots
    claim_idle_s: float = 30.0  # a segment unacknowledged this long is taken over
    max_upload_bytes: int = 16 * 2**20  # UTF-8 text of one job
    segment_chars: int = 200  # longest segment (the live path's default chunk)
    min_segment_chars: int = 120  # cut at the first sentence end past this
    max_attempts: int = 3  # engine failures of one segment before the job fails
    prefix: str = "rtts:jobs"  # Redis key prefix (stream, group, records)
    ttl_s: int = 7 * 86400  # job records expire this long after their last change
    max_chapters: int = 1000  # chapter marks of one job (counted before they are parsed)
    # per key (job owner; without keys, everyone is one): unfinished jobs, the characters
    # of their text, and bytes of stored audio (of every job the key still holds)
    max_jobs_per_key: int = 4
    # without API keys every client is the one owner "anonymous": its cap on unfinished
    # jobs is this, server-wide (the character and audio caps apply server-wide too)
    max_jobs_without_keys: int = 64
    max_queued_chars_per_key: int = 20_000_000
    max_audio_bytes_per_key: int = 4 * 2**30


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True, slots=True)
class Chapter:
    """Chapter ``index`` starts at character ``start`` (and at segment ``first_segment``)."""

    index: int
    start: int
    title: str = ""
    first_segment: int = 0


MAX_TITLE_CHARS: Final = 200


def parse_chapters(raw: Iterable[object], limit: int | None = None) -> list[Chapter]:
    """Chapter marks from a request: offsets (ints) or ``{"start": int, "title": str}``
    (titles of at most :data:`MAX_TITLE_CHARS`). Raises ValueError for anything else, or
    for more than ``limit`` marks; sorted, duplicates and offset 0 merged."""
    marks: dict[int, str] = {}
    for n, item in enumerate(raw):
        if limit is not None and n >= limit:
            raise ValueError(f"at most {limit} chapter marks")
        if isinstance(item, bool):
            raise ValueError("chapter marks are character offsets")
        if isinstance(item, int):
            start, title = item, ""
        elif isinstance(item, dict) and isinstance(item.get("start"), int) \
                and not isinstance(item.get("start"), bool):
            start, title = item["start"], str(item.get("title") or "")
        else:
            raise ValueError("chapter marks are offsets or {\"start\": offset, \"title\": ...}")
        if start < 0:
            raise ValueError("chapter offsets must be >= 0")
        if len(title) > MAX_TITLE_CHARS:
            raise ValueError(f"chapter titles have at most {MAX_TITLE_CHARS} characters")
        marks[start] = title or marks.get(start, "")
    marks.setdefault(0, marks.get(0, ""))
    return [Chapter(i, start, title) for i, (start, title) in enumerate(sorted(marks.items()))]


TITLE_CHARS = 200  # a longer first line is no heading
_HEADING = re.compile(r"^(?:#{1,6}\s+(?P<md>.+)|(?P<word>(?:chapter|part)\s+\w+.*)|"
                      r"(?P<zh>第.{1,9}[章节回卷].*))$", re.IGNORECASE)


def heading_title(line: str) -> str:
    """A chapter's title from its first line when that is a heading (``# One`` -> ``One``,
    ``Chapter 3: The Sea``, ``第三章 大海``), else ``""``."""
    line = line.strip()
    if len(line) > TITLE_CHARS:
        return ""
    m = _HEADING.match(line)
    if m is None:
        return ""
    return (m.group("md") or m.group("word") or m.group("zh") or "").strip().rstrip("#").strip()


class JobSplitter:
    """Bytes or text pieces in, segments out, with chapter boundaries; pure and bounded
    (it holds at most one unfinished segment of text)."""

    def __init__(self, chapters: list[Chapter] | None = None, max_chars: int = 200,
                 min_chars: int = 120) -> None:
        self.chapters = chapters or [Chapter(0, 0)]
        self._segmenter = Segmenter((min(min_chars, max_chars),), max_chars)
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._next_mark = 1  # index of the next chapter mark to cross
        self.chars = 0  # characters read so far
        self.segments = 0  # segments emitted so far
        self._firsts = [0]  # first segment index of each chapter reached
        # the first line of the chapter being read (bounded), for a title from its heading
        self._line: list[str] | None = []
        self._titles: dict[int, str] = {}

    def feed_bytes(self, data: bytes, final: bool = False) -> list[Chunk]:
        """UTF-8 bytes (any split); raises UnicodeDecodeError on invalid UTF-8."""
        return self.feed(self._decoder.decode(data, final))

    def feed(self, text: str) -> list[Chunk]:
        out: list[Chunk] = []
        while text:
            mark = self.chapters[self._next_mark].start if self._next_mark < len(
                self.chapters) else None
            if mark is None or self.chars + len(text) < mark:
                self._first_line(text)
                out += self._push(text)
                break
            cut = mark - self.chars
            self._first_line(text[:cut])
            out += self._push(text[:cut])
            out += self._emit(self._segmenter.flush())
            self._end_line()
            self._firsts.append(self.segments)
            self._next_mark += 1
            self._line = []
            text = text[cut:]
        return out

    def finish(self) -> list[Chunk]:
        """The end of the text: the last segment, and chapters past the end made empty."""
        out = self.feed(self._decoder.decode(b"", True))
        out += self._emit(self._segmenter.flush())
        self._end_line()
        while len(self._firsts) < len(self.chapters):
            self._firsts.append(self.segments)
        return out

    def _first_line(self, text: str) -> None:
        """Collect the current chapter's first line, up to ``TITLE_CHARS``."""
        if self._line is None:
            return
        line = self._line
        if not "".join(line).strip():  # skip blank lines before the heading
            line.clear()
            text = text.lstrip()
        end = text.find("\n")
        line.append(text[:TITLE_CHARS + 1] if end < 0 else text[:min(end, TITLE_CHARS + 1)])
        if end >= 0 or sum(map(len, line)) > TITLE_CHARS:
            self._end_line()

    def _end_line(self) -> None:
        if self._line is not None:
            title = heading_title("".join(self._line))
            if title:
                self._titles[len(self._firsts) - 1] = title
            self._line = None

    def _push(self, text: str) -> list[Chunk]:
        self.chars += len(text)
        return self._emit(self._segmenter.push(text))

    def _emit(self, chunks: list[Chunk]) -> list[Chunk]:
        self.segments += len(chunks)
        return chunks

    def chapter_table(self) -> list[Chapter]:
        """The chapters with their first segments (after :meth:`finish`)."""
        return [Chapter(c.index, c.start, c.title or self._titles.get(c.index, ""), first)
                for c, first in zip(self.chapters, self._firsts, strict=True)]


def chapter_segments(chapters: list[Chapter], total: int, index: int) -> range:
    """Segment indexes of chapter ``index``."""
    first = chapters[index].first_segment
    end = chapters[index + 1].first_segment if index + 1 < len(chapters) else total
    return range(first, end)


def eta_seconds(total: int, done: int, started_at: float | None, now: float) -> float | None:
    """Time left at the job's average rate so far (None until a segment is done)."""
    if started_at is None or done <= 0 or total <= 0:
        return None
    if done >= total:
        return 0.0
    elapsed = max(0.0, now - started_at)
    return round(elapsed / done * (total - done), 1)


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A PCM16 mono WAV header; ``data_bytes=None`` for a stream of unknown length."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))
