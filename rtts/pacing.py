"""Output pacing: keep a context's audio at most ``max_lead_s`` ahead of playback. Pure.

The server cannot see the client's playback position, so it estimates it from the wall
clock: playback starts with the first frame sent and runs in real time; if everything
sent would already have played (the client ran dry), the clock restarts when more audio
goes out. Before each frame, :meth:`LeadPacer.delay` says how long to wait so the lead
stays within the bound. Audio produced faster than real time is then spread out instead
of flushed in one burst, which keeps the event loop free for live frames of other streams
and bounds what a client must buffer.
"""

from __future__ import annotations

__all__ = ["LeadPacer"]


class LeadPacer:
    def __init__(self, max_lead_s: float | None) -> None:
        self.max_lead_s = max_lead_s
        self._start: float | None = None
        self._sent_s = 0.0

    def _position(self, now: float) -> float:
        assert self._start is not None
        return min(now - self._start, self._sent_s)

    def lead(self, now: float) -> float:
        """Seconds of audio sent but (by the estimate) not yet played."""
        return 0.0 if self._start is None else self._sent_s - self._position(now)

    def delay(self, now: float) -> float:
        """Seconds to wait before sending the next frame (0 when pacing is off)."""
        if self.max_lead_s is None:
            return 0.0
        return max(0.0, self.lead(now) - self.max_lead_s)

    def sent(self, seconds: float, now: float) -> None:
        if self._start is None:
            self._start = now
        elif now - self._start > self._sent_s:
            self._start = now - self._sent_s  # the client ran dry: it resumes from here
        self._sent_s += seconds
