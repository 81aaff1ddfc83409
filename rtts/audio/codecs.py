"""Streaming audio encoders, one module for every front-end.

``open_encoder(fmt, input_rate, sample_rate)`` returns an :class:`Encoder`: feed it float32
mono audio at ``input_rate`` as it arrives (:meth:`Encoder.encode`), get back the encoded
bytes that exist so far, and call :meth:`Encoder.finish` once for the tail. Nothing
buffers the whole clip: containers are written for a non-seekable stream (a WAV header with
unknown sizes, Ogg pages every 20 ms, WebM clusters every 100 ms, ADTS frames for AAC).

=========  =====================================  ===========  ================================
format     what                                   rate         media type
=========  =====================================  ===========  ================================
pcm16      raw signed 16-bit little-endian         requested    audio/pcm (``pcm`` is an alias)
mulaw      G.711 μ-law, raw bytes                  8000         audio/basic
alaw       G.711 A-law, raw bytes                  8000         audio/x-alaw-basic
wav        RIFF/WAVE PCM16, sizes 0xFFFFFFFF       requested    audio/wav
mp3        MPEG layer III (libmp3lame)             requested    audio/mpeg
opus       Opus in Ogg (libopus)                   8/12/16/24/48k  audio/ogg
webm       Opus in WebM (for MediaSource)          48000        audio/webm
aac        AAC-LC in ADTS frames                   requested    audio/aac
flac       FLAC (STREAMINFO without totals)        requested    audio/flac
=========  =====================================  ===========  ================================

The compressed formats are encoded by PyAV (``av``), whose wheel bundles FFmpeg's
encoders; it is imported on first use only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol, cast

import numpy as np
import numpy.typing as npt

from rtts.audio.pcm import StreamingResampler, float_to_pcm16

__all__ = ["CODECS", "Codec", "Encoder", "codec_for", "open_encoder"]


@dataclass(frozen=True)
class Codec:
    name: str
    media_type: str
    fixed_rate: int | None = None  # the format's own rate (G.711, WebM), else as requested
    container: str | None = None  # PyAV container format; None = written here
    codec: str | None = None  # PyAV encoder name
    options: tuple[tuple[str, str], ...] = ()  # container options


CODECS: Final[dict[str, Codec]] = {c.name: c for c in (
    Codec("pcm16", "audio/pcm"),
    Codec("mulaw", "audio/basic", fixed_rate=8000),
    Codec("alaw", "audio/x-alaw-basic", fixed_rate=8000),
    Codec("wav", "audio/wav"),
    Codec("mp3", "audio/mpeg", container="mp3", codec="libmp3lame"),
    Codec("opus", "audio/ogg", container="ogg", codec="libopus",
          options=(("page_duration", "20000"),)),
    Codec("webm", "audio/webm", fixed_rate=48000, container="webm", codec="libopus",
          options=(("live", "1"), ("cluster_time_limit", "100"))),
    Codec("aac", "audio/aac", container="adts", codec="aac"),
    Codec("flac", "audio/flac", container="flac", codec="flac"),
)}
_ALIASES: Final = {"pcm": "pcm16", "ulaw": "mulaw", "g711_ulaw": "mulaw", "g711_alaw": "alaw",
                   "ogg": "opus"}
_OPUS_RATES: Final = (8000, 12000, 16000, 24000, 48000)


def codec_for(name: str) -> Codec | None:
    """The codec called ``name`` (or one of its aliases), None if unknown."""
    return CODECS.get(_ALIASES.get(name, name))


class Encoder(Protocol):
    codec: Codec
    sample_rate: int  # rate of the encoded audio
    samples: int  # audio samples (at sample_rate) encoded so far

    def encode(self, samples: npt.NDArray[np.float32]) -> bytes:
        """Encode more input audio; return the bytes ready now (maybe none)."""

    def finish(self) -> bytes:
        """No more audio: return the remaining bytes. Call once."""


def output_rate(codec: Codec, requested: int) -> int:
    if codec.fixed_rate is not None:
        return codec.fixed_rate
    if codec.codec == "libopus" and requested not in _OPUS_RATES:
        return 48000
    return requested


# Container options for a *part* of a longer stream (long-text jobs store each segment
# apart and concatenate them): no per-part headers a decoder would choke on mid-stream.
_PART_OPTIONS: Final = {"mp3": (("id3v2_version", "0"), ("write_xing", "0"))}


def open_encoder(name: str, input_rate: int, sample_rate: int = 24000,
                 bit_rate: int | None = None, *, part: bool = False) -> Encoder:
    """A streaming encoder for ``name`` taking float32 audio at ``input_rate``;
    ``bit_rate`` (bits/s) applies to the compressed formats (the encoder's default if None);
    ``part``: the output will be concatenated with other parts (no MP3 ID3/Xing headers)."""
    codec = codec_for(name)
    if codec is None:
        raise ValueError(f"unknown audio format {name!r}")
    if part and codec.name in _PART_OPTIONS:
        codec = replace(codec, options=codec.options + _PART_OPTIONS[codec.name])
    rate = output_rate(codec, sample_rate)
    if codec.container is not None:
        return _AvEncoder(codec, input_rate, rate, bit_rate)
    return _RawEncoder(codec, input_rate, rate)


class _Resampling:
    def __init__(self, input_rate: int, rate: int) -> None:
        self.sample_rate = rate
        self.samples = 0
        self._resampler = StreamingResampler(input_rate, rate) if input_rate != rate else None

    def _pcm(self, samples: npt.NDArray[np.float32], final: bool = False) -> npt.NDArray[Any]:
        if self._resampler is not None:
            out = self._resampler.flush() if final else self._resampler.process(samples)
        else:
            out = samples
        self.samples += len(out)
        return np.frombuffer(float_to_pcm16(out), dtype="<i2")


class _RawEncoder(_Resampling):
    """PCM16, G.711 and streamed WAV: written here, byte for byte."""

    def __init__(self, codec: Codec, input_rate: int, rate: int) -> None:
        super().__init__(input_rate, rate)
        self.codec = codec
        self._header = codec.name == "wav"

    def _bytes(self, pcm: npt.NDArray[Any]) -> bytes:
        data: bytes
        if self.codec.name == "mulaw":
            data = _mulaw(pcm)
        elif self.codec.name == "alaw":
            data = _alaw(pcm)
        else:
            data = pcm.tobytes()
        if self._header:
            self._header = False
            return streaming_wav_header(self.sample_rate) + data
        return data

    def encode(self, samples: npt.NDArray[np.float32]) -> bytes:
        return self._bytes(self._pcm(samples))

    def finish(self) -> bytes:
        empty = np.zeros(0, np.float32)
        return self._bytes(self._pcm(empty, final=True))


def streaming_wav_header(sample_rate: int) -> bytes:
    """A PCM16 mono WAV header for a stream of unknown length (both sizes 0xFFFFFFFF)."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


class _Sink:
    """A write-only, non-seekable file for PyAV: muxers write for a live stream."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class _AvEncoder(_Resampling):
    """A PyAV (FFmpeg) encoder and muxer writing into memory as packets come out."""

    def __init__(self, codec: Codec, input_rate: int, rate: int,
                 bit_rate: int | None = None) -> None:
        super().__init__(input_rate, rate)
        import av

        self.codec = codec
        self._av = av
        self._sink = _Sink()
        assert codec.container is not None and codec.codec is not None
        self._container: Any = av.open(self._sink, mode="w", format=codec.container,
                                       options=dict(codec.options))
        self._stream: Any = self._container.add_stream(codec.codec, rate=rate, layout="mono")
        if bit_rate is not None:
            cast(Any, self._stream).bit_rate = bit_rate  # an AudioStream
        self._pts = 0
        self._finished = False

    def _feed(self, pcm: npt.NDArray[Any] | None) -> None:
        if pcm is None:
            packets = self._stream.encode(None)
        elif len(pcm) == 0:
            return
        else:
            frame = self._av.AudioFrame.from_ndarray(
                np.ascontiguousarray(pcm, dtype=np.int16)[None, :], format="s16",
                layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            self._pts += len(pcm)
            packets = self._stream.encode(frame)
        for packet in packets:
            self._container.mux(packet)

    def encode(self, samples: npt.NDArray[np.float32]) -> bytes:
        self._feed(self._pcm(samples))
        return self._sink.take()

    def finish(self) -> bytes:
        if self._finished:
            return b""
        self._finished = True
        self._feed(self._pcm(np.zeros(0, np.float32), final=True))
        self._feed(None)
        self._container.close()
        return self._sink.take()


# -- G.711 -----------------------------------------------------------------------------

def _mulaw_codes(x: npt.NDArray[np.int32]) -> npt.NDArray[np.uint8]:
    """ITU-T G.711 μ-law codes of PCM16 values."""
    sign = np.where(x < 0, 0x80, 0)
    mag = np.minimum(np.abs(x), 32635) + 0x84
    exponent = (np.floor(np.log2(mag)).astype(np.int32) - 7).clip(0, 7)
    mantissa = (mag >> (exponent + 3)) & 0x0F
    codes: npt.NDArray[np.uint8] = (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)
    return codes


def _alaw_codes(x: npt.NDArray[np.int32]) -> npt.NDArray[np.uint8]:
    """ITU-T G.711 A-law codes of PCM16 values."""
    x = x >> 3  # 13-bit
    sign = np.where(x >= 0, 0x80, 0)
    mag = np.where(x >= 0, x, -x - 1).clip(0, 4095)
    exponent = np.where(mag < 32, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 4)
    exponent = exponent.clip(0, 7)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    codes: npt.NDArray[np.uint8] = (((sign | (exponent << 4) | mantissa) ^ 0x55) & 0xFF).astype(
        np.uint8)
    return codes


# Indexed by the PCM16 sample's bits read as uint16.
_ALL = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)
_MULAW_TABLE: Final = _mulaw_codes(_ALL)
_ALAW_TABLE: Final = _alaw_codes(_ALL)


def _mulaw(pcm: npt.NDArray[Any]) -> bytes:
    return bytes(_MULAW_TABLE[pcm.view(np.uint16)].tobytes())


def _alaw(pcm: npt.NDArray[Any]) -> bytes:
    return bytes(_ALAW_TABLE[pcm.view(np.uint16)].tobytes())
