"""Load governor: NORMAL -> DEGRADED -> REJECTING and back, with hysteresis. Pure logic.

The server samples load signals (queue depth, RSS, CPU, GPU memory, streams beyond the
engine's measured real-time capacity) every
``interval_s`` and feeds them to :meth:`Governor.update`. A signal at or above a level's
threshold moves the state *up* to that level at once. The state steps *down* one level
only after every signal has stayed below ``recover_ratio`` times the current level's
thresholds for ``hold_s`` seconds, so it does not flap around a threshold.

What the levels mean is decided by the server:

* DEGRADED: new segments use cheaper settings (shorter chunks, no text refine, no batch
  wait, fewer tokens per segment), and a continuous batch admits at most the measured
  real-time capacity (or ``degraded_slots``) rows: streams beyond it wait for a slot;
* REJECTING: new connections get an ``overloaded`` error event and close 1013, and new
  contexts on open connections get an ``overloaded`` error.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Governor", "GovernorConfig", "Level", "LoadSignals"]

logger = logging.getLogger("rtts.core.governor")


class Level(IntEnum):
    NORMAL = 0
    DEGRADED = 1
    REJECTING = 2


@dataclass(frozen=True)
class LoadSignals:
    queue_depth: int = 0  # requests waiting for the device
    rss_mb: float = 0.0
    cpu_percent: float = 0.0  # whole-machine, 0-100
    gpu_mem_fraction: float = 0.0  # 0-1; 0 without a GPU
    # live streams wanting the engine beyond the real-time capacity it measured from its
    # own steps (ChatTTS on a CPU); 0 while that capacity is unknown
    streams_over_capacity: int = 0


@dataclass(frozen=True)
class GovernorConfig:
    """Thresholds per level; ``None`` ignores that signal."""

    degrade_queue_depth: int | None = 16  # the server scales both by max_batch_size / 4
    reject_queue_depth: int | None = 64
    degrade_rss_mb: float | None = None
    reject_rss_mb: float | None = None
    degrade_cpu_percent: float | None = None  # a CPU engine is busy by design; opt in
    reject_cpu_percent: float | None = None
    degrade_gpu_mem_fraction: float | None = 0.85
    reject_gpu_mem_fraction: float | None = 0.95
    # one stream beyond the measured real-time capacity: degrade (the server then admits
    # only that many rows; the others wait instead of every stream stuttering)
    degrade_streams_over_capacity: int | None = 1
    reject_streams_over_capacity: int | None = None
    recover_ratio: float = 0.6
    hold_s: float = 2.0
    interval_s: float = 0.5


_FIELDS = (("queue_depth", "queue_depth"), ("rss_mb", "rss_mb"),
           ("cpu_percent", "cpu_percent"), ("gpu_mem_fraction", "gpu_mem_fraction"),
           ("streams_over_capacity", "streams_over_capacity"))


class Governor:
    def __init__(self, config: GovernorConfig | None = None) -> None:
        self.config = config or GovernorConfig()
        self.level = Level.NORMAL
        self.reason = ""
        self.transitions: Counter[str] = Counter()
        self._calm_since: float | None = None

    def _thresholds(self, level: Level) -> dict[str, float | None]:
        prefix = "degrade" if level == Level.DEGRADED else "reject"
        return {sig: getattr(self.config, f"{prefix}_{name}") for sig, name in _FIELDS}

    def _over(self, signals: LoadSignals, level: Level, scale: float = 1.0) -> str | None:
        for sig, limit in self._thresholds(level).items():
            value = getattr(signals, sig)
            if limit is not None and value >= limit * scale:
                return f"{sig}={value:g} >= {limit * scale:g}"
        return None

    def update(self, signals: LoadSignals, now: float) -> Level:
        """Apply one sample; return the (possibly new) level."""
        for level in (Level.REJECTING, Level.DEGRADED):
            why = self._over(signals, level)
            if why is not None:
                if level > self.level:
                    self._move(level, why)
                if level >= self.level:
                    self._calm_since = None
                    return self.level
                break
        if self.level == Level.NORMAL:
            return self.level
        if self._over(signals, self.level, self.config.recover_ratio) is not None:
            self._calm_since = None
            return self.level
        if self._calm_since is None:
            self._calm_since = now
        elif now - self._calm_since >= self.config.hold_s:
            self._move(Level(self.level - 1), "load fell below the recovery threshold")
            self._calm_since = now
        return self.level

    def _move(self, level: Level, why: str) -> None:
        key = f"{self.level.name.lower()}->{level.name.lower()}"
        self.transitions[key] += 1
        log = logger.warning if level > self.level else logger.info
        log("load governor: %s (%s)", key, why)
        self.level = level
        self.reason = why
