"""The piper engine: real neural speech on a CPU, from any piper voice (ONNX + JSON config).

`piper <https://github.com/OHF-voice/piper1-gpl>`_ (``piper-tts``, GPL-3.0-or-later) is a
VITS voice exported to ONNX, with espeak-ng phonemization bundled. One :class:`PiperEngine`
holds every piper voice model the server loads (``--voice-model PATH``, repeatable); each
model becomes a voice named after its file (``en_US-joe-medium.onnx`` ->
``en_us-joe-medium``, wire form ``piper:en_us-joe-medium``).

Streaming is by sentence: piper phonemizes a segment into sentences and runs the model once
per sentence, and each sentence's audio is yielded as soon as it exists. A VITS export takes
one utterance per run (its output has no per-row lengths), so the engine does not batch:
the scheduler runs ``workers`` segments at once on its own thread pool, each ONNX run on
``threads`` intra-op threads (onnxruntime releases the GIL while it runs).

Output is float32 mono at ``sample_rate``: the model's own rate, or, beside another engine
(a ChatTTS server that also serves piper voices), that engine's rate, converted with soxr
(:class:`~rtts.audio.pcm.StreamingResampler`, exact lengths) so a service has one rate.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from rtts.audio.pcm import StreamingResampler
from rtts.core.params import SynthParams
from rtts.engines.base import EngineInfo, EngineOutput, SynthRequest

__all__ = ["VOICE_PREFIX", "PiperEngine", "length_scale", "noise_factor", "voice_name"]

logger = logging.getLogger("rtts.engines.piper")

VOICE_PREFIX: Final = "piper:"
_TAG = re.compile(r"\[[a-z_]+(?:_\d+)?\]")  # ChatTTS control tags ([uv_break], [speed_5])
DEFAULT_TEMPERATURE: Final = SynthParams().temperature
_CHUNK_S: Final = 0.5  # a sentence's audio is handed on in pieces of at most this long


def voice_name(model_path: Path) -> str:
    """The voice name of a model file: its stem, lower-cased (``en_US-joe-medium.onnx`` ->
    ``en_us-joe-medium``), so it is a valid named-voice name."""
    stem = model_path.name
    for suffix in (".onnx", ".ONNX"):
        stem = stem.removesuffix(suffix)
    name = re.sub(r"[^a-z0-9_-]", "-", stem.lower()).strip("-_")[:64]
    if not name:
        raise ValueError(f"cannot name a voice after {model_path}")
    return name


def length_scale(speed: int) -> float:
    """rtts's ``speed`` (0-9, 5 normal) -> piper's length scale: each step is a factor of
    2^(1/4) in duration, so 9 is twice as fast as 5 and 1 twice as slow."""
    return float(2.0 ** ((5 - speed) / 4))


def noise_factor(temperature: float) -> float:
    """rtts's ``temperature`` (0.3 default) scales the voice's own noise (``noise_scale``,
    ``noise_w``): 0.3 is the voice as trained, 0.01 nearly deterministic, 0.6 twice the
    noise."""
    return max(0.0, temperature) / DEFAULT_TEMPERATURE


@dataclass
class _Model:
    name: str
    path: Path
    config_path: Path
    sample_rate: int
    speakers: int
    noise_scale: float
    noise_w: float
    voice: Any = None  # piper.PiperVoice, once loaded


class PiperEngine:
    """Every loaded piper voice model, behind the :class:`~rtts.engines.base.Engine` interface."""

    name = "piper"

    def __init__(self, model_paths: Sequence[Path], sample_rate: int | None = None,
                 workers: int | None = None, threads: int | None = None) -> None:
        if not model_paths:
            raise ValueError("the piper engine needs at least one --voice-model")
        self.models: dict[str, _Model] = {}
        for path in model_paths:
            path = Path(path)
            config_path = Path(f"{path}.json")
            if not path.is_file():
                raise ValueError(f"piper voice model {path} does not exist")
            if not config_path.is_file():
                raise ValueError(f"piper voice model {path} has no config {config_path.name} "
                                 "beside it")
            config = orjson.loads(config_path.read_bytes())
            name = voice_name(path)
            if name in self.models:
                raise ValueError(f"two piper voice models are named {name!r}")
            self.models[name] = _Model(
                name, path, config_path, int(config["audio"]["sample_rate"]),
                int(config.get("num_speakers", 1)),
                float(config.get("inference", {}).get("noise_scale", 0.667)),
                float(config.get("inference", {}).get("noise_w", 0.8)))
        self.default = next(iter(self.models))
        self.sample_rate = sample_rate or self.models[self.default].sample_rate
        # the cores this process may run on (a container's CPU set, not the host's count)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        # Segments synthesized at once (the scheduler's device workers), each ONNX run on
        # ``threads`` cores: by default one thread per run and one run per core.
        self.workers = max(1, workers or cores)
        self.threads = max(1, threads or 1)
        self.identity = "piper:" + ",".join(
            f"{m.name}:{m.path.stat().st_size}:{self.sample_rate}"
            for m in self.models.values())

    # -- Engine interface ----------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """Voices ``piper:NAME``; its scheduler: batches of one (a stream's first segment
        first), ``workers`` at once, no batch wait (no continuous batching: one utterance
        per ONNX run); the intake bound and timeouts are the server's."""
        return EngineInfo(self.name, self.sample_rate, continuous=False,
                          weights={"kind": "none", "source": self.name,
                                   "identity": self.identity},
                          voice_prefix=VOICE_PREFIX, voices=tuple(self.models),
                          batching="static", max_batch_size=1, concurrency=self.workers,
                          max_wait_ms=0.0, details=self._details())

    def load(self) -> None:
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        for model in self.models.values():
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
            session = onnxruntime.InferenceSession(
                str(model.path), sess_options=options, providers=["CPUExecutionProvider"])
            config = PiperConfig.from_dict(orjson.loads(model.config_path.read_bytes()))
            model.voice = PiperVoice(session=session, config=config)
            logger.info("piper voice %s loaded from %s (%d Hz, %d speaker(s))", model.name,
                        model.path, model.sample_rate, model.speakers)

    def warmup(self) -> None:
        for name in self.models:
            request = SynthRequest("Warm up.", SynthParams(voice=VOICE_PREFIX + name))
            for _ in self.generate([request]):
                pass

    def voices(self) -> list[str]:
        """The voice names this engine serves, the default first."""
        return list(self.models)

    def resolve(self, voice: str | None) -> tuple[_Model, int | None]:
        """A request's ``voice`` -> (model, speaker id). ``None`` and ``seed:N`` (what
        OpenAI's voice names and the built-in voices resolve to) are the default model
        (speaker N modulo its speakers); ``piper:NAME`` or ``piper:NAME:SPEAKER`` a model."""
        if voice is None or voice.startswith("seed:"):
            model = self.models[self.default]
            seed = int(voice[5:]) if voice is not None else 0
            return model, (seed % model.speakers) if model.speakers > 1 else None
        if not voice.startswith(VOICE_PREFIX):
            raise ValueError("a piper voice is piper:NAME (one of "
                             f"{', '.join(self.models)}) or seed:N, not a ChatTTS speaker")
        name, _, speaker = voice[len(VOICE_PREFIX):].partition(":")
        found = self.models.get(name)
        if found is None:
            raise ValueError(f"no piper voice {name[:64]!r}; loaded: {', '.join(self.models)}")
        if not speaker:
            return found, 0 if found.speakers > 1 else None
        if not speaker.isdigit() or int(speaker) >= found.speakers:
            raise ValueError(f"piper voice {name} has speakers 0-{found.speakers - 1}")
        return found, int(speaker)

    def validate(self, params: SynthParams) -> None:
        self.resolve(params.voice)

    def batch_key(self, params: SynthParams) -> Hashable:
        return params.voice

    def generate(self, batch: Sequence[SynthRequest]) -> Iterator[EngineOutput]:
        """Each row in turn, sentence by sentence (the scheduler gives batches of one and
        runs several at once)."""
        from piper.config import SynthesisConfig

        for row, request in enumerate(batch):
            if request.cancelled.is_set():
                yield row, None
                continue
            model, speaker = self.resolve(request.params.voice)
            if model.voice is None:
                raise RuntimeError("the piper engine is not loaded")
            noise = noise_factor(request.params.temperature)
            config = SynthesisConfig(speaker_id=speaker,
                                     length_scale=length_scale(request.params.speed),
                                     noise_scale=model.noise_scale * noise,
                                     noise_w_scale=model.noise_w * noise)
            text = _TAG.sub(" ", request.text).strip()
            resampler = StreamingResampler(model.sample_rate, self.sample_rate)
            piece = max(1, int(_CHUNK_S * self.sample_rate))
            for chunk in model.voice.synthesize(text, config) if text else ():
                out = resampler.process(chunk.audio_float_array)
                for start in range(0, len(out), piece):
                    yield row, out[start:start + piece]
                if request.cancelled.is_set():
                    break
            tail = resampler.flush()
            if tail.size and not request.cancelled.is_set():
                yield row, tail
            yield row, None

    def close(self) -> None:
        for model in self.models.values():
            model.voice = None

    def _details(self) -> dict[str, Any]:
        """For ``/v1/info``: the models, their native rates and speakers."""
        return {"voices": [{"name": m.name, "voice": VOICE_PREFIX + m.name,
                            # the file's name: /v1/info needs no key, the path is
                            # the server's business
                            "model": m.path.name, "model_sample_rate": m.sample_rate,
                            "speakers": m.speakers} for m in self.models.values()],
                "workers": self.workers, "threads": self.threads}
