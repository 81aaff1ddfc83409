"""The engine contract: what the scheduler drives and what the rest of rtts may know.

An engine is *blocking* code: ``load``, ``warmup`` and ``generate`` run on the
scheduler's worker thread(s), never on the event loop. ``generate`` takes a batch of
requests whose :meth:`Engine.batch_key` is equal and yields audio as it exists.

Everything else the scheduler, the service and the front-ends may know of an engine is in
its :class:`EngineInfo` (``engine.info``): rate, device, weights, whether it batches
continuously (then it is a :class:`ContinuousEngine`), the voices it claims, the scheduler
shape it needs, its kernels. Nothing outside ``rtts.engines`` probes an engine for other
attributes. Engines import nothing from :mod:`rtts.api`; their one core type is
:class:`~rtts.core.params.SynthParams` (a leaf module).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from rtts.core.params import SpeakerSample, SynthParams

__all__ = ["ContinuousEngine", "Engine", "EngineInfo", "EngineOutput", "SampleEngine", "Serve",
           "SynthRequest", "fixed_batch"]


@dataclass(eq=False)
class SynthRequest:
    """One segment to synthesize. ``cancelled`` is set from the event loop thread."""

    text: str
    params: SynthParams
    priority: int = 1  # 0 = a stream's first segment (served first)
    max_new_token: int | None = None
    degraded: bool = False  # server under load: the engine may use cheaper settings
    stream: int | None = None  # the stream (context) it belongs to, when known
    cancelled: threading.Event = field(default_factory=threading.Event)
    # set by an engine with codes (``info.samples``) before the request's end: the codes it
    # generated and the text they say (a context anchors its later segments on it)
    produced: SpeakerSample | None = None

    def cancel(self) -> None:
        self.cancelled.set()


# (index into the batch, float32 mono samples at engine.sample_rate, or None = that row is done)
EngineOutput = tuple[int, "npt.NDArray[np.float32] | None"]


NO_WEIGHTS: Mapping[str, str] = {"kind": "none", "source": "", "identity": ""}


@dataclass(frozen=True)
class EngineInfo:
    """What the scheduler and the front-ends may know of an engine (``engine.info``).

    ``weights``: ``kind`` (``real``, ``random``, ``none``, ``unloaded``), ``source`` and
    ``identity``, as /v1/info, the ready event and /metrics report them. ``voice_prefix``:
    the engine speaks the voices that start with it (``piper:``), and ``voices`` names
    them (without the prefix); None for the primary engine, which takes every other voice.
    ``batching`` / ``max_batch_size`` / ``concurrency`` / ``max_wait_ms``: a scheduler shape
    the engine needs (None: the server's settings). ``kernels``: the GPT kernels chosen at
    load, if any; ``details``: more for /v1/info (models, workers).
    """

    name: str
    sample_rate: int
    device: str = "cpu"
    continuous: bool = False
    weights: Mapping[str, str] = field(default_factory=lambda: dict(NO_WEIGHTS))
    voice_prefix: str | None = None
    voices: tuple[str, ...] = ()
    batching: Literal["continuous", "static"] | None = None
    max_batch_size: int | None = None
    concurrency: int | None = None
    max_wait_ms: float | None = None
    kernels: Mapping[str, Any] | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    # conditions prompts on a SpeakerSample (SynthParams.sample), sets
    # SynthRequest.produced, and encodes audio clips to samples: a SampleEngine
    samples: bool = False

    @property
    def random_weights(self) -> bool:
        return self.weights.get("kind") == "random"


@runtime_checkable
class Engine(Protocol):
    """A speech engine. ``name`` and ``sample_rate`` are fixed when it is built; the rest
    of what may be known of it is :attr:`info`."""

    name: str
    sample_rate: int

    @property
    def info(self) -> EngineInfo:
        """What the engine is now (weights and kernels change at :meth:`load`)."""

    def load(self) -> None:
        """Load weights (once, at server start)."""

    def warmup(self) -> None:
        """Run one short synthesis so the first user request pays no one-time costs."""

    def validate(self, params: SynthParams) -> None:
        """Raise ``ValueError`` (its message goes to the client) for params this engine
        cannot speak, e.g. a malformed or unknown voice. Called before a request queues."""

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


@runtime_checkable
class ContinuousEngine(Engine, Protocol):
    """An engine whose ``info.continuous`` is true: requests join its running batch."""

    def serve(self, admit: Callable[[int], Sequence[SynthRequest]], slots: int
              ) -> Generator[tuple[SynthRequest, npt.NDArray[np.float32] | None], None, None]:
        """See :data:`Serve`; closing the generator stops the batch at its next step."""


@runtime_checkable
class SampleEngine(Engine, Protocol):
    """An engine whose ``info.samples`` is true: voices from a reference clip."""

    def encode_sample(self, audio: npt.NDArray[np.float32], text: str) -> SpeakerSample:
        """The sample of ``audio`` (float32 mono at ``sample_rate``, already bounded to
        :data:`~rtts.core.params.MAX_SAMPLE_SECONDS`) saying ``text``. Blocking (a device
        forward): call it off the event loop. ``ValueError`` for audio it cannot use."""


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
