"""Cartesia's TTS wire format, parsed and built without I/O.

Client messages on ``/tts/websocket`` are generation requests::

    {"context_id", "model_id", "transcript", "voice": {"mode": "id", "id"},
     "output_format": {"container": "raw", "encoding", "sample_rate"},
     "continue", "flush", "add_timestamps", "max_buffer_delay_ms",
     "generation_config": {"speed"}, "language", "duration", ...}

or a cancel, ``{"context_id", "cancel": true}``. Server messages: ``chunk`` (base64
``data``), ``timestamps`` (``word_timestamps {words, start, end}`` in seconds from the
context's start), ``flush_done``, ``done``, ``error``; each carries ``context_id``,
``status_code`` and ``done``. ``POST /tts/bytes`` takes the same request object (without
``context_id``) and answers the audio; ``POST /tts/sse`` answers the socket's ``chunk``,
``timestamps`` and ``done`` messages as Server-Sent Events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from rtts.errors import RttsError

__all__ = ["CANCEL", "CartesiaError", "Generation", "OutputFormat", "chunk", "done",
           "flush_done", "parse_message", "parse_output_format", "parse_request",
           "timestamps"]

ENCODINGS: Final = {"pcm_s16le": "s16", "pcm_f32le": "f32", "pcm_mulaw": "mulaw",
                    "pcm_alaw": "alaw"}
RATES: Final = (8000, 16000, 22050, 24000, 44100, 48000)
CONTAINERS: Final = ("raw", "wav", "mp3")
MAX_CONTEXT_ID: Final = 256
CANCEL: Final = "cancel"


class CartesiaError(RttsError):
    """An error answered in Cartesia's shape: an ``error`` message on the socket (the
    socket stays open unless ``close`` is set) or an HTTP status with a JSON body."""

    def __init__(self, message: str, error_code: str = "invalid_request", *,
                 status: int = 400, title: str = "Invalid request",
                 close: int | None = None) -> None:
        super().__init__(message, code=error_code)
        self.error_code = error_code
        self.status = status
        self.title = title
        self.close = close

    def event(self, context_id: str | None) -> dict[str, Any]:
        # context_id is always present (pipecat indexes it), null when not known; done is
        # false: LiveKit reads a true done before the type and would drop the error
        return {"type": "error", "context_id": context_id, "done": False,
                "status_code": self.status, "title": self.title, "message": self.message,
                "error_code": self.error_code, "error": f"{self.title}: {self.message}"}

    def body(self) -> dict[str, Any]:
        return {"title": self.title, "message": self.message, "error_code": self.error_code,
                "status_code": self.status, "error": self.message}


@dataclass(frozen=True, slots=True)
class OutputFormat:
    container: str  # raw | wav | mp3
    encoding: str  # s16 | f32 | mulaw | alaw (raw and wav)
    sample_rate: int
    bit_rate: int | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation request (a piece of a context's transcript), validated."""

    context_id: str | None
    transcript: str
    voice_id: str | None
    embedding: bool  # voice.mode == "embedding"
    model_id: str | None
    output_format: OutputFormat | None
    cont: bool  # "continue": more transcript follows in this context
    flush: bool
    add_timestamps: bool
    max_buffer_delay_ms: int | None
    speed: float | None
    cancel: bool = False


def _bad(message: str, code: str = "invalid_request") -> CartesiaError:
    return CartesiaError(message, code)


def parse_output_format(obj: Any, *, http: bool = False) -> OutputFormat:
    if not isinstance(obj, dict):
        raise _bad("output_format must be an object {container, encoding, sample_rate}")
    container = obj.get("container", "raw")
    if container not in (CONTAINERS if http else ("raw",)):
        allowed = ", ".join(CONTAINERS) if http else "raw"
        raise _bad(f"output_format.container must be {allowed}", "invalid_output_format")
    rate = obj.get("sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in RATES:
        raise _bad(f"output_format.sample_rate must be one of {', '.join(map(str, RATES))}",
                   "invalid_output_format")
    bit_rate = obj.get("bit_rate")
    if container == "mp3":
        if bit_rate is not None and (isinstance(bit_rate, bool) or not isinstance(
                bit_rate, int) or not 32000 <= bit_rate <= 320000):
            raise _bad("output_format.bit_rate must be 32000-320000", "invalid_output_format")
        return OutputFormat("mp3", "mp3", rate, bit_rate)
    encoding = obj.get("encoding")
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise _bad(f"output_format.encoding must be one of {', '.join(ENCODINGS)}",
                   "invalid_output_format")
    kind = ENCODINGS[encoding]
    if kind in ("mulaw", "alaw") and rate != 8000:
        raise _bad(f"{encoding} is served at sample_rate 8000", "invalid_output_format")
    if container == "wav" and kind != "s16":
        raise _bad("the wav container holds pcm_s16le", "invalid_output_format")
    return OutputFormat(container, kind, rate)


def _voice(obj: Any) -> tuple[str | None, bool]:
    if obj is None:
        return None, False
    if isinstance(obj, str) and obj:  # the SDK's newer form: the id alone
        return obj, False
    if not isinstance(obj, dict):
        raise _bad("voice must be a voice id or an object {mode: \"id\", id}")
    mode = obj.get("mode", "id")
    if mode == "embedding":
        emb = obj.get("embedding")
        if not isinstance(emb, list) or not emb:
            raise _bad("voice.embedding must be a list of numbers")
        return None, True
    if mode != "id":
        raise _bad("voice.mode must be \"id\" or \"embedding\"")
    vid = obj.get("id")
    if not isinstance(vid, str) or not vid:
        raise _bad("voice.id must be a non-empty string")
    return vid, False


def _speed(obj: Any, legacy: Any) -> float | None:
    speed: Any = None
    if obj is not None:
        if not isinstance(obj, dict):
            raise _bad("generation_config must be an object")
        speed = obj.get("speed")
    if speed is None and legacy is not None:  # the older top-level "speed"
        speed = legacy
    if speed is None:
        return None
    if isinstance(speed, str):  # sonic-2's "slowest".."fastest"
        named = {"slowest": 0.6, "slow": 0.8, "normal": 1.0, "fast": 1.25, "fastest": 1.5}
        if speed not in named:
            raise _bad("speed must be a number from 0.25 to 4.0 or slowest|slow|normal|fast|"
                       "fastest")
        return named[speed]
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not (
            0.25 <= speed <= 4.0):
        raise _bad("generation_config.speed must be a number from 0.25 to 4.0")
    return float(speed)


def _flag(obj: dict[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false")
    return value


def parse_request(obj: Any, *, max_text_chars: int, http: bool = False) -> Generation:
    """A request object (already decoded JSON) -> :class:`Generation`, else
    :class:`CartesiaError`. ``language``, ``duration``, ``pronunciation_dict_id``,
    ``use_normalized_timestamps`` and unknown fields are accepted and ignored."""
    if not isinstance(obj, dict):
        raise _bad("a request must be a JSON object")
    cid = obj.get("context_id")
    if cid is not None and (not isinstance(cid, str) or not 1 <= len(cid) <= MAX_CONTEXT_ID):
        raise _bad(f"context_id must be a string of 1-{MAX_CONTEXT_ID} characters")
    if _flag(obj, "cancel", False):
        if cid is None:
            raise _bad("cancel needs the context_id to cancel")
        return Generation(cid, "", None, False, None, None, False, False, False, None, None,
                          cancel=True)
    transcript = obj.get("transcript", "")
    if transcript is None:
        transcript = ""
    if not isinstance(transcript, str):
        raise _bad("transcript must be a string")
    if len(transcript) > max_text_chars:
        raise _bad(f"transcript is longer than {max_text_chars} characters",
                   "transcript_too_long")
    model = obj.get("model_id")
    if model is not None and not isinstance(model, str):
        raise _bad("model_id must be a string")
    voice_id, embedding = _voice(obj.get("voice"))
    fmt_obj = obj.get("output_format")
    fmt = None if fmt_obj is None else parse_output_format(fmt_obj, http=http)
    delay = obj.get("max_buffer_delay_ms")
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int)
                              or not 0 <= delay <= 5000):
        raise _bad("max_buffer_delay_ms must be an integer from 0 to 5000")
    for name in ("language", "locale", "pronunciation_dict_id", "normalization"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise _bad(f"{name} must be a string")
    duration = obj.get("duration")
    if duration is not None and (isinstance(duration, bool)
                                 or not isinstance(duration, int | float)):
        raise _bad("duration must be a number of seconds")
    return Generation(
        context_id=cid, transcript=transcript, voice_id=voice_id, embedding=embedding,
        model_id=model, output_format=fmt, cont=_flag(obj, "continue", False),
        flush=_flag(obj, "flush", False), add_timestamps=_flag(obj, "add_timestamps", False),
        max_buffer_delay_ms=delay, speed=_speed(obj.get("generation_config"),
                                                obj.get("speed")))


def parse_message(raw: str | bytes, *, max_text_chars: int) -> Generation:
    """One socket message -> :class:`Generation` (``cancel`` set for a cancel)."""
    if isinstance(raw, bytes):
        raise _bad("binary messages are not accepted; send JSON text", "invalid_message")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _bad("message is not valid JSON", "invalid_message") from None
    return parse_request(obj, max_text_chars=max_text_chars)


# -- server messages ---------------------------------------------------------------------


def chunk(context_id: str, data: str, step_time_ms: float, flush_id: int | None
          ) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "chunk", "context_id": context_id, "data": data,
                           "done": False, "status_code": 206,
                           "step_time": round(step_time_ms, 3)}
    if flush_id is not None:
        msg["flush_id"] = flush_id
    return msg


def timestamps(context_id: str, words: list[str], start: list[float], end: list[float],
               flush_id: int | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "timestamps", "context_id": context_id, "done": False,
                           "status_code": 206,
                           "word_timestamps": {"words": words, "start": start, "end": end}}
    if flush_id is not None:
        msg["flush_id"] = flush_id
    return msg


def flush_done(context_id: str, flush_id: int) -> dict[str, Any]:
    return {"type": "flush_done", "context_id": context_id, "done": False,
            "flush_done": True, "flush_id": flush_id, "status_code": 206}


def done(context_id: str) -> dict[str, Any]:
    return {"type": "done", "context_id": context_id, "done": True, "status_code": 200}
