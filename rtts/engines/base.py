"""The engine interface the scheduler drives.

An engine is *blocking* code: ``load``, ``warmup`` and ``generate`` run on the
scheduler's worker thread(s), never on the event loop. ``generate`` takes a batch of
requests whose :meth:`Engine.batch_key` is equal and yields audio as it exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from rtts.core.params import SynthParams

__all__ = ["Engine", "EngineOutput", "Serve", "SynthRequest", "fixed_batch"]


@dataclass(eq=False)
class SynthRequest:
    """One segment to synthesize. ``cancelled`` is set from the event loop thread."""

    text: str
    params: SynthParams
    priority: int = 1  # 0 = a stream's first segment (served first)
    max_new_token: int | None = None
    degraded: bool = False  # server under load: the engine may use cheaper settings
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


# (index into the batch, float32 mono samples at engine.sample_rate, or None = that row is done)
EngineOutput = tuple[int, "npt.NDArray[np.float32] | None"]


@runtime_checkable
class Engine(Protocol):
    name: str
    sample_rate: int
    device: str

    def load(self) -> None:
        """Load weights (once, at server start)."""

    def warmup(self) -> None:
        """Run one short synthesis so the first user request pays no one-time costs."""

    def batch_key(self, params: SynthParams) -> Hashable:
        """Requests with equal keys may share one ``generate`` call."""

    def generate(self, batch: Sequence[SynthRequest]) -> Iterator[EngineOutput]:
        """Yield ``(row, samples)`` chunks in order per row, then ``(row, None)`` once per row.

        Rows whose ``cancelled`` event is set may be skipped; the caller stops iterating
        (closing the generator) once every row is cancelled, so generation must stop
        at the next yield.
        """

    def close(self) -> None:
        """Release resources."""


# An engine's continuous-batching entry point: ``serve(admit, slots)`` calls ``admit(free)``
# before every step for up to ``free`` new requests, and yields ``(request, samples)``, then
# ``(request, None)`` once per request.
Serve = Callable[[Callable[[int], Sequence[SynthRequest]], int],
                 Iterator[tuple[SynthRequest, "npt.NDArray[np.float32] | None"]]]


def fixed_batch(serve: Serve, batch: Sequence[SynthRequest]) -> Iterator[EngineOutput]:
    """``generate(batch)`` on top of ``serve``: every row starts together, nobody joins
    (static batching); outputs are keyed by row index."""
    index = {id(r): k for k, r in enumerate(batch)}
    pending = list(batch)

    def admit(free: int) -> list[SynthRequest]:
        nonlocal pending
        taken, pending = pending[:free], pending[free:]
        return taken

    outputs = serve(admit, max(1, len(batch)))
    try:
        for request, chunk in outputs:
            yield index[id(request)], chunk
    finally:
        close = getattr(outputs, "close", None)
        if close is not None:
            close()  # closing this generator stops the engine's at its next step
