"""Voice names every front-end takes, resolved once for all of them.

A client's ``voice`` may be one of OpenAI's names (``alloy`` ... ``cedar``: each the
ChatTTS speaker drawn from a fixed seed, so a name sounds the same on every protocol and
every instance), a named voice of the registry (:mod:`rtts.core.voices`, resolved per
context), ``seed:N``, another engine's voice (``piper:NAME``), or a ChatTTS speaker
embedding string. :func:`resolve_voice` turns it into the ``voice`` of
:class:`~rtts.core.params.SynthParams` or raises a :class:`~rtts.errors.ProtocolError`
(``invalid_params``) that each front-end words in its own error shape.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from rtts.core.params import SynthParams
from rtts.errors import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from rtts.core.service import Service

__all__ = ["OPENAI_VOICES", "resolve_voice", "speed_from_factor"]

# OpenAI's voice names -> the ChatTTS speaker drawn from a fixed seed (``seed:N``).
# Never change a mapping: clients rely on a name sounding the same everywhere.
OPENAI_VOICES: Final[dict[str, int]] = {
    "alloy": 2, "ash": 3, "ballad": 5, "coral": 7, "echo": 11, "fable": 13, "nova": 17,
    "onyx": 19, "sage": 23, "shimmer": 29, "verse": 31, "marin": 37, "cedar": 41,
}


def speed_from_factor(speed: float) -> int:
    """A speed factor (0.25-4.0, 1.0 normal; OpenAI's and ElevenLabs') -> ChatTTS speed 0-9
    (5 normal), two and a half steps per doubling."""
    return max(0, min(9, round(5 + 2.5 * math.log2(speed))))


def resolve_voice(voice: str, service: Service, owner: str | None = None) -> str:
    """A client's voice string -> the ``SynthParams.voice`` to use (see the module doc).
    Named voices are ``owner``'s (the key's owner id) and the shared ones."""
    if not voice:
        raise ProtocolError("voice must be a non-empty string", code=ErrorCode.INVALID_PARAMS)
    name = voice.strip().lower()
    if name in OPENAI_VOICES:
        return f"seed:{OPENAI_VOICES[name]}"
    if service.voices.get(name, owner) is not None:  # a named voice: resolved per context
        return name
    if name.startswith("seed:") and name[5:].isdigit() and len(name) <= 15:
        return name
    other = SynthParams(voice=voice.strip())
    if service.engine_for(other) is not service.engine:  # another engine's, e.g. piper:NAME
        service.validate_params(other)
        return other.voice or ""
    if len(voice) >= 64:  # a ChatTTS speaker embedding string
        service.validate_params(SynthParams(voice=voice))
        return voice
    if ":" in name:  # the primary engine's own wire form (piper:NAME with --engine piper)
        try:
            service.validate_params(other)
            return other.voice or ""
        except ProtocolError:
            pass
    loaded = [v.name for v in service.voices.list()]  # named, built-in and engine voices
    raise ProtocolError(f"unknown voice {voice[:64]!r}; use one of {', '.join(OPENAI_VOICES)}, "
                        f"{', '.join(loaded[:40]) + ', ' if loaded else ''}seed:N, or a "
                        "voice's wire form (piper:NAME); GET /v1/voices lists them",
                        code=ErrorCode.INVALID_PARAMS)
