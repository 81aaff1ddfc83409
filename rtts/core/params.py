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
    "MAX_SAMPLE_SECONDS",
    "MAX_SAMPLE_TEXT_CHARS",
    "MAX_VOICE_CHARS",
    "NO_SPEAKER",
    "PARAM_KEYS",
    "SAMPLE_RATES",
    "SpeakerSample",
    "SpeechOptions",
    "SynthParams",
    "bounded_integer",
    "bounded_number",
    "parse_options",
    "parse_params",
    "trim_sample",
]

MAX_VOICE_CHARS: Final = 8192
# A speaker sample (a voice's reference clip, or a context's anchor) holds at most this
# much audio as codes: every segment conditioned on it prefills ~47 more tokens a second.
MAX_SAMPLE_SECONDS: Final = 10.0
MAX_SAMPLE_TEXT_CHARS: Final = 400  # its transcript
FRAMES_PER_SECOND: Final = 24000 / 512  # one code frame per GPT step
# the voice of a prompt conditioned on a sample alone (ChatTTS's ``[empty_spk]``: no
# speaker embedding); only valid with ``sample`` set
NO_SPEAKER: Final = "[empty_spk]"
# Output rates every front-end may ask for (the audio is resampled to it).
SAMPLE_RATES: Final = (8000, 16000, 22050, 24000, 44100, 48000)


@dataclass(frozen=True, slots=True)
class SpeakerSample:
    """Audio codes and their transcript that a prompt is conditioned on (ChatTTS's
    ``spk_smp`` / ``txt_smp``). ``codes``: the ``(num_vq, frames)`` code matrix as
    little-endian uint16 bytes, row-major (one frame per GPT step, 46.875 a second);
    ``text``: what they say. :mod:`rtts.core.speaker` converts to and from ChatTTS's packed
    string (``Speaker.encode_prompt``); ``digest`` names it in cache keys."""

    codes: bytes
    text: str
    num_vq: int = 4

    @property
    def frames(self) -> int:
        return len(self.codes) // (2 * self.num_vq)

    @property
    def seconds(self) -> float:
        return self.frames * 512 / 24000

    @property
    def digest(self) -> str:
        import hashlib

        h = hashlib.sha256(self.text.encode())
        h.update(b"\0%d\0" % self.num_vq)
        h.update(self.codes)
        return h.hexdigest()[:32]


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
    # Speaker anchoring: after a context's first segment, later ones are conditioned on its
    # codes and text (ChatTTS's long-text recipe), so the voice holds across segments.
    # None (the default): where the engine has real-time headroom for it
    # (Service.anchor_fits); True / False: always / never.
    anchor: bool | None = None
    # ChatTTS's refine prompt levels ([oral_N] 0-9, [laugh_N] 0-2, [break_N] 0-7); any
    # set runs the refine pass with that prompt (None: ChatTTS's empty prompt)
    oral: int | None = None
    laugh: int | None = None
    breaks: int | None = None
    repetition_penalty: float = 1.05  # ChatTTS's, over the last 16 codes (1.0: off)
    # what the prompt is conditioned on besides the speaker: a voice's sample (set by the
    # voice registry) or the context's anchor (set by the context); never from the wire
    sample: SpeakerSample | None = None

    @property
    def refine_prompt(self) -> str:
        """ChatTTS's refine prompt for these levels ("" when none is set)."""
        return "".join(f"[{tag}_{level}]" for tag, level in (
            ("oral", self.oral), ("laugh", self.laugh), ("break", self.breaks))
            if level is not None)

    @property
    def refines(self) -> bool:
        """Whether the refine pass runs: ``refine`` or a refine level set."""
        return self.refine or bool(self.refine_prompt)


# the wire keys (``sample`` is not one: it comes from the voice registry or the context)
PARAM_KEYS: Final = tuple(k for k in SynthParams.__dataclass_fields__ if k != "sample")


@dataclass(frozen=True, slots=True)
class SpeechOptions:
    """What an option-style request (``/v1/tts``, ``/v1/jobs``) may set besides its text."""

    params: SynthParams
    sample_rate: int = 24000
    normalize: bool = True


def trim_sample(sample: SpeakerSample, max_seconds: float = MAX_SAMPLE_SECONDS
                ) -> SpeakerSample:
    """``sample`` bounded to its first ``max_seconds`` of codes. The text is cut in the
    same proportion (at a space when there is one near): codes and text no longer match
    exactly, which a prompt tolerates better than an unbounded prefill."""
    keep = int(max_seconds * FRAMES_PER_SECOND)
    frames = sample.frames
    if frames <= keep:
        return sample
    import numpy as np

    codes = np.frombuffer(sample.codes, dtype="<u2").reshape(sample.num_vq, frames)
    cut = max(1, round(len(sample.text) * keep / frames))
    space = sample.text.rfind(" ", 0, cut + 1)
    if space > cut * 3 // 4:
        cut = space
    return SpeakerSample(np.ascontiguousarray(codes[:, :keep]).tobytes(),
                         sample.text[:cut].strip(), sample.num_vq)


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
    anchor = obj.get("anchor")
    if anchor is not None and not isinstance(anchor, bool):
        raise _bad("anchor must be true or false")
    return SynthParams(
        voice=voice,
        seed=bounded_integer(obj, "seed", None, 0, 2**31 - 1),
        temperature=bounded_number(obj, "temperature", 0.3, 0.01, 2.0),
        top_P=bounded_number(obj, "top_P", 0.7, 0.01, 1.0),
        top_K=int(bounded_integer(obj, "top_K", 20, 1, 100) or 20),
        speed=int(bounded_integer(obj, "speed", 5, 0, 9) or 0),
        refine=refine,
        anchor=anchor,
        oral=bounded_integer(obj, "oral", None, 0, 9),
        laugh=bounded_integer(obj, "laugh", None, 0, 2),
        breaks=bounded_integer(obj, "breaks", None, 0, 7),
        repetition_penalty=bounded_number(obj, "repetition_penalty", 1.05, 1.0, 2.0),
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
