"""Wire protocol, version 1: pure parsing and encoding, no I/O.

Client -> server messages are JSON objects in text frames, each with a ``type``:

``start``   open a context: ``context_id``, ``voice``, ``seed``, ``temperature``, ``top_P``,
            ``top_K``, ``speed``, ``refine``, ``format``, ``sample_rate``, ``chunk_schedule``,
            ``max_chunk_chars``, ``idle_flush_ms``, ``cache`` (false: never use the
            phrase cache for this context), ``normalize`` (false: synthesize the text as
            written, without :mod:`rtts.text` spelling out numbers and symbols)
``text``    ``context_id``, ``text``: more input text (any size piece, even one character)
``flush``   ``context_id``: synthesize what is buffered now, without waiting for punctuation
``cancel``  ``context_id``: stop this context now; queued and in-flight audio is dropped
``end``     ``context_id``: no more text; the server finishes the audio and sends ``done``
``save_voice`` ``context_id``, ``name``: store the voice this context speaks as a named
            voice (its speaker plus its first segment's codes and text as the sample; the
            context may be open or among the last 16 that ended): ``voice_saved`` answers
``playback`` ``context_id``, ``played_ms`` (how much of the context's audio the client has
            really played, in ms of that audio), optional ``buffered_ms``: what the
            server paces on instead of its wall-clock estimate (see :mod:`rtts.api.native.pacing`)

``start`` also takes ``timings`` (bool): ``segment_done`` then carries estimated character
timings (``chars``, ``char_start_ms``, ``char_duration_ms``, ms in the context's audio), and
``ssml`` (bool): the context's text is SSML (:mod:`rtts.text.ssml`), in any pieces.

``context_id`` may be omitted everywhere; it then defaults to ``"default"``.

Server -> client: JSON events (``ready``, ``segment_started``, ``segment_done``, ``flushed``,
``done``, ``cancelled``, ``error``) and binary audio frames: a 12-byte little-endian
header followed by PCM16 mono samples at the context's ``sample_rate`` (or, for a context
started with another ``format``, the encoder's bytes: see :mod:`rtts.api.native.connection`)::

    u8 version (=1) | u8 flags (0) | u16 stream | u32 segment | u32 sequence | PCM16 LE ...

``stream`` is the context's number on this connection (given in ``segment_started``),
``segment`` the segment index within the context and ``sequence`` the frame index within
the segment.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from rtts.core.params import (
    SAMPLE_RATES,
    SynthParams,
    bounded_integer,
    bounded_number,
    parse_params,
)
from rtts.errors import ErrorCode, ProtocolError

__all__ = [
    "DEFAULT_CONTEXT",
    "FORMAT_RATES",
    "FRAME_HEADER",
    "PROTOCOL_VERSION",
    "SUPPORTED_FORMATS",
    "SUPPORTED_SAMPLE_RATES",
    "CancelMessage",
    "ClientMessage",
    "EndMessage",
    "FlushMessage",
    "FrameHeader",
    "PlaybackMessage",
    "SaveVoiceMessage",
    "StartMessage",
    "TextMessage",
    "encode_event",
    "pack_frame",
    "parse_client_message",
    "unpack_frame",
]

PROTOCOL_VERSION: Final = 1
DEFAULT_CONTEXT: Final = "default"
SUPPORTED_SAMPLE_RATES: Final = SAMPLE_RATES
# Audio formats of binary frames (rtts.audio.codecs encodes them); some have their own rate.
SUPPORTED_FORMATS: Final = ("pcm16", "mulaw", "alaw", "wav", "mp3", "opus", "webm", "aac",
                            "flac")
FORMAT_RATES: Final[dict[str, tuple[int, ...]]] = {
    "mulaw": (8000,), "alaw": (8000,), "webm": (48000,), "opus": (8000, 16000, 24000, 48000)}
FRAME_HEADER: Final = struct.Struct("<BBHII")

_CONTEXT_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class StartMessage:
    context_id: str
    params: SynthParams
    format: str = "pcm16"
    sample_rate: int = 24000
    chunk_schedule: tuple[int, ...] | None = None
    max_chunk_chars: int | None = None
    idle_flush_ms: int | None = None
    cache: bool = True  # may this context's segments be served from / stored in the cache
    normalize: bool = True  # spell out numbers, dates, money, symbols (rtts.text) before TTS
    timings: bool = False  # add estimated character timings to segment_done
    ssml: bool = False  # the context's text is SSML (rtts.text.ssml)


@dataclass(frozen=True, slots=True)
class TextMessage:
    context_id: str
    text: str


@dataclass(frozen=True, slots=True)
class FlushMessage:
    context_id: str


@dataclass(frozen=True, slots=True)
class CancelMessage:
    context_id: str


@dataclass(frozen=True, slots=True)
class EndMessage:
    context_id: str


@dataclass(frozen=True, slots=True)
class PlaybackMessage:
    """The client's real playback position in a context's audio (ms), and what it buffers."""

    context_id: str
    played_ms: float
    buffered_ms: float | None = None


@dataclass(frozen=True, slots=True)
class SaveVoiceMessage:
    """Store the voice a context speaks (its speaker and anchor sample) under ``name``."""

    context_id: str
    name: str


ClientMessage = (StartMessage | TextMessage | FlushMessage | CancelMessage | EndMessage
                 | PlaybackMessage | SaveVoiceMessage)

# A playback report beyond this is absurd (a context's audio is far shorter than a day).
MAX_PLAYBACK_MS: Final = 86_400_000.0


@dataclass(frozen=True, slots=True)
class FrameHeader:
    stream: int
    segment: int
    sequence: int
    flags: int = 0
    version: int = field(default=PROTOCOL_VERSION)


def _bad(message: str, code: ErrorCode = ErrorCode.INVALID_PARAMS) -> ProtocolError:
    return ProtocolError(message, code=code)


def _context_id(obj: dict[str, Any]) -> str:
    cid = obj.get("context_id", DEFAULT_CONTEXT)
    if not isinstance(cid, str) or not _CONTEXT_ID_RE.match(cid):
        raise _bad("context_id must be 1-64 characters of A-Z a-z 0-9 _ . : -",
                   ErrorCode.INVALID_MESSAGE)
    return cid


def _parse_start(obj: dict[str, Any]) -> StartMessage:
    fmt = obj.get("format", "pcm16")
    if fmt not in SUPPORTED_FORMATS:
        raise _bad(f"format must be one of {list(SUPPORTED_FORMATS)}")
    allowed = FORMAT_RATES.get(fmt, SUPPORTED_SAMPLE_RATES)
    rate = obj.get("sample_rate", 24000 if 24000 in allowed else allowed[0])
    if rate not in SUPPORTED_SAMPLE_RATES or isinstance(rate, bool):
        raise _bad(f"sample_rate must be one of {list(SUPPORTED_SAMPLE_RATES)}")
    if rate not in allowed:
        raise _bad(f"format {fmt} takes sample_rate {' or '.join(map(str, allowed))}")
    schedule = obj.get("chunk_schedule")
    if schedule is not None:
        if (
            not isinstance(schedule, list)
            or not 1 <= len(schedule) <= 16
            or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1000
                       for n in schedule)
        ):
            raise _bad("chunk_schedule must be a list of 1-16 integers between 1 and 1000")
        schedule = tuple(schedule)
    cache = obj.get("cache", True)
    if not isinstance(cache, bool):
        raise _bad("cache must be true or false")
    normalize = obj.get("normalize", True)
    if not isinstance(normalize, bool):
        raise _bad("normalize must be true or false")
    timings = obj.get("timings", False)
    if not isinstance(timings, bool):
        raise _bad("timings must be true or false")
    ssml = obj.get("ssml", False)
    if not isinstance(ssml, bool):
        raise _bad("ssml must be true or false")
    return StartMessage(
        context_id=_context_id(obj),
        params=parse_params(obj),
        format=fmt,
        sample_rate=int(rate),
        chunk_schedule=schedule,
        max_chunk_chars=bounded_integer(obj, "max_chunk_chars", None, 8, 1000),
        idle_flush_ms=bounded_integer(obj, "idle_flush_ms", None, 0, 60_000),
        cache=cache,
        normalize=normalize,
        timings=timings,
        ssml=ssml,
    )


def _parse_playback(obj: dict[str, Any]) -> PlaybackMessage:
    if "played_ms" not in obj:
        raise _bad("playback needs played_ms", ErrorCode.INVALID_MESSAGE)
    played = bounded_number(obj, "played_ms", 0.0, 0.0, MAX_PLAYBACK_MS)
    buffered = None
    if obj.get("buffered_ms") is not None:
        buffered = bounded_number(obj, "buffered_ms", 0.0, 0.0, MAX_PLAYBACK_MS)
    return PlaybackMessage(_context_id(obj), played, buffered)


def parse_client_message(data: str | bytes, *, max_text_chars: int = 20_000) -> ClientMessage:
    """Parse one client text frame; raise :class:`ProtocolError` with a precise code.

    Args:
        data: the frame payload (``str`` for text frames).
        max_text_chars: the most characters one ``text`` message may carry.
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _bad("message is not valid JSON", ErrorCode.INVALID_JSON) from None
    if not isinstance(obj, dict):
        raise _bad("message must be a JSON object", ErrorCode.INVALID_MESSAGE)
    kind = obj.get("type")
    if kind == "text":
        text = obj.get("text")
        if not isinstance(text, str):
            raise _bad("text must be a string", ErrorCode.INVALID_MESSAGE)
        if len(text) > max_text_chars:
            raise _bad(f"one text message may carry at most {max_text_chars} characters",
                       ErrorCode.TEXT_TOO_LONG)
        return TextMessage(_context_id(obj), text)
    if kind == "start":
        return _parse_start(obj)
    if kind == "flush":
        return FlushMessage(_context_id(obj))
    if kind == "cancel":
        return CancelMessage(_context_id(obj))
    if kind == "end":
        return EndMessage(_context_id(obj))
    if kind == "playback":
        return _parse_playback(obj)
    if kind == "save_voice":
        name = obj.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise _bad("save_voice needs a name", ErrorCode.INVALID_MESSAGE)
        return SaveVoiceMessage(_context_id(obj), name)
    if not isinstance(kind, str):
        raise _bad("message needs a string 'type'", ErrorCode.INVALID_MESSAGE)
    raise _bad(f"unknown message type {kind[:40]!r}", ErrorCode.UNKNOWN_TYPE)


def encode_event(kind: str, **fields: Any) -> str:
    """Encode a server event as a JSON text frame."""
    return orjson.dumps({"type": kind, **fields}).decode()


def pack_frame(header: FrameHeader, pcm16: bytes) -> bytes:
    """Binary audio frame: 12-byte header + PCM16 little-endian payload."""
    return FRAME_HEADER.pack(
        header.version, header.flags, header.stream, header.segment, header.sequence
    ) + pcm16


def unpack_frame(frame: bytes) -> tuple[FrameHeader, bytes]:
    """Inverse of :func:`pack_frame`; raises ``ValueError`` on a short or foreign frame."""
    if len(frame) < FRAME_HEADER.size:
        raise ValueError("frame shorter than its header")
    version, flags, stream, segment, sequence = FRAME_HEADER.unpack_from(frame)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"unsupported frame version {version}")
    return FrameHeader(stream, segment, sequence, flags, version), frame[FRAME_HEADER.size:]
