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

__all__ = ["MAX_SAMPLE_CHARS", "MAX_SPEAKER_CHARS", "MAX_SPEAKER_VALUES", "SpeakerError",
           "decode_codes", "decode_speaker", "encode_codes"]

MAX_SPEAKER_CHARS: Final = 8192  # as the native protocol's voice limit
MAX_SPEAKER_VALUES: Final = 16384  # when the engine's dimension is not known (ChatTTS: 768)
# Decoding needs a dictionary only as large as the output (a speaker is a few KiB): the
# encoder's preset 9 would make every decode allocate 64 MiB
_FILTERS: Final = [{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 16}]
MAX_SAMPLE_CHARS: Final = 65536  # a packed code sample (10 s of 4 codebooks is ~2-4 K)
MAX_NUM_VQ: Final = 16


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


def encode_codes(codes: bytes, num_vq: int) -> str:
    """ChatTTS's packed form of a ``(num_vq, frames)`` uint16 code matrix (its
    ``spk_smp``, as ``Speaker.encode_prompt`` writes it: base16384 of the shape as two
    ``<u2`` and the raw-LZMA2 codes). A 64 KiB dictionary instead of preset 9's 64 MiB:
    ChatTTS's decoder reads it all the same."""
    import pybase16384 as b14

    frames = len(codes) // (2 * num_vq)
    packed = lzma.compress(codes, format=lzma.FORMAT_RAW,
                           filters=[{"id": lzma.FILTER_LZMA2, "preset": 6,
                                     "dict_size": 1 << 16}])
    head = np.array([num_vq, frames], dtype="<u2").tobytes()
    return str(b14.encode_to_string(head + packed))


def decode_codes(text: str, *, num_vq: int | None = None, max_frames: int,
                 max_code: int | None = None) -> tuple[bytes, int]:
    """The ``(codes, num_vq)`` of a packed sample (:func:`encode_codes`, or ChatTTS's
    ``sample_audio_speaker``), every size bounded before it is expanded: at most
    ``max_frames`` frames, ``num_vq`` codebooks when given, every code below ``max_code``
    when given. :class:`SpeakerError` otherwise."""
    import pybase16384 as b14

    if not isinstance(text, str) or not 0 < len(text) <= MAX_SAMPLE_CHARS:
        raise SpeakerError(f"a code sample is a string of 1 to {MAX_SAMPLE_CHARS} characters")
    try:
        raw = b14.decode_from_string(text)
    except Exception:
        raise SpeakerError("not a ChatTTS code sample (base16384)") from None
    if len(raw) < 5:
        raise SpeakerError("code sample too short")
    vq, frames = (int(x) for x in np.frombuffer(raw[:4], dtype="<u2"))
    if not 1 <= vq <= MAX_NUM_VQ or (num_vq is not None and vq != num_vq):
        raise SpeakerError(f"code sample has {vq} codebooks"
                           + (f"; this model has {num_vq}" if num_vq is not None else ""))
    if not 1 <= frames <= max_frames:
        raise SpeakerError(f"code sample has {frames} frames; 1 to {max_frames} allowed")
    want = 2 * vq * frames
    try:
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=[
            {"id": lzma.FILTER_LZMA2, "dict_size": 1 << max(12, want.bit_length())}])
        out = decompressor.decompress(raw[4:], max_length=want + 1)
    except lzma.LZMAError:
        raise SpeakerError("code sample does not decompress") from None
    if len(out) != want:
        raise SpeakerError("code sample's codes do not match its shape")
    if max_code is not None and want and int(np.frombuffer(out, "<u2").max()) >= max_code:
        raise SpeakerError(f"code sample has codes of {max_code} or more")
    return bytes(out), vq
