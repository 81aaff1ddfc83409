"""Deepgram's speak (TTS) wire format, parsed and built without I/O.

``/v1/speak`` WebSocket: options in the query (``model``, ``encoding`` linear16|mulaw|alaw,
``sample_rate``, ``speed``; ``container``, ``bit_rate``, ``mip_opt_out`` accepted and
ignored); the key as ``Authorization: Token KEY`` (or ``Bearer``) or the subprotocols
``token, KEY``. Client messages: ``{"type": "Speak", "text"}``, ``Flush``, ``Clear``,
``Close``. Server messages: ``Metadata`` first, raw binary audio, ``Flushed`` /
``Cleared`` with ``sequence_id``, ``Warning`` / ``Error`` with ``description`` and
``code``.

Flux, ``/v2/speak``: the same handshake; ``Connected`` first; a turn starts with the first
``Speak`` (``SpeechStarted`` before its audio) and ends with ``Flush`` (its audio, then
``SpeechMetadata`` with ``audio_duration_ms`` and ``billable_character_count``, then
``Flushed``); ``Interrupt`` stops the turn (``SpeechInterrupted`` with ``audio_played_ms``;
``Warning NO_ACTIVE_SPEECH`` when none is active); ``Configure {speed}`` applies from the
next turn (``ConfigureSuccess`` / ``ConfigureFailure``).

``POST /v1/speak``: the same query (plus ``container`` none|wav and the compressed
encodings mp3, opus, flac, aac), body ``{"text": ...}``; errors as
``{"err_code", "err_msg", "request_id"}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import orjson

from rtts.errors import RttsError

__all__ = ["DeepgramError", "Message", "SpeakOptions", "auth_key", "cleared", "configure_failure",
           "configure_success", "connected", "flushed", "metadata", "parse_message",
           "parse_options", "speech_interrupted", "speech_metadata", "speech_started",
           "warning"]

DEFAULT_MODEL: Final = "aura-2-thalia-en"
WS_ENCODINGS: Final = {"linear16": "s16", "mulaw": "mulaw", "alaw": "alaw"}
HTTP_ENCODINGS: Final = {**WS_ENCODINGS, "mp3": "mp3", "opus": "opus", "flac": "flac",
                         "aac": "aac"}
RATES: Final = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MESSAGE_TYPES: Final = ("Speak", "Flush", "Clear", "Close")
FLUX_TYPES: Final = ("Speak", "Flush", "Interrupt", "Configure", "Close")


class DeepgramError(RttsError):
    """An error in Deepgram's shape: on the socket an ``Error`` (``fatal``: then closed with
    ``close``) or ``Warning`` message; over HTTP a status with ``err_code`` / ``err_msg``."""

    def __init__(self, message: str, code: str = "INVALID_QUERY_PARAMETER", *,
                 status: int = 400, close: int = 1008, fatal: bool = False) -> None:
        super().__init__(message, code=code)
        self.code: str = code
        self.status = status
        self.close = close
        self.fatal = fatal

    def event(self) -> dict[str, Any]:
        kind = "Error" if self.fatal else "Warning"
        return {"type": kind, "description": self.message, "code": self.code,
                "err_code": self.code, "err_msg": self.message}

    def body(self, request_id: str) -> dict[str, Any]:
        return {"err_code": self.code, "err_msg": self.message, "request_id": request_id}


@dataclass(frozen=True, slots=True)
class SpeakOptions:
    model: str
    encoding: str  # s16 | mulaw | alaw (| mp3 opus flac aac over HTTP)
    sample_rate: int
    container: str  # none | wav (HTTP linear16)
    speed: float | None
    bit_rate: int | None


def _number(name: str, value: str, *, integer: bool) -> float:
    try:
        number = float(int(value)) if integer else float(value)
    except (ValueError, OverflowError):
        raise DeepgramError(f"{name} must be {'an integer' if integer else 'a number'}"
                            ) from None
    if not math.isfinite(number):
        raise DeepgramError(f"{name} must be a finite number")
    return number


def parse_options(query: dict[str, str], *, http: bool = False) -> SpeakOptions:
    """The query options of a socket or REST request, else :class:`DeepgramError`."""
    model = query.get("model") or DEFAULT_MODEL
    if len(model) > 63:
        raise DeepgramError("model is too long")
    encodings = HTTP_ENCODINGS if http else WS_ENCODINGS
    enc_name = query.get("encoding") or ("mp3" if http else "linear16")
    if enc_name not in encodings:
        raise DeepgramError(f"encoding must be one of {', '.join(encodings)}",
                            "UNSUPPORTED_ENCODING")
    encoding = encodings[enc_name]
    default_rate = 8000 if encoding in ("mulaw", "alaw") else (
        48000 if encoding == "opus" else 24000)
    raw_rate = query.get("sample_rate")
    rate = default_rate if raw_rate is None else int(_number("sample_rate", raw_rate,
                                                             integer=True))
    if rate not in RATES:
        raise DeepgramError(f"sample_rate must be one of {', '.join(map(str, RATES))}",
                            "UNSUPPORTED_SAMPLE_RATE")
    if encoding in ("mulaw", "alaw") and rate != 8000:
        raise DeepgramError(f"{enc_name} is served at sample_rate 8000",
                            "UNSUPPORTED_SAMPLE_RATE")
    if encoding == "opus" and rate != 48000:
        raise DeepgramError("opus is served at sample_rate 48000", "UNSUPPORTED_SAMPLE_RATE")
    container = (query.get("container") or ("wav" if http and encoding == "s16" else "none")
                 ).lower()
    if container not in ("none", "wav", "ogg"):
        raise DeepgramError("container must be none or wav", "UNSUPPORTED_CONTAINER")
    if container == "wav" and encoding != "s16":
        container = "none"  # Deepgram: the wav container holds linear16 only
    raw_speed = query.get("speed")
    speed = None if raw_speed is None else _number("speed", raw_speed, integer=False)
    if speed is not None and not 0.25 <= speed <= 4.0:
        raise DeepgramError("speed must be a number from 0.25 to 4.0")
    raw_bits = query.get("bit_rate")
    bit_rate = None if raw_bits is None else int(_number("bit_rate", raw_bits, integer=True))
    if bit_rate is not None and not 8000 <= bit_rate <= 320000:
        raise DeepgramError("bit_rate must be 8000-320000")
    return SpeakOptions(model, encoding, rate, container, speed, bit_rate)


def auth_key(authorization: str | None, subprotocols: list[str]) -> str | None:
    """The key in ``Authorization: Token KEY`` or the subprotocols ``token, KEY``."""
    if authorization and authorization[:6].lower() == "token ":
        return authorization[6:].strip() or None
    if len(subprotocols) >= 2 and subprotocols[0].strip().lower() == "token":
        return subprotocols[1].strip() or None
    return None


@dataclass(frozen=True, slots=True)
class Message:
    type: str  # Speak | Flush | Clear | Close (v1); Speak | Flush | Interrupt | Configure | Close
    text: str = ""
    speed: float | None = None  # Configure


def parse_message(raw: str | bytes, *, max_text_chars: int, flux: bool = False) -> Message:
    """One client message (``flux``: of ``/v2/speak``), else :class:`DeepgramError` (a
    warning: the socket stays). A ``Configure`` with a bad ``speed`` raises with code
    ``INVALID_SPEED`` (Flux answers ``ConfigureFailure``)."""
    if isinstance(raw, bytes):
        raise DeepgramError("binary messages are not accepted; send JSON text",
                            "INVALID_MESSAGE")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise DeepgramError("message is not valid JSON", "INVALID_MESSAGE") from None
    if not isinstance(obj, dict):
        raise DeepgramError("a message must be a JSON object", "INVALID_MESSAGE")
    kind = obj.get("type")
    types = FLUX_TYPES if flux else MESSAGE_TYPES
    if kind not in types:
        raise DeepgramError(f"type must be one of {', '.join(types)}", "INVALID_MESSAGE")
    if kind == "Configure":
        speed = obj.get("speed")
        if speed is not None and (isinstance(speed, bool) or not isinstance(speed, int | float)
                                  or not 0.25 <= speed <= 4.0):
            raise DeepgramError("speed must be a number from 0.25 to 4.0", "INVALID_SPEED")
        return Message("Configure", speed=None if speed is None else float(speed))
    if kind != "Speak":
        return Message(str(kind))
    text = obj.get("text")
    if not isinstance(text, str):
        raise DeepgramError("Speak needs text: a string", "INVALID_MESSAGE")
    if len(text) > max_text_chars:
        raise DeepgramError(f"text is longer than {max_text_chars} characters",
                            "TEXT_TOO_LONG")
    return Message("Speak", text)


def metadata(request_id: str, model: str, model_uuid: str, version: str) -> dict[str, Any]:
    return {"type": "Metadata", "request_id": request_id, "model_name": model,
            "model_version": version, "model_uuid": model_uuid}


def flushed(sequence_id: int) -> dict[str, Any]:
    return {"type": "Flushed", "sequence_id": sequence_id}


def cleared(sequence_id: int) -> dict[str, Any]:
    return {"type": "Cleared", "sequence_id": sequence_id}


def warning(description: str, code: str) -> dict[str, Any]:
    return {"type": "Warning", "description": description, "code": code}


# -- Flux (/v2/speak) -------------------------------------------------------------------------


def connected(request_id: str, model: str, version: str) -> dict[str, Any]:
    return {"type": "Connected", "request_id": request_id, "model_name": model,
            "model_version": version}


def speech_started(speech_id: str) -> dict[str, Any]:
    return {"type": "SpeechStarted", "speech_id": speech_id}


def speech_metadata(speech_id: str, audio_ms: float, characters: int) -> dict[str, Any]:
    return {"type": "SpeechMetadata", "speech_id": speech_id,
            "audio_duration_ms": round(audio_ms), "billable_character_count": characters}


def speech_interrupted(speech_id: str, played_ms: float) -> dict[str, Any]:
    return {"type": "SpeechInterrupted", "speech_id": speech_id,
            "audio_played_ms": round(played_ms)}


def configure_success(speed: float | None) -> dict[str, Any]:
    return {"type": "ConfigureSuccess", "applied": {} if speed is None else {"speed": speed}}


def configure_failure(exc: DeepgramError, value: Any) -> dict[str, Any]:
    return {"type": "ConfigureFailure", "code": exc.code, "field": "speed", "value": value,
            "description": exc.message}
