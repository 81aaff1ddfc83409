"""Engine registry; heavy engines are imported only when built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Engine, SynthRequest

if TYPE_CHECKING:
    from ..config import EngineConfig

__all__ = ["ENGINES", "Engine", "SynthRequest", "build_engine"]

ENGINES = ("chattts", "fake")


def build_engine(config: EngineConfig) -> Engine:
    if config.name == "fake":
        from .fake import FakeEngine

        return FakeEngine(rtf=config.fake_rtf, first_chunk_latency_ms=config.fake_first_chunk_ms)
    if config.name == "chattts":
        from .chattts_engine import ChatTTSEngine

        return ChatTTSEngine(config)
    raise ValueError(f"unknown engine {config.name!r}; choose from {ENGINES}")
