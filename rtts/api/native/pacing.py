"""Output pacing: keep a context's audio at most ``max_lead_s`` ahead of playback. Pure.

Playback position: a client that reports it (the native ``playback`` message: how much of
the context's audio it has really played) is paced on its **reported** position, never
extrapolated, so audio sent stays within ``max_lead_s`` of what the client says it has
played, however slowly it plays (a stalled or throttled tab gets no more than the lead).
On reported positions the lead is at least ``min_reported_lead_s`` (0.5 s): a client does not
start a track before its prebuffer fills (the JS player's grows up to 400 ms), so a smaller
lead could wait on a position that cannot move.
Until a context has a report, the server estimates the position from the wall clock:
playback starts with the first frame sent and runs in real time; if everything sent would
already have played (the client ran dry), the clock restarts when more audio goes out.
Before each frame, :meth:`LeadPacer.delay` says how long to wait so the lead stays within
the bound. Audio produced faster than real time is then spread out instead
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
                 ramp: float | None = 2.0, min_reported_lead_s: float = 0.5) -> None:
        self.max_lead_s = max_lead_s
        self.min_reported_lead_s = min_reported_lead_s
        self.burst_s = burst_s
        self.ramp = ramp
        self._start: float | None = None
        self._sent_s = 0.0
        self._last_at = 0.0  # when the last frame went out
        self._last_s = 0.0  # its duration
        self._reported_s: float | None = None  # the client's own playback position

    def report(self, played_s: float) -> None:
        """The client has played ``played_s`` of this context's audio (positions only
        move forward: an older, smaller report arriving late is ignored)."""
        if self._reported_s is None or played_s > self._reported_s:
            self._reported_s = played_s

    @property
    def reported(self) -> bool:
        return self._reported_s is not None

    def _position(self, now: float) -> float:
        if self._reported_s is not None:
            return min(self._reported_s, self._sent_s)
        assert self._start is not None
        return min(now - self._start, self._sent_s)

    def played(self, now: float) -> float:
        """Seconds of this context's audio played: reported, else estimated."""
        if self._reported_s is None and self._start is None:
            return 0.0
        return self._position(now)

    def lead(self, now: float) -> float:
        """Seconds of audio sent but (by the estimate) not yet played."""
        return 0.0 if self._start is None else self._sent_s - self._position(now)

    def delay(self, now: float) -> float:
        """Seconds to wait before sending the next frame (0 when pacing is off).

        With a reported position the wait assumes real-time playback from the last report;
        the caller asks again after waiting (a slow client's report may not have moved)."""
        if self.max_lead_s is None:
            return 0.0
        lead = self.lead(now)
        bound = self.max_lead_s
        if self._reported_s is not None:
            bound = max(bound, self.min_reported_lead_s)
        over = lead - bound
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
