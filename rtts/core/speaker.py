"""ChatTTS speaker-embedding strings, decoded with every size bounded before it is expanded.

A speaker string is base16384 text of raw-LZMA2-compressed float16 values (ChatTTS's
``Speaker._encode``). ChatTTS's own ``Speaker._decode`` decompresses in full before any
size check, so 8,000 characters could inflate to ~92 MiB (and a 252 KiB OpenAI ``voice``
to gigabytes). :func:`decode_speaker` bounds all three steps: the string's length, the
decoded bytes (from the length), and the decompressed output (``max_length``: never more
than the expected vector plus one byte is produced, with a 64 KiB dictionary instead of the
encoder's 64 MiB), so a decode costs microseconds and well under a MiB whatever the
input (small enough to run on the event loop). Pure; ``pybase16384`` is imported lazily.
"""

from __future__ import annotations

import lzma
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_SPEAKER_CHARS", "MAX_SPEAKER_VALUES", "SpeakerError", "decode_speaker"]

MAX_SPEAKER_CHARS: Final = 8192  # as the native protocol's voice limit
MAX_SPEAKER_VALUES: Final = 16384  # when the engine's dimension is not known (ChatTTS: 768)
# Decoding needs a dictionary only as large as the output (a speaker is a few KiB): the
# encoder's preset 9 would make every decode allocate 64 MiB
_FILTERS: Final = [{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 16}]


class SpeakerError(ValueError):
    """Not a usable speaker string (the message says why)."""


def decode_speaker(speaker: str, dim: int | None = None) -> npt.NDArray[np.float32]:
    """The speaker embedding of ``speaker`` as float32, exactly ``dim`` values when ``dim``
    is given (else 1 to :data:`MAX_SPEAKER_VALUES`), all finite; :class:`SpeakerError`
    otherwise. :class:`ImportError` when pybase16384 is not installed."""
    import pybase16384 as b14

    if not 0 < len(speaker) <= MAX_SPEAKER_CHARS:
        raise SpeakerError(f"a speaker string has 1 to {MAX_SPEAKER_CHARS} characters")
    limit = 2 * (dim if dim is not None else MAX_SPEAKER_VALUES)
    try:
        packed = b14.decode_from_string(speaker)
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_FILTERS)
        raw = decompressor.decompress(packed, max_length=limit + 1)
    except Exception:
        raise SpeakerError("voice is not a ChatTTS speaker embedding string") from None
    if len(raw) > limit:  # more than a speaker has: stopped there, not inflated
        raise SpeakerError(f"voice embedding has more than {limit // 2} values; "
                           + (f"this model needs {dim}" if dim is not None
                              else f"a speaker has at most {MAX_SPEAKER_VALUES}"))
    if not decompressor.eof:
        raise SpeakerError("voice is not a ChatTTS speaker embedding string (truncated)")
    if dim is not None and len(raw) != limit:
        raise SpeakerError(f"voice embedding has {len(raw) // 2} values; this model "
                           f"needs {dim}")
    if not raw or len(raw) % 2:
        raise SpeakerError("speaker embedding is empty" if not raw
                           else "voice embedding is not float16 values")
    arr = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
    if not np.isfinite(arr).all():
        raise SpeakerError("voice embedding has non-finite values (NaN or infinity)")
    return arr
