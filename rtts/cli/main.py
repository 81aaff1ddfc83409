"""rtts: a self-hosted real-time streaming text-to-speech server on ChatTTS.

Commands:
  rtts serve                     run the server (WebSocket and HTTP on one port)
  rtts model make-random DIR     write a random-weight ChatTTS checkpoint (tests, benchmarks)
  rtts worker                    serve with a long-text job worker (--jobs implied)
  rtts job submit|status|cancel|download   long-text jobs from the command line
  rtts say "TEXT" -o FILE        synthesize text into an audio file (in-process or --url)
  rtts doctor [--fix]            check the install; --fix repairs the known torchaudio problem
  rtts bench ...                 load benchmarks with real clients

Every option can also be set by an environment variable (shown in each command's --help,
e.g. RTTS_PORT for `rtts serve --port`) or in a TOML file given with --config (or
RTTS_CONFIG). A flag on the command line wins over the environment, which wins over the
file, which wins over the built-in default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from rtts import __version__
from rtts.api.auth import AuthConfig
from rtts.api.native.session import SessionLimits
from rtts.cli.options import Parser
from rtts.config import EngineConfig, ServerConfig
from rtts.core.cache import CacheConfig
from rtts.core.governor import GovernorConfig
from rtts.core.scheduler import SchedulerConfig
from rtts.engines.kernels import KERNEL_CHOICES
from rtts.errors import RttsError
from rtts.jobs.model import JobsConfig, default_jobs_dir

__all__ = ["ConfigError", "build_parser", "config_from_args", "main"]

logger = logging.getLogger("rtts.cli.main")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(RttsError, ValueError):
    """A setting that cannot work, or flags that do not fit together: one clear line, exit
    status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Every parser is a :class:`rtts.cli.options.Parser`: each option
    also reads an ``RTTS_*`` variable and ``--config FILE``, and ``--help`` shows both."""
    p = Parser(prog="rtts", description=__doc__)
    p.add_argument("--version", action="version", version=f"rtts {__version__}")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="log verbosity")
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="TOML file of settings: top-level keys for these global options, a "
                        "[serve] table for `rtts serve` (keys are the flag names); also "
                        "RTTS_CONFIG. Flags and RTTS_* variables override it")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    s = sub.add_parser("serve", help="run the server (WebSocket and HTTP on one port)",
                       description="Serve the native WebSocket protocol, the HTTP API and the "
                                   "demo page on one port.")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8765, help="TCP port to listen on")
    s.add_argument("--engine", choices=["chattts", "fake", "piper"], default="chattts",
                   help="the primary engine, which speaks every voice no other engine takes. "
                        "chattts: the real model; fake: test tones, no model (the test "
                        "double); piper: piper voices (needs --voice-model)")
    s.add_argument("--voice-model", type=Path, action="append", default=[],
                   help="a piper voice model (.onnx, its .onnx.json beside it; repeatable). "
                        "With --engine piper these are the engine; beside chattts or fake "
                        "they are extra voices, named after the file (piper:NAME)")
    s.add_argument("--piper-workers", type=int, default=None,
                   help="piper segments synthesized at once (default: one per core)")
    s.add_argument("--wyoming-port", type=int, default=None,
                   help="also serve Wyoming (Home Assistant) TTS on this TCP port "
                        "(10200 by convention; default off)")
    s.add_argument("--wyoming-host", default=None,
                   help="address the Wyoming listener binds (default: --host). Wyoming has "
                        "no authentication: keep it on a trusted network")
    s.add_argument("--source", choices=["auto", "custom", "huggingface", "random"],
                   default="auto",
                   help="where the ChatTTS weights come from. auto: --model-dir if given, "
                        "else $RTTS_HOME/ChatTTS, else the Hugging Face cache, else a download "
                        "of 2Noise/ChatTTS, else the tiny random checkpoint (speaks noise); "
                        "custom: --model-dir only; huggingface: the cache, else a download; "
                        "random: the tiny random checkpoint")
    s.add_argument("--model-dir", type=Path, default=None,
                   help="a local copy of the ChatTTS weights (asset/..., sha256-checked; "
                        "default: none, see --source)")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    s.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own choice)")
    s.add_argument("--max-new-token", type=int, default=EngineConfig.max_new_token,
                   help="most GPT steps per segment (47 a second of audio)")
    s.add_argument("--dtype", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   default=EngineConfig.dtype, help="GPT weights (auto: fp32 or bf16, the "
                   "faster here; int8/int4 accuracy: docs/benchmarks/cpu-realtime.md)")
    s.add_argument("--compile", action="store_true", default=EngineConfig.compile,
                   help="ChatTTS: the GPT decode step through torch.compile (faster on a "
                        "small CPU; 2-5 minutes more to start)")
    s.add_argument("--kv-dtype", choices=["auto", "fp32", "bf16", "int8"],
                   default=EngineConfig.kv_dtype,
                   help="ChatTTS GPT keys/values (auto: timed at load)")
    s.add_argument("--kernels", default=EngineConfig.kernels,
                   choices=KERNEL_CHOICES,
                   help="GPT linear kernel (auto: the fastest measured per batch size)")
    s.add_argument("--stream-tokens", type=int, default=EngineConfig.stream_tokens,
                   help="GPT steps between partial decodes (first audio after this many)")
    s.add_argument("--decode-tokens", type=int, default=EngineConfig.decode_tokens,
                   help="after the first audio, decode every this many GPT steps")
    s.add_argument("--max-batch-size", type=int, default=SchedulerConfig.max_batch_size,
                   help="rows (slots) of a running batch")
    s.add_argument("--batching", choices=["continuous", "static"],
                   default=SchedulerConfig.batching,
                   help="continuous: requests join a running batch at its next step; "
                        "static: a batch runs to its end before the next one starts")
    s.add_argument("--first-segment-slots", type=int, default=None,
                   help="slots later segments leave free for new streams (default 3/8)")
    s.add_argument("--later-hold", type=float, default=SchedulerConfig.later_hold_s,
                   help="seconds a later segment may wait while a new stream warms up")
    s.add_argument("--degraded-slots", type=int, default=None,
                   help="while the load governor is degraded, at most this many slots "
                        "(default: all of them)")
    s.add_argument("--max-wait-ms", type=float, default=SchedulerConfig.max_wait_ms,
                   help="how long a request may wait for others to fill a static batch, ms")
    s.add_argument("--concurrency", type=int, default=SchedulerConfig.concurrency,
                   help="batches running at once on the device")
    s.add_argument("--max-queue", type=int, default=SchedulerConfig.max_queue,
                   help="segments waiting for the engine; beyond it requests are refused "
                        "(HTTP 429, `overloaded`)")
    s.add_argument("--request-timeout", type=float, default=SchedulerConfig.request_timeout_s,
                   help="seconds one segment may take before it fails with `timeout`")
    s.add_argument("--max-contexts", type=int, default=SessionLimits.max_contexts,
                   help="contexts open at once on one WebSocket connection")
    s.add_argument("--max-connections", type=int, default=ServerConfig.max_connections,
                   help="open WebSockets, all clients together (503 beyond)")
    s.add_argument("--max-connections-per-client", type=int,
                   default=ServerConfig.max_connections_per_client,
                   help="open WebSockets per client address (429 beyond; 0 = no cap)")
    s.add_argument("--trusted-proxy", action="append", default=None,
                   help="address or network of a proxy whose X-Forwarded-For names the "
                        "client (repeatable; default 127.0.0.1 and ::1)")
    s.add_argument("--idle-timeout", type=float, default=ServerConfig.idle_timeout_s,
                   help="close a WebSocket with no open context and no message for this "
                        "many seconds (close code 4000; 0 = never)")
    s.add_argument("--max-message-bytes", type=int, default=ServerConfig.max_message_bytes,
                   help="largest WebSocket message accepted (larger: close 1009)")
    s.add_argument("--max-protocol-errors", type=int, default=ServerConfig.max_protocol_errors,
                   help="protocol errors one connection may make before it is closed (1008)")
    s.add_argument("--slow-client-timeout", type=float,
                   default=ServerConfig.slow_client_timeout_s,
                   help="seconds the server waits for a client that stopped reading before "
                        "it closes the connection (4008)")
    s.add_argument("--http-read-timeout", type=float, default=ServerConfig.http_read_timeout_s,
                   help="seconds an HTTP request body may take to arrive (408 beyond)")
    s.add_argument("--http-write-timeout", type=float,
                   default=ServerConfig.http_write_timeout_s,
                   help="seconds a client may stop reading a streamed HTTP response before "
                        "it is ended")
    s.add_argument("--max-voices-per-key", type=int, default=ServerConfig.max_voices_per_key,
                   help="named voices one API key may own (403 voice_limit beyond)")
    g = GovernorConfig()
    for level in ("degrade", "reject"):
        s.add_argument(f"--{level}-queue-depth", type=int,
                       default=getattr(g, f"{level}_queue_depth") or 0,
                       help=f"load governor: {level} at this many waiting segments per 4 batch "
                            "slots (0 = ignore the queue)")
        s.add_argument(f"--{level}-rss-mb", type=float,
                       default=getattr(g, f"{level}_rss_mb") or 0,
                       help=f"load governor: {level} above this process RSS, MB (0 = ignore)")
        s.add_argument(f"--{level}-cpu-percent", type=float,
                       default=getattr(g, f"{level}_cpu_percent") or 0,
                       help=f"load governor: {level} above this machine CPU use, %% (0 = "
                            "ignore; a CPU engine is busy by design)")
        s.add_argument(f"--{level}-gpu-mem", type=float,
                       default=getattr(g, f"{level}_gpu_mem_fraction") or 0,
                       help=f"load governor: {level} above this fraction of GPU memory in use "
                            "(CUDA; 0 = ignore)")
    s.add_argument("--max-lead", type=float, default=ServerConfig.max_lead_s,
                   help="seconds of audio sent ahead of estimated playback (0 = no pacing)")
    s.add_argument("--shutdown-grace", type=float, default=ServerConfig.shutdown_grace_s,
                   help="on SIGTERM, seconds open streams and responses get to finish while "
                        "/readyz answers 503 (then 1001)")
    s.add_argument("--web-dir", type=Path, default=None,
                   help="serve the demo page and JS client from this directory (default: "
                        "the installed package's copy)")
    s.add_argument("--api-key", action="append", default=[],
                   help="require this key (repeatable; also RTTS_API_KEYS=k1,k2; default: "
                        "none, auth off)")
    s.add_argument("--admin-key", action="append", default=[],
                   help="operator key for the admin API (POST /v1/admin/drain); repeatable "
                        "(default: none, the admin API is off)")
    s.add_argument("--allowed-origin", action="append", default=[],
                   help="browser Origin allowed to connect (repeatable; default any)")
    s.add_argument("--token-ttl", type=int, default=300, help="browser token lifetime, s")
    s.add_argument("--token-secret", default=None,
                   help="secret that signs browser tokens and derives key ids (at least 32 "
                        "characters); give every replica the same one so tokens work on all "
                        "of them and across restarts (also RTTS_TOKEN_SECRET; default: "
                        "random per process)")
    s.add_argument("--previous-token-secret",
                   default=None,
                   help="during a rotation, the old secret: its tokens stay valid (set for one "
                        "--token-ttl after switching; also RTTS_PREVIOUS_TOKEN_SECRET)")
    s.add_argument("--public-listing", action="store_true",
                   help="with --api-key: the model and voice name lists (GET /v1/models, "
                        "/v1/audio/models, /v1/audio/voices; ElevenLabs' /v1/models and "
                        "/v1/voices) answer without a key, as Open WebUI asks for them")
    s.add_argument("--max-sessions-per-key", type=int, default=None,
                   help="concurrent sessions (WebSockets and streaming HTTP responses) per "
                        "key, per instance (default: no limit)")
    s.add_argument("--sessions-per-minute", type=int, default=None,
                   help="new sessions a minute per key (default: no limit)")
    s.add_argument("--cache-mb", type=float, default=CacheConfig.memory_mb,
                   help="in-process phrase cache size; 0 = off")
    s.add_argument("--cache-redis", default=None,
                   help="redis://host:port/db: phrase cache shared by instances (default: "
                        "none, in-process only)")
    s.add_argument("--cache-ttl", type=int, default=CacheConfig.redis_ttl_s,
                   help="Redis entry lifetime, s")
    s.add_argument("--instance-id", default=None,
                   help="name of this replica in ready events and /v1/info (default: "
                        "rtts- and 8 random hex digits)")
    s.add_argument("--voices-dir", type=Path, default=None,
                   help="named voices, one JSON file each; instances may share it "
                        "(default $RTTS_VOICES_DIR, else $RTTS_HOME/voices or "
                        "~/.cache/rtts/voices)")
    s.add_argument("--fake-rtf", type=float, default=0.0, help="fake engine: pace (0 = fast)")
    s.add_argument("--jobs", action="store_true",
                   help="also run a long-text job worker (needs --jobs-redis)")
    s.add_argument("--jobs-redis", default=os.environ.get("RTTS_JOBS_REDIS"),
                   help="redis://host:port/db of the job queue: enables /v1/jobs "
                        "(default $RTTS_JOBS_REDIS)")
    s.add_argument("--jobs-dir", type=Path, default=None,
                   help="segment audio of jobs, shared by API and workers "
                        "(default $RTTS_JOBS_DIR, else $RTTS_HOME/jobs)")
    s.add_argument("--jobs-concurrency", type=int, default=None,
                   help="segments a worker runs at once (default: --max-batch-size)")
    s.add_argument("--jobs-claim-idle", type=float, default=JobsConfig.claim_idle_s,
                   help="seconds before a dead worker's segment is taken over")
    s.add_argument("--jobs-rows-with-live", type=int, default=None,
                   help="job rows a batch keeps beside live rows (default: 1/4 of the slots)")
    s.add_argument("--jobs-max-upload-mb", type=float,
                   default=JobsConfig.max_upload_bytes / 2**20, help="largest job text, MiB")
    s.add_argument("--jobs-max-per-key", type=int, default=JobsConfig.max_jobs_per_key,
                   help="unfinished jobs one API key may hold (429 job_quota beyond)")
    s.add_argument("--jobs-max-without-keys", type=int,
                   default=JobsConfig.max_jobs_without_keys,
                   help="unfinished jobs of the whole server when it has no API keys")
    s.add_argument("--jobs-max-queued-chars-per-key", type=int,
                   default=JobsConfig.max_queued_chars_per_key,
                   help="characters of unfinished job text one key may hold (server-wide "
                        "without keys)")
    s.add_argument("--jobs-max-audio-gb-per-key", type=float,
                   default=JobsConfig.max_audio_bytes_per_key / 2**30,
                   help="GiB of stored job audio one key may hold (server-wide without keys)")
    s.add_argument("--jobs-max-chapters", type=int, default=JobsConfig.max_chapters,
                   help="chapter marks of one job")
    w = sub.add_parser("worker", help="serve with a job worker: the same flags as serve, "
                                      "--jobs implied")
    for action in s._actions:
        if action.dest != "help":
            w._add_action(action)
    group_options(s, SERVE_GROUPS)
    group_options(w, SERVE_GROUPS)
    s.usage = w.usage = "%(prog)s [OPTIONS]  (the options come in sections below)"

    from rtts.jobs.cli import add_job_parser

    add_job_parser(sub)

    from rtts.cli.say import add_say_parser

    add_say_parser(sub, s)

    m = sub.add_parser("model", help="model utilities",
                       description="Model utilities.")
    msub = m.add_subparsers(dest="model_command", title="commands", metavar="COMMAND")
    mk = msub.add_parser("make-random", help="write a random-weight ChatTTS checkpoint",
                         description="Write a random-weight ChatTTS checkpoint in ChatTTS's "
                                     "own layout: real ChatTTS code, noise for a voice. For "
                                     "tests and benchmarks.")
    mk.add_argument("--size", choices=["tiny", "full"], default="tiny",
                    help="tiny (~6 MB, fast on a CPU) or full (the published shapes, ~1.2 GB)")
    mk.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    mk.add_argument("dir", type=Path, metavar="DIR", help="directory to write it to")

    d = sub.add_parser("doctor", help="check the install; --fix repairs known problems",
                       description="Check that torch and ChatTTS import here and which "
                                   "weights `rtts serve` would load.")
    d.add_argument("--fix", action="store_true",
                   help="move aside torchaudio's CUDA-linked libraries when torch has no CUDA")

    from rtts.cli.drain import add_drain_parser

    add_drain_parser(sub)

    from rtts.bench.main import add_parser

    add_parser(sub)
    from rtts.bench.realtime import add_parser as add_realtime

    add_realtime(sub.choices["bench"])
    return p


# `rtts serve --help` in sections: (title, option dests); a flag in none stays under "options".
SERVE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("network", ("host", "port", "wyoming_port", "wyoming_host", "trusted_proxy", "web_dir",
                 "instance_id")),
    ("model and engines", ("engine", "voice_model", "piper_workers", "source", "model_dir",
                           "device", "threads", "max_new_token", "dtype", "compile", "kv_dtype",
                           "kernels", "stream_tokens", "decode_tokens", "voices_dir", "fake_rtf")),
    ("batching", ("max_batch_size", "batching", "first_segment_slots", "later_hold",
                  "degraded_slots", "max_wait_ms", "concurrency")),
    ("limits", ("max_queue", "request_timeout", "max_contexts", "max_connections",
                "max_connections_per_client", "idle_timeout", "max_message_bytes",
                "max_protocol_errors", "slow_client_timeout", "max_lead", "shutdown_grace",
                "http_read_timeout", "http_write_timeout")),
    ("load governor (0 = ignore)", tuple(f"{level}_{what}" for level in ("degrade", "reject")
                                        for what in ("queue_depth", "rss_mb", "cpu_percent",
                                                     "gpu_mem"))),
    ("auth and quotas", ("api_key", "allowed_origin", "token_ttl", "token_secret",
                         "previous_token_secret", "max_sessions_per_key",
                         "sessions_per_minute", "public_listing", "admin_key",
                         "max_voices_per_key")),
    ("phrase cache", ("cache_mb", "cache_redis", "cache_ttl")),
    ("long-text jobs", ("jobs", "jobs_redis", "jobs_dir", "jobs_concurrency", "jobs_claim_idle",
                        "jobs_rows_with_live", "jobs_max_upload_mb", "jobs_max_per_key",
                        "jobs_max_without_keys", "jobs_max_queued_chars_per_key",
                        "jobs_max_audio_gb_per_key", "jobs_max_chapters")),
)


def group_options(parser: argparse.ArgumentParser,
                  groups: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    """Show ``parser``'s options in sections in ``--help`` (parsing is unchanged)."""
    general = parser._optionals  # argparse's "options" section
    by_dest = {a.dest: a for a in general._group_actions}
    for title, dests in groups:
        group = parser.add_argument_group(title)
        for dest in dests:
            action = by_dest.pop(dest, None)
            if action is not None:
                general._group_actions.remove(action)
                group._group_actions.append(action)


def check_serve_args(args: argparse.Namespace) -> None:
    """Settings that parse one by one but do not fit together: :class:`ConfigError`."""
    if args.source == "custom" and args.model_dir is None:
        raise ConfigError("--source custom needs --model-dir DIR (the ChatTTS weights)")
    if args.model_dir is not None and args.source in ("huggingface", "random"):
        raise ConfigError(f"--model-dir does not go with --source {args.source}")
    for name in ("port", "max_message_bytes", "max_contexts", "max_queue", "max_batch_size",
                 "concurrency", "max_protocol_errors", "max_voices_per_key",
                 "jobs_max_per_key", "jobs_max_without_keys", "jobs_max_queued_chars_per_key",
                 "jobs_max_chapters"):
        value = getattr(args, name)
        if value < (0 if name == "port" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be "
                             f"{'0 or more' if name == 'port' else 'at least 1'}")
    for name in ("http_read_timeout", "http_write_timeout", "jobs_max_audio_gb_per_key"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be more than 0")
    if args.port > 65535:
        raise ConfigError("--port must be at most 65535")
    if any(not key.strip() for key in args.api_key):
        raise ConfigError("--api-key is empty (is the variable you gave it set?): every "
                          "request would be refused; give a key, or no --api-key for no auth")


def check_serve_paths(args: argparse.Namespace) -> None:
    """The directories ``rtts serve`` was pointed at exist (checked before start-up)."""
    if args.model_dir is not None and not args.model_dir.is_dir():
        raise ConfigError(f"--model-dir {args.model_dir}: no such directory")
    if args.web_dir is not None and not (args.web_dir / "index.html").is_file():
        raise ConfigError(f"--web-dir {args.web_dir}: no index.html there")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    check_serve_args(args)
    base = ServerConfig()
    return replace(
        base,
        host=args.host, port=args.port, wyoming_port=args.wyoming_port,
        wyoming_host=args.wyoming_host,
        max_message_bytes=args.max_message_bytes,
        max_protocol_errors=args.max_protocol_errors,
        slow_client_timeout_s=args.slow_client_timeout,
        http_read_timeout_s=args.http_read_timeout,
        http_write_timeout_s=args.http_write_timeout,
        max_voices_per_key=args.max_voices_per_key,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client or None,
        trusted_proxies=(tuple(args.trusted_proxy) if args.trusted_proxy is not None
                         else base.trusted_proxies),
        idle_timeout_s=args.idle_timeout or None,
        shutdown_grace_s=args.shutdown_grace,
        max_lead_s=args.max_lead or None,
        web_dir=args.web_dir or base.web_dir,
        engine=EngineConfig(
            name=args.engine, source=args.source, model_dir=args.model_dir,
            device=args.device, threads=args.threads, max_new_token=args.max_new_token,
            stream_tokens=args.stream_tokens, decode_tokens=args.decode_tokens,
            fake_rtf=args.fake_rtf, dtype=args.dtype, kernels=args.kernels,
            compile=args.compile, kv_dtype=args.kv_dtype,
            batch_rows=args.max_batch_size,
            voice_models=tuple(args.voice_model), piper_workers=args.piper_workers,
        ),
        scheduler=SchedulerConfig(
            max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
            concurrency=args.concurrency, max_queue=args.max_queue,
            request_timeout_s=args.request_timeout, batching=args.batching,
            degraded_slots=args.degraded_slots,
            first_segment_slots=args.first_segment_slots, later_hold_s=args.later_hold,
            background_rows_with_live=args.jobs_rows_with_live,
        ),
        limits=replace(base.limits, max_contexts=args.max_contexts),
        governor=replace(
            base.governor,
            degrade_queue_depth=args.degrade_queue_depth or None,
            reject_queue_depth=args.reject_queue_depth or None,
            degrade_rss_mb=args.degrade_rss_mb or None, reject_rss_mb=args.reject_rss_mb or None,
            degrade_cpu_percent=args.degrade_cpu_percent or None,
            reject_cpu_percent=args.reject_cpu_percent or None,
            degrade_gpu_mem_fraction=args.degrade_gpu_mem or None,
            reject_gpu_mem_fraction=args.reject_gpu_mem or None,
        ),
        instance_id=args.instance_id or base.instance_id,
        voices_dir=args.voices_dir or base.voices_dir,
        freeze_gc=True,
        cache=replace(base.cache, memory_mb=args.cache_mb, redis_url=args.cache_redis or None,
                      redis_ttl_s=args.cache_ttl),
        jobs=JobsConfig(redis_url=args.jobs_redis or None,
                        dir=args.jobs_dir or default_jobs_dir(),
                        worker=args.jobs or args.command == "worker",
                        concurrency=args.jobs_concurrency, claim_idle_s=args.jobs_claim_idle,
                        max_upload_bytes=int(args.jobs_max_upload_mb * 2**20),
                        max_jobs_per_key=args.jobs_max_per_key,
                        max_jobs_without_keys=args.jobs_max_without_keys,
                        max_queued_chars_per_key=args.jobs_max_queued_chars_per_key,
                        max_audio_bytes_per_key=int(args.jobs_max_audio_gb_per_key * 2**30),
                        max_chapters=args.jobs_max_chapters),
        auth=AuthConfig(
            api_keys=tuple(dict.fromkeys((*args.api_key, *AuthConfig.keys_from_env()))),
            token_ttl_s=args.token_ttl, allowed_origins=tuple(args.allowed_origin),
            token_secret=_secret(args.token_secret, "--token-secret"),
            previous_token_secret=_secret(args.previous_token_secret,
                                          "--previous-token-secret"),
            max_sessions_per_key=args.max_sessions_per_key,
            sessions_per_minute=args.sessions_per_minute,
            public_listing=args.public_listing,
            admin_keys=tuple(dict.fromkeys(k for k in args.admin_key if k.strip())),
        ),
    )


MIN_SECRET_CHARS = 32


def _secret(value: str | None, flag: str) -> bytes | None:
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(f"{flag} must be at least {MIN_SECRET_CHARS} characters "
                          "(e.g. `openssl rand -hex 32`)")
    return value.encode()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def safety_warnings(config: ServerConfig) -> list[str]:
    """What a production operator must hear at start-up (pure; logged by ``serve``)."""
    out = []
    if not config.auth.api_keys and not _is_loopback(config.host):
        out.append(f"listening on {config.host} with auth off: anyone who can reach this port "
                   "can synthesize; set --api-key (or RTTS_API_KEYS) and --allowed-origin")
    wyoming_host = config.wyoming_host or config.host
    if config.wyoming_port is not None and config.auth.api_keys and not _is_loopback(
            wyoming_host):
        out.append(f"the Wyoming listener on {wyoming_host}:{config.wyoming_port} has no "
                   "authentication (the protocol has none): --api-key does not protect it; "
                   "bind it with --wyoming-host 127.0.0.1 or firewall it to Home Assistant")
    if config.auth.api_keys and config.auth.token_secret is None:
        out.append("no --token-secret: browser tokens are valid only on this instance and "
                   "until it restarts; give every replica the same RTTS_TOKEN_SECRET")
    return out


def listening_line(config: ServerConfig, port: int, weights_kind: str | None) -> tuple[int, str]:
    """The log level and text of the "listening" line; with random weights it repeats that
    this is noise, and what to do (the first warning has scrolled away by then)."""
    where = config.host if ":" not in config.host else f"[{config.host}]"
    line = (f"listening on ws://{where}:{port}{config.ws_path} (demo page http://{where}:{port}/,"
            f" OpenAI-compatible base URL http://{where}:{port}/v1)")
    if weights_kind != "random":
        return logging.INFO, line
    from rtts.engines.weights import REAL_SPEECH_HINT

    return logging.WARNING, f"{line} -- RANDOM weights: this server speaks NOISE. " \
                            f"{REAL_SPEECH_HINT}"


def listen_error(exc: OSError, config: ServerConfig) -> str:
    """One line for a port that cannot be bound (in use, no such address, privileged)."""
    what = {errno.EADDRINUSE: "is already in use (another rtts, or another server? stop it "
                              "or pick another port)",
            errno.EADDRNOTAVAIL: "is not an address of this machine",
            errno.EACCES: "needs privileges (ports below 1024): pick a port above 1024"}
    text = str(exc)
    where = (f"{config.wyoming_host or config.host}:{config.wyoming_port} (--wyoming-port)"
             if config.wyoming_port is not None and f", {config.wyoming_port})" in text
             else f"{config.host}:{config.port} (--port)")
    return f"cannot listen on {where}: it {what.get(exc.errno or 0, text)}"


MALLOC_ARENAS = 2


def cap_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas at :data:`MALLOC_ARENAS` (unless ``MALLOC_ARENA_MAX`` is set:
    then glibc already took it). Each thread that allocates (the normalizer's, the engine's
    and the codecs' worker threads) otherwise gets an arena of its own, up to 8 per core,
    whose freed memory is rarely given back: under the mixed-abuse load RSS grew 15-30%
    each minute with the default and held steady at 2 (tests/test_abuse.py). True if set."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(-8, MALLOC_ARENAS))  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        return False


async def serve_until_signalled(config: ServerConfig) -> int:
    from rtts.core.service import State
    from rtts.server import bound_port, run_server

    # The engine runs on worker threads that hold the GIL between torch ops; the event
    # loop gives the GIL up at every socket send. CPython's default 5 ms switch interval
    # then makes each send wait up to 5 ms to get it back: a burst of frames stalls for
    # tens of ms. 1 ms bounds that wait (measured on the fake-engine bench).
    sys.setswitchinterval(config.gil_switch_interval_s)
    cap_malloc_arenas()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    logger.info("instance %s on host %s, pid %d", config.instance_id, socket.gethostname(),
                os.getpid())
    for warning in safety_warnings(config):
        logger.warning("%s", warning)
    async with run_server(config) as app:
        if app.state == State.FAILED:
            logger.error("not serving: %s", app.state_reason)
            return 1
        level, line = listening_line(config, bound_port(app), app.weights().get("kind"))
        logger.log(level, "%s", line)
        await stop.wait()
        logger.info("signal received: draining")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "worker"):
        if args.engine == "piper" and not args.voice_model:
            parser.error("--engine piper needs --voice-model PATH (a piper .onnx voice)")
        for path in args.voice_model:
            if not path.is_file() or not Path(f"{path}.json").is_file():
                parser.error(f"--voice-model {path}: need the .onnx file and its .onnx.json")
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # one line per connection is noise at INFO; rtts logs what matters itself
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    if args.command in ("serve", "worker"):
        try:
            config = config_from_args(args)
            check_serve_paths(args)
            if config.jobs.worker and config.jobs.redis_url is None:
                raise ConfigError("a job worker needs --jobs-redis (or RTTS_JOBS_REDIS)")
        except ConfigError as exc:
            print(f"rtts {args.command}: error: {exc} (see `rtts {args.command} --help`)",
                  file=sys.stderr)
            return 2
        try:
            return asyncio.run(serve_until_signalled(config))
        except KeyboardInterrupt:  # a second Ctrl-C during the drain
            return 130
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
                raise
            print(f"rtts {args.command}: error: {listen_error(exc, config)}", file=sys.stderr)
            return 1
    if args.command == "say":
        from rtts.cli.say import run_say

        serve_argv = ["--config", str(args.config), "serve"] if args.config else ["serve"]
        return run_say(args, parser.parse_args(serve_argv))
    if args.command == "job":
        from rtts.jobs.cli import run_job_command

        return run_job_command(args)
    if args.command == "model":
        from rtts.engines.checkpoint import make_random_checkpoint

        try:
            make_random_checkpoint(args.dir, args.size, args.seed)
        except OSError as exc:
            print(f"rtts model make-random: error: {args.dir}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
        print(f"random {args.size} checkpoint written to {args.dir}")
        return 0
    if args.command == "bench":
        from rtts.bench.main import run_bench
        from rtts.bench.realtime import run

        if args.bench_mode == "realtime":
            return run(args)
        return run_bench(args)
    if args.command == "drain":
        from rtts.cli.drain import run_drain

        return run_drain(args)
    if args.command == "doctor":
        from rtts.cli.doctor import run_doctor

        return run_doctor(fix=args.fix)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
