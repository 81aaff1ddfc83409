"""A deterministic test double for the engine: tones instead of speech.

It exists so the server, scheduler and client library can be tested and benchmarked
without a model. Each request yields a sine tone whose pitch follows the voice and seed
and whose length follows the text (``ms_per_char``), in ``chunk_ms`` pieces, after
``first_chunk_latency_ms``, at ``rtf`` times real time (0 = as fast as possible).
It has samples as ChatTTS has them (``info.samples``): each request's ``produced`` sample
is codes derived from its text and voice, and :meth:`FakeEngine.encode_sample` derives codes
from a clip's loudness, one frame per 512 samples; the tone ignores samples.
Served (``rtts serve --engine fake``) it batches continuously, as ChatTTS does: a request
joins the running batch at its next step (``--batching static``: fixed batches).
Text containing ``"[fail]"`` raises, and ``"[hang]"`` blocks until cancelled (tags in ChatTTS's
bracket style, which text normalization leaves alone), so tests
can exercise the error and timeout paths.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rtts.core.params import FRAMES_PER_SECOND, SpeakerSample, SynthParams
from rtts.engines.base import EngineInfo, EngineOutput, SynthRequest, fixed_batch

__all__ = ["FakeEngine"]


class FakeEngine:
    name = "fake"

    def __init__(
        self,
        sample_rate: int = 24000,
        ms_per_char: float = 60.0,
        chunk_ms: float = 100.0,
        first_chunk_latency_ms: float = 0.0,
        rtf: float = 0.0,
        max_audio_s: float = 30.0,
        continuous: bool = False,
    ) -> None:
        self.continuous = continuous  # the scheduler may let requests join running batches
        self.sample_rate = sample_rate
        self.ms_per_char = ms_per_char
        self.chunk_ms = chunk_ms
        self.first_chunk_latency_ms = first_chunk_latency_ms
        self.rtf = rtf
        self.max_audio_s = max_audio_s
        self.loaded = False
        self.identity = f"fake:{sample_rate}:{ms_per_char}"
        self.batches: list[int] = []  # sizes of the batches served, for tests and metrics
        self._tables: dict[float, npt.NDArray[np.float32]] = {}  # tone per frequency

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.name, self.sample_rate, continuous=self.continuous,
                          samples=True, weights={"kind": "none", "source": self.name,
                                   "identity": self.identity})

    def load(self) -> None:
        self.loaded = True

    def validate(self, params: SynthParams) -> None:
        """Any voice string will do: the tone's pitch follows it."""

    def encode_sample(self, audio: npt.NDArray[np.float32], text: str) -> SpeakerSample:
        """Codes from the clip's loudness per 512-sample frame (deterministic)."""
        frames = audio.size // 512
        if frames < 2:
            raise ValueError("the clip is too short")
        rms = np.sqrt(np.mean(audio[:frames * 512].astype(np.float64).reshape(frames, 512)
                              ** 2, axis=1))
        level = np.minimum(624, (rms * 2000).astype(np.int64))
        codes = np.stack([(level + k) % 625 for k in range(4)]).astype("<u2")
        return SpeakerSample(codes.tobytes(), text, 4)

    def _produced(self, request: SynthRequest, samples: int) -> SpeakerSample:
        frames = max(1, min(int(samples / self.sample_rate * FRAMES_PER_SECOND), 2048))
        seed = hashlib.sha256(f"{request.text}|{request.params.voice}".encode()).digest()
        codes = np.random.default_rng(int.from_bytes(seed[:8], "little")).integers(
            0, 625, (4, frames)).astype("<u2")
        return SpeakerSample(codes.tobytes(), request.text, 4)

    def warmup(self) -> None:
        for _ in self.generate([SynthRequest("warm up", SynthParams())]):
            pass
        self.batches.clear()

    def batch_key(self, params: SynthParams) -> Hashable:
        return None  # everything batches together

    def frequency(self, params: SynthParams) -> float:
        key = f"{params.voice}|{params.seed}".encode()
        return 180.0 + int.from_bytes(hashlib.sha256(key).digest()[:2], "little") % 400

    def total_samples(self, text: str) -> int:
        seconds = min(self.max_audio_s, len(text) * self.ms_per_char / 1000.0)
        return max(1, int(seconds * self.sample_rate))

    def generate(self, batch: Sequence[SynthRequest]) -> Iterator[EngineOutput]:
        """A fixed batch (static batching): every row starts together, nobody joins."""
        return fixed_batch(self.serve, batch)

    def serve(self, admit: Callable[[int], Sequence[SynthRequest]], slots: int
              ) -> Generator[tuple[SynthRequest, npt.NDArray[np.float32] | None], None, None]:
        """Continuous batching, as the ChatTTS engine does it: before every tick (one
        ``chunk_ms`` chunk per live row) ``admit(free)`` may add requests to the batch."""
        chunk = max(1, int(self.chunk_ms * self.sample_rate / 1000))
        live: list[_Row] = []
        while True:
            free = slots - len(live)
            new = list(admit(free)) if free > 0 else []
            for r in new:
                if "[fail]" in r.text:
                    raise RuntimeError("fake engine failure requested by the text")
            if new:
                self.batches.append(len(live) + len(new))
                if self.first_chunk_latency_ms:
                    self._sleep(self.first_chunk_latency_ms / 1000.0, new)
                live += [_Row(r, self.total_samples(r.text), self.frequency(r.params))
                         for r in new]
            if not live:
                return
            for row in live:
                r = row.request
                if r.cancelled.is_set():
                    row.done = True
                    yield r, None
                    continue
                if "[hang]" in r.text:
                    r.cancelled.wait(0.05)
                    continue
                n = min(chunk, row.total - row.pos)
                yield r, self._tone(row.freq, row.pos, n)
                row.pos += n
                if row.pos >= row.total:
                    row.done = True
                    r.produced = self._produced(r, row.total)
                    yield r, None
            live = [row for row in live if not row.done]
            if self.rtf and live:
                self._sleep(self.rtf * self.chunk_ms / 1000.0, [x.request for x in live])

    def _tone(self, freq: float, start: int, n: int) -> npt.NDArray[np.float32]:
        """Samples [start, start + n) of the tone, sliced from two cached seconds (so any
        chunk up to a second is one slice): the test double costs next to nothing, and it
        shares the GIL with the server's loop."""
        table = self._tables.get(freq)
        if table is None:
            # An integer frequency repeats exactly every second.
            t = np.arange(2 * self.sample_rate, dtype=np.float64) / self.sample_rate
            table = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
            self._tables[freq] = table
        offset = start % self.sample_rate
        if offset + n <= len(table):
            return table[offset:offset + n].copy()
        return table[(offset + np.arange(n)) % self.sample_rate]

    @staticmethod
    def _sleep(seconds: float, batch: Sequence[SynthRequest]) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if all(r.cancelled.is_set() for r in batch):
                return
            time.sleep(min(left, 0.01))

    def close(self) -> None:
        self.loaded = False


@dataclass(eq=False)
class _Row:
    request: SynthRequest
    total: int  # samples
    freq: float
    pos: int = 0
    done: bool = False
