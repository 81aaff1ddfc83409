"""Command line: ``rtts serve``, ``rtts worker``, ``rtts job``, ``rtts model make-random``,
``rtts doctor``, ``rtts bench``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from .auth import AuthConfig
from .cache import CacheConfig
from .config import EngineConfig, ServerConfig
from .jobs.model import JobsConfig, default_jobs_dir
from .scheduler import SchedulerConfig
from .session import SessionLimits

__all__ = ["build_parser", "config_from_args", "main"]

logger = logging.getLogger("rtts.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtts", description=__doc__)
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the server (WebSocket and HTTP on one port)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--engine", choices=["chattts", "fake"], default="chattts")
    s.add_argument("--source", choices=["auto", "custom", "huggingface"], default="auto",
                   help="auto: --model-dir if given, else the embedded tiny random checkpoint")
    s.add_argument("--model-dir", type=Path, default=None)
    s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    s.add_argument("--max-new-token", type=int, default=EngineConfig.max_new_token)
    s.add_argument("--dtype", choices=["fp32", "bf16", "int8"], default=EngineConfig.dtype,
                   help="GPT weight precision (int8: weight-only, see README for accuracy)")
    s.add_argument("--kernels", default=EngineConfig.kernels,
                   choices=["auto", "linear", "transposed", "bf16", "int8", "int8dyn"],
                   help="GPT linear kernel: auto measures each path at load and keeps "
                        "the fastest per batch size")
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
                   help="while the load governor is degraded, at most this many slots")
    s.add_argument("--max-wait-ms", type=float, default=SchedulerConfig.max_wait_ms)
    s.add_argument("--concurrency", type=int, default=SchedulerConfig.concurrency,
                   help="batches running at once on the device")
    s.add_argument("--max-queue", type=int, default=SchedulerConfig.max_queue)
    s.add_argument("--request-timeout", type=float, default=SchedulerConfig.request_timeout_s)
    s.add_argument("--max-contexts", type=int, default=SessionLimits.max_contexts)
    s.add_argument("--max-message-bytes", type=int, default=ServerConfig.max_message_bytes)
    s.add_argument("--max-lead", type=float, default=ServerConfig.max_lead_s,
                   help="seconds of audio sent ahead of estimated playback (0 = no pacing)")
    s.add_argument("--shutdown-grace", type=float, default=ServerConfig.shutdown_grace_s)
    s.add_argument("--web-dir", type=Path, default=None)
    s.add_argument("--api-key", action="append", default=[],
                   help="require this key (repeatable; also RTTS_API_KEYS=k1,k2)")
    s.add_argument("--allowed-origin", action="append", default=[],
                   help="browser Origin allowed to connect (repeatable; default any)")
    s.add_argument("--token-ttl", type=int, default=300, help="browser token lifetime, s")
    s.add_argument("--max-sessions-per-key", type=int, default=None)
    s.add_argument("--sessions-per-minute", type=int, default=None,
                   help="new sessions a minute per key")
    s.add_argument("--cache-mb", type=float, default=CacheConfig.memory_mb,
                   help="in-process phrase cache size; 0 = off")
    s.add_argument("--cache-redis", default=os.environ.get("RTTS_CACHE_REDIS"),
                   help="redis://host:port/db: phrase cache shared by instances")
    s.add_argument("--cache-ttl", type=int, default=CacheConfig.redis_ttl_s,
                   help="Redis entry lifetime, s")
    s.add_argument("--instance-id", default=None,
                   help="name of this replica in ready events and /v1/info")
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
    w = sub.add_parser("worker", help="serve with a job worker: the same flags as serve, "
                                      "--jobs implied")
    for action in s._actions:
        if action.dest != "help":
            w._add_action(action)

    from .jobs.cli import add_job_parser

    add_job_parser(sub)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    mk = msub.add_parser("make-random", help="write a random-weight ChatTTS checkpoint")
    mk.add_argument("--size", choices=["tiny", "full"], default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("dir", type=Path)

    d = sub.add_parser("doctor", help="check the install; --fix repairs known problems")
    d.add_argument("--fix", action="store_true")

    from .bench import add_parser

    add_parser(sub)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    base = ServerConfig()
    return replace(
        base,
        host=args.host, port=args.port,
        max_message_bytes=args.max_message_bytes,
        shutdown_grace_s=args.shutdown_grace,
        max_lead_s=args.max_lead or None,
        web_dir=args.web_dir or base.web_dir,
        engine=EngineConfig(
            name=args.engine, source=args.source, model_dir=args.model_dir,
            device=args.device, threads=args.threads, max_new_token=args.max_new_token,
            stream_tokens=args.stream_tokens, decode_tokens=args.decode_tokens,
            fake_rtf=args.fake_rtf, dtype=args.dtype, kernels=args.kernels,
            batch_rows=args.max_batch_size,
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
        instance_id=args.instance_id or base.instance_id,
        voices_dir=args.voices_dir or base.voices_dir,
        freeze_gc=True,
        cache=replace(base.cache, memory_mb=args.cache_mb, redis_url=args.cache_redis or None,
                      redis_ttl_s=args.cache_ttl),
        jobs=JobsConfig(redis_url=args.jobs_redis or None,
                        dir=args.jobs_dir or default_jobs_dir(),
                        worker=args.jobs or args.command == "worker",
                        concurrency=args.jobs_concurrency, claim_idle_s=args.jobs_claim_idle,
                        max_upload_bytes=int(args.jobs_max_upload_mb * 2**20)),
        auth=AuthConfig(
            api_keys=tuple(args.api_key) + AuthConfig.keys_from_env(),
            token_ttl_s=args.token_ttl, allowed_origins=tuple(args.allowed_origin),
            max_sessions_per_key=args.max_sessions_per_key,
            sessions_per_minute=args.sessions_per_minute,
        ),
    )


async def serve_until_signalled(config: ServerConfig) -> int:
    from .server import run_server

    # The engine runs on worker threads that hold the GIL between torch ops; the event
    # loop gives the GIL up at every socket send. CPython's default 5 ms switch interval
    # then makes each send wait up to 5 ms to get it back: a burst of frames stalls for
    # tens of ms. 1 ms bounds that wait (measured on the fake-engine bench).
    sys.setswitchinterval(config.gil_switch_interval_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with run_server(config) as app:
        if app.state == "failed":
            logger.error("not serving: %s", app.state_reason)
            return 1
        logger.info("listening on ws://%s:%d%s (demo page http://%s:%d/, OpenAI-compatible "
                    "base URL http://%s:%d/v1)", config.host, config.port, config.ws_path,
                    config.host, config.port, config.host, config.port)
        await stop.wait()
        logger.info("signal received: draining")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # one line per connection is noise at INFO; rtts logs what matters itself
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    if args.command in ("serve", "worker"):
        config = config_from_args(args)
        if config.jobs.worker and config.jobs.redis_url is None:
            print("a job worker needs --jobs-redis (or RTTS_JOBS_REDIS)", file=sys.stderr)
            return 2
        return asyncio.run(serve_until_signalled(config))
    if args.command == "job":
        from .jobs.cli import run_job_command

        return run_job_command(args)
    if args.command == "model":
        from .engines.checkpoint import make_random_checkpoint

        make_random_checkpoint(args.dir, args.size, args.seed)
        print(f"random {args.size} checkpoint written to {args.dir}")
        return 0
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(fix=args.fix)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
