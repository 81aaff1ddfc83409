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
    """``max_lead_s`` bounds the lead. Beyond ``burst_s`` of lead, the lead may grow only
    at ``ramp`` times real time: audio that already exists (a prefetched segment) is
    streamed out at, say, 2x speed instead of all at once, so that when many streams
    cross a segment boundary together their backlogs interleave with live frames."""

    def __init__(self, max_lead_s: float | None, burst_s: float = 0.3,
                 ramp: float | None = 2.0) -> None:
        self.max_lead_s = max_lead_s
        self.burst_s = burst_s
        self.ramp = ramp
        self._start: float | None = None
        self._sent_s = 0.0
        self._last_at = 0.0  # when the last frame went out
        self._last_s = 0.0  # its duration

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
        lead = self.lead(now)
        over = lead - self.max_lead_s
        if over > 0:
            return over
        if self.ramp and lead > self.burst_s:
            return max(0.0, self._last_at + self._last_s / self.ramp - now)
        return 0.0

    def sent(self, seconds: float, now: float) -> None:
        if self._start is None:
            self._start = now
        elif now - self._start > self._sent_s:
            self._start = now - self._sent_s  # the client ran dry: it resumes from here
        self._sent_s += seconds
        self._last_at, self._last_s = now, seconds
