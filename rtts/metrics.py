"""Prometheus text exposition of the server's counters (no client library needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from .server import App

__all__ = ["render_metrics"]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render_metrics(app: App) -> str:
    s, sch = app.stats, app.scheduler
    ttfa = list(s.ttfa_s)
    lines = [
        "# TYPE rtts_up gauge", f"rtts_up{{state=\"{app.state}\"}} 1",
        "# TYPE rtts_active_connections gauge", f"rtts_active_connections {len(app.connections)}",
        "# TYPE rtts_active_contexts gauge",
        f"rtts_active_contexts {sum(len(c.session.contexts) for c in app.connections)}",
        "# TYPE rtts_connections_total counter", f"rtts_connections_total {s.connections_total}",
        "# TYPE rtts_contexts_total counter", f"rtts_contexts_total {s.contexts_total}",
        "# TYPE rtts_segments_total counter", f"rtts_segments_total {s.segments_total}",
        "# TYPE rtts_segment_errors_total counter", f"rtts_segment_errors_total {s.segment_errors}",
        "# TYPE rtts_cancels_total counter", f"rtts_cancels_total {s.cancels}",
        "# TYPE rtts_protocol_errors_total counter",
        f"rtts_protocol_errors_total {s.protocol_errors}",
        "# TYPE rtts_frames_sent_total counter", f"rtts_frames_sent_total {s.frames_sent}",
        "# TYPE rtts_audio_seconds_sent_total counter",
        f"rtts_audio_seconds_sent_total {s.audio_seconds_sent:.3f}",
        "# TYPE rtts_queue_depth gauge", f"rtts_queue_depth {sch.queue_depth}",
        "# TYPE rtts_running_batches gauge", f"rtts_running_batches {sch.running_batches}",
        "# TYPE rtts_batch_size_total counter",
        *(f"rtts_batch_size_total{{size=\"{k}\"}} {v}" for k, v in sorted(sch.batch_sizes.items())),
        "# TYPE rtts_requests_completed_total counter",
        f"rtts_requests_completed_total {sch.completed}",
        "# TYPE rtts_requests_failed_total counter", f"rtts_requests_failed_total {sch.failed}",
        "# TYPE rtts_time_to_first_audio_seconds summary",
        *(f"rtts_time_to_first_audio_seconds{{quantile=\"{q}\"}} {_quantile(ttfa, q):.4f}"
          for q in (0.5, 0.95, 0.99)),
        f"rtts_time_to_first_audio_seconds_count {len(ttfa)}",
        "# TYPE rtts_load_level gauge", f"rtts_load_level {int(app.governor.level)}",
        "# TYPE rtts_degraded gauge", f"rtts_degraded {int(app.degraded)}",
        "# TYPE rtts_governor_transitions_total counter",
        *(f"rtts_governor_transitions_total{{transition=\"{k}\"}} {v}"
          for k, v in sorted(app.governor.transitions.items())),
        "# TYPE rtts_rejected_total counter", f"rtts_rejected_total {s.rejected}",
        "# TYPE rtts_process_rss_bytes gauge",
        f"rtts_process_rss_bytes {psutil.Process().memory_info().rss}",
    ]
    return "\n".join(lines) + "\n"
