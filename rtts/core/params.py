"""Synthesis parameters and speech options, validated from a plain mapping (pure).

Every front-end takes these from its own wire shape (a native ``start`` message, a query
string, a JSON body, an ElevenLabs ``voice_settings``) and hands the core a
:class:`SynthParams`; the bounds live here once, so every protocol refuses the same values
with the same words. This module imports nothing of rtts but :mod:`rtts.errors`, so engines
may use :class:`SynthParams` (the one core type in the engine contract) without reaching
into the core's other modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from rtts.errors import ErrorCode, ProtocolError

__all__ = [
    "MAX_VOICE_CHARS",
    "PARAM_KEYS",
    "SAMPLE_RATES",
    "SpeechOptions",
    "SynthParams",
    "bounded_integer",
    "bounded_number",
    "parse_options",
    "parse_params",
]

MAX_VOICE_CHARS: Final = 8192
# Output rates every front-end may ask for (the audio is resampled to it).
SAMPLE_RATES: Final = (8000, 16000, 22050, 24000, 44100, 48000)


@dataclass(frozen=True, slots=True)
class SynthParams:
    """Voice and sampling settings of one context; hashable so equal settings batch together.

    ``voice`` is a ChatTTS speaker embedding string (``Chat.sample_random_speaker()``),
    ``"seed:N"`` for the speaker drawn from seed N, another engine's voice
    (``piper:NAME``), or ``None`` for the server default.
    """

    voice: str | None = None
    seed: int | None = None
    temperature: float = 0.3
    top_P: float = 0.7  # noqa: N815 - ChatTTS's own spelling
    top_K: int = 20  # noqa: N815
    speed: int = 5
    refine: bool = False


PARAM_KEYS: Final = tuple(SynthParams.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class SpeechOptions:
    """What an option-style request (``/v1/tts``, ``/v1/jobs``) may set besides its text."""

    params: SynthParams
    sample_rate: int = 24000
    normalize: bool = True


def _bad(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.INVALID_PARAMS)


def bounded_number(obj: Mapping[str, Any], key: str, default: float, lo: float,
                   hi: float) -> float:
    """``obj[key]`` (else ``default``) as a finite number in ``[lo, hi]``."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number")
    if not lo <= value <= hi:
        raise _bad(f"{key} must be between {lo} and {hi}")
    return float(value)


def bounded_integer(obj: Mapping[str, Any], key: str, default: int | None, lo: int,
                    hi: int) -> int | None:
    """``obj[key]`` (else ``default``, which may be None) as an integer in ``[lo, hi]``."""
    value = obj.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer")
    if not lo <= value <= hi:
        raise _bad(f"{key} must be between {lo} and {hi}")
    return value


def parse_params(obj: Mapping[str, Any]) -> SynthParams:
    """The :class:`SynthParams` keys of ``obj`` (others are ignored), bounded; raises
    :class:`~rtts.errors.ProtocolError` (``invalid_params``) naming the culprit."""
    voice = obj.get("voice")
    if voice is not None:
        if not isinstance(voice, str) or not 0 < len(voice) <= MAX_VOICE_CHARS:
            raise _bad(f"voice must be a non-empty string of at most {MAX_VOICE_CHARS} chars")
        if voice.startswith("seed:"):
            digits = voice[5:]
            if not (digits.isascii() and digits.isdigit() and int(digits) <= 2**31 - 1):
                raise _bad("voice 'seed:N' needs an integer N from 0 to 2147483647")
    refine = obj.get("refine", False)
    if not isinstance(refine, bool):
        raise _bad("refine must be true or false")
    return SynthParams(
        voice=voice,
        seed=bounded_integer(obj, "seed", None, 0, 2**31 - 1),
        temperature=bounded_number(obj, "temperature", 0.3, 0.01, 2.0),
        top_P=bounded_number(obj, "top_P", 0.7, 0.01, 1.0),
        top_K=int(bounded_integer(obj, "top_K", 20, 1, 100) or 20),
        speed=int(bounded_integer(obj, "speed", 5, 0, 9) or 0),
        refine=refine,
    )


def parse_options(obj: Mapping[str, Any]) -> SpeechOptions:
    """:func:`parse_params` plus ``sample_rate`` (one of :data:`SAMPLE_RATES`) and
    ``normalize`` (bool)."""
    rate = obj.get("sample_rate", 24000)
    if isinstance(rate, bool) or rate not in SAMPLE_RATES:
        raise _bad(f"sample_rate must be one of {list(SAMPLE_RATES)}")
    normalize = obj.get("normalize", True)
    if not isinstance(normalize, bool):
        raise _bad("normalize must be true or false")
    return SpeechOptions(parse_params(obj), int(rate), normalize)
