"""Prometheus text exposition of the server's counters (no client library needed)."""

from __future__ import annotations

from collections import Counter

import psutil

from rtts.core.service import Service

__all__ = ["render_metrics"]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _histogram(name: str, counts: Counter[int], bounds: tuple[int, ...]) -> list[str]:
    lines, cumulative = [], 0
    for bound in bounds:
        cumulative = sum(v for k, v in counts.items() if k <= bound)
        lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
    total = sum(counts.values())
    lines.append(f'{name}_bucket{{le="+Inf"}} {total}')
    lines.append(f"{name}_sum {sum(k * v for k, v in counts.items())}")
    lines.append(f"{name}_count {total}")
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _weights_info(weights: dict[str, str]) -> str:
    labels = ",".join(f'{k}="{_label(weights.get(k, ""))}"'
                      for k in ("kind", "source", "identity"))
    return f"rtts_weights_info{{{labels}}} 1"


def _number(value: float) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _per_engine(service: Service) -> list[str]:
    """Every engine's scheduler and its contexts' time to first audio and audio seconds
    (``engine`` label; the unlabelled series above are the totals, or the primary's)."""
    s = service.stats
    names = list(service.engines)
    lines = ["# HELP rtts_engine_time_to_first_audio_seconds per engine, every protocol",
             "# TYPE rtts_engine_time_to_first_audio_seconds summary"]
    for name in names:
        values = list(s.ttfa_by_engine.get(name, ()))
        lines += [f'rtts_engine_time_to_first_audio_seconds{{engine="{name}",quantile="{q}"}} '
                  f"{_quantile(values, q):.4f}" for q in (0.5, 0.95, 0.99)]
        lines.append(f'rtts_engine_time_to_first_audio_seconds_count{{engine="{name}"}} '
                     f"{s.ttfa_count_by_engine[name]}")
    lines.append("# TYPE rtts_engine_audio_seconds_sent_total counter")
    lines += [f'rtts_engine_audio_seconds_sent_total{{engine="{n}"}} '
              f"{s.audio_seconds_by_engine.get(n, 0.0):.3f}" for n in names]
    for metric, kind, attr in (
            ("queue_depth", "gauge", "queue_depth"),
            ("running_batches", "gauge", "running_batches"),
            ("requests_completed_total", "counter", "completed"),
            ("requests_failed_total", "counter", "failed"),
            ("busy_seconds_total", "counter", "busy_s")):
        lines.append(f"# TYPE rtts_engine_{metric} {kind}")
        lines += [f'rtts_engine_{metric}{{engine="{n}"}} '
                  f"{_number(getattr(service.schedulers[n], attr))}" for n in names]
    lines.append("# TYPE rtts_engine_audio_seconds_generated_total counter")
    lines += [f'rtts_engine_audio_seconds_generated_total{{engine="{n}"}} '
              f"{service.schedulers[n].audio_samples / service.engines[n].sample_rate:.3f}"
              for n in names]
    return lines


def _jobs(counters: dict[str, float]) -> list[str]:
    """The job worker's segments by outcome, audio seconds stored and segments running."""
    if not counters:
        return []
    return [
        "# HELP rtts_job_segments_total job segments by outcome (stored, repeated: another "
        "worker had it, preempted: gave its slot to a live stream, skipped, failed)",
        "# TYPE rtts_job_segments_total counter",
        *(f'rtts_job_segments_total{{outcome="{k}"}} {int(counters[k])}'
          for k in ("stored", "repeated", "preempted", "skipped", "failed")),
        "# TYPE rtts_job_audio_seconds_total counter",
        f"rtts_job_audio_seconds_total {counters['audio_seconds']:.3f}",
        "# TYPE rtts_job_segments_running gauge",
        f"rtts_job_segments_running {int(counters['running'])}"]


def _capacity(app: Service) -> list[str]:
    """The streams the primary engine keeps in real time, measured from its steps as they
    run (ChatTTS on a CPU), and the headroom left: none for an engine that does not say."""
    kernels = app.engine.info.kernels or {}
    cap = kernels.get("realtime_streams")
    if cap is None:
        return []
    return ["# HELP rtts_realtime_capacity_streams streams the engine keeps in real time "
            "(measured from its decode steps)",
            "# TYPE rtts_realtime_capacity_streams gauge",
            f"rtts_realtime_capacity_streams {int(cap)}",
            "# HELP rtts_realtime_headroom_streams the capacity minus the contexts open now",
            "# TYPE rtts_realtime_headroom_streams gauge",
            f"rtts_realtime_headroom_streams {int(cap) - app.active_contexts()}"]


def _autoscaling(app: Service) -> list[str]:
    """The one gauge to scale on, for every engine: the streams speaking now over the
    instance's capacity (:meth:`Service.capacity`: measured real-time streams where the
    engine measures them, else its slots), and the parts of it."""
    capacity, source = app.capacity()
    speaking = app.speaking
    return ["# HELP rtts_capacity_streams streams this instance can speak at once "
            "(measured real-time streams, else the engines' slots; see rtts_capacity_info)",
            "# TYPE rtts_capacity_streams gauge", f"rtts_capacity_streams {capacity}",
            "# TYPE rtts_capacity_info gauge", f'rtts_capacity_info{{source="{source}"}} 1',
            "# HELP rtts_streams_speaking live contexts speaking now, every protocol",
            "# TYPE rtts_streams_speaking gauge", f"rtts_streams_speaking {speaking}",
            "# HELP rtts_capacity_free_streams capacity minus the streams speaking (>= 0)",
            "# TYPE rtts_capacity_free_streams gauge",
            f"rtts_capacity_free_streams {max(0, capacity - speaking)}",
            "# HELP rtts_capacity_utilization streams speaking / capacity: the autoscaling "
            "target (1.0 = full)",
            "# TYPE rtts_capacity_utilization gauge",
            f"rtts_capacity_utilization {speaking / max(1, capacity):.4f}"]


def _usage(app: Service) -> list[str]:
    """Per key (the key's owner id; ``anonymous`` with no keys): this instance's counts."""
    totals = sorted(app.usage.totals.items())
    lines = []
    for metric, attr, fmt in (("characters", "characters", "{}"),
                              ("audio_seconds", "audio_seconds", "{:.3f}"),
                              ("contexts", "contexts", "{}")):
        lines.append(f"# TYPE rtts_usage_{metric}_total counter")
        lines += [f'rtts_usage_{metric}_total{{key="{_label(name)}"}} '
                  + fmt.format(getattr(u, attr)) for name, u in totals]
    return ["# HELP rtts_usage_characters_total characters queued for synthesis, per key",
            *lines]


def render_metrics(app: Service) -> str:
    s, sch, cs = app.stats, app.scheduler, app.cache.stats
    ttfa = s.ttfa_s.values()
    lat = s.frame_latency_s.values()
    audio_gen = sch.audio_samples / app.engine.sample_rate
    lines = [
        "# TYPE rtts_up gauge", f"rtts_up{{state=\"{str(app.state)}\"}} 1",
        "# HELP rtts_weights_info the weights being served (kind: real, random, none)",
        "# TYPE rtts_weights_info gauge", _weights_info(app.weights()),
        "# HELP rtts_active_connections open client connections, every protocol",
        "# TYPE rtts_active_connections gauge",
        f"rtts_active_connections {app.active_connections()}",
        "# TYPE rtts_active_connections_by_protocol gauge",
        *(f"rtts_active_connections_by_protocol{{protocol=\"{name}\"}} {n}"
          for name, n in app.connections_by_protocol().items()),
        "# TYPE rtts_active_contexts gauge",
        f"rtts_active_contexts {app.active_contexts()}",
        "# TYPE rtts_active_http_requests gauge",
        f"rtts_active_http_requests {app.active_http_requests()}",
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
        "# HELP rtts_batch_joins_total requests that joined a batch already running",
        "# TYPE rtts_batch_joins_total counter", f"rtts_batch_joins_total {sch.joined}",
        "# TYPE rtts_batch_size histogram",
        *_histogram("rtts_batch_size", sch.batch_sizes, (1, 2, 4, 8, 16, 32, 64)),
        "# TYPE rtts_requests_completed_total counter",
        f"rtts_requests_completed_total {sch.completed}",
        "# TYPE rtts_requests_failed_total counter", f"rtts_requests_failed_total {sch.failed}",
        "# TYPE rtts_engine_busy_seconds_total counter",
        f"rtts_engine_busy_seconds_total {sch.busy_s:.3f}",
        "# TYPE rtts_audio_seconds_generated_total counter",
        f"rtts_audio_seconds_generated_total {audio_gen:.3f}",
        "# TYPE rtts_real_time_factor gauge",
        f"rtts_real_time_factor {sch.busy_s / audio_gen if audio_gen else 0.0:.4f}",
        "# TYPE rtts_time_to_first_audio_seconds summary",
        *(f"rtts_time_to_first_audio_seconds{{quantile=\"{q}\"}} {_quantile(ttfa, q):.4f}"
          for q in (0.5, 0.95, 0.99)),
        f"rtts_time_to_first_audio_seconds_count {s.ttfa_count}",
        *_per_engine(app),
        *_capacity(app),
        *_autoscaling(app),
        *_usage(app),
        "# TYPE rtts_load_level gauge", f"rtts_load_level {int(app.governor.level)}",
        "# TYPE rtts_degraded gauge", f"rtts_degraded {int(app.degraded)}",
        "# TYPE rtts_governor_transitions_total counter",
        *(f"rtts_governor_transitions_total{{transition=\"{k}\"}} {v}"
          for k, v in sorted(app.governor.transitions.items())),
        "# TYPE rtts_rejected_total counter", f"rtts_rejected_total {s.rejected}",
        "# TYPE rtts_auth_rejected_total counter",
        *(f'rtts_auth_rejected_total{{reason="{r}"}} {s.auth_rejected_by[r]}'
          for r in ("unauthorized", "forbidden_origin", "quota", "client_connections")),
        "# TYPE rtts_idle_closed_total counter", f"rtts_idle_closed_total {s.idle_closed}",
        "# TYPE rtts_http_speech_requests_total counter",
        f"rtts_http_speech_requests_total {s.http_requests}",
        "# TYPE rtts_frame_latency_seconds summary",
        *(f"rtts_frame_latency_seconds{{quantile=\"{q}\"}} {_quantile(lat, q):.5f}"
          for q in (0.5, 0.95, 0.99)),
        f"rtts_frame_latency_seconds_count {len(lat)}",
        "# TYPE rtts_cache_hits_total counter",
        f'rtts_cache_hits_total{{tier="memory"}} {cs.hits_memory}',
        f'rtts_cache_hits_total{{tier="redis"}} {cs.hits_redis}',
        "# TYPE rtts_cache_misses_total counter", f"rtts_cache_misses_total {cs.misses}",
        "# TYPE rtts_cache_stores_total counter", f"rtts_cache_stores_total {cs.stores}",
        "# TYPE rtts_cache_errors_total counter", f"rtts_cache_errors_total {cs.errors}",
        "# TYPE rtts_cache_dropped_writes_total counter",
        f"rtts_cache_dropped_writes_total {cs.dropped_writes}",
        "# TYPE rtts_cache_memory_bytes gauge", f"rtts_cache_memory_bytes {app.cache.memory.bytes}",
        "# TYPE rtts_cache_memory_entries gauge",
        f"rtts_cache_memory_entries {len(app.cache.memory)}",
        *_jobs(app.job_counters()),
        "# TYPE rtts_process_rss_bytes gauge",
        f"rtts_process_rss_bytes {psutil.Process().memory_info().rss}",
    ]
    return "\n".join(lines) + "\n"
