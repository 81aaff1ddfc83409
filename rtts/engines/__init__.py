"""Engine registry; heavy engines are imported only when built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rtts.engines.base import Engine, SynthRequest

if TYPE_CHECKING:
    from rtts.config import EngineConfig

__all__ = ["ENGINES", "Engine", "SynthRequest", "build_engine", "build_engines"]

ENGINES = ("chattts", "fake", "piper")


def build_engine(config: EngineConfig) -> Engine:
    if config.name == "fake":
        from rtts.engines.fake import FakeEngine

        # served as ChatTTS is: requests join a running batch at its next step (unless
        # the scheduler is told --batching static)
        return FakeEngine(rtf=config.fake_rtf, first_chunk_latency_ms=config.fake_first_chunk_ms,
                          continuous=True)
    if config.name == "chattts":
        from rtts.engines.chattts import ChatTTSEngine

        return ChatTTSEngine(config)
    if config.name == "piper":
        from rtts.engines.piper import PiperEngine

        return PiperEngine(config.voice_models, workers=config.piper_workers)
    raise ValueError(f"unknown engine {config.name!r}; choose from {ENGINES}")


def build_engines(config: EngineConfig, primary: Engine | None = None) -> list[Engine]:
    """The engines of one server, the primary (default) one first: ``config.name``'s (or
    ``primary``, built by the caller), then a piper engine for ``config.voice_models``
    when the primary is not piper itself. Every engine outputs at the primary's rate."""
    first = primary or build_engine(config)
    engines = [first]
    if config.voice_models and first.name != "piper":
        from rtts.engines.piper import PiperEngine

        engines.append(PiperEngine(config.voice_models, sample_rate=first.sample_rate,
                                   workers=config.piper_workers))
    return engines
