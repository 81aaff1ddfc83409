"""Server configuration: one frozen dataclass tree, filled from CLI flags or code."""

from __future__ import annotations

import importlib.resources
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from rtts.api.auth import AuthConfig
from rtts.api.native.session import SessionLimits
from rtts.core.cache import CacheConfig
from rtts.core.governor import GovernorConfig
from rtts.core.scheduler import SchedulerConfig
from rtts.core.voices import default_voices_dir
from rtts.jobs.model import JobsConfig

__all__ = ["EngineConfig", "ServerConfig", "default_home", "default_model_dir",
           "packaged_web_dir"]


def default_home() -> Path:
    """rtts's own directory: ``$RTTS_HOME``, else ``$XDG_CACHE_HOME/rtts``, else
    ``~/.cache/rtts`` (the random checkpoint, ``ChatTTS/`` weights, ``voices/``)."""
    base = os.environ.get("RTTS_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rtts")
    return Path(base)


def default_model_dir() -> Path:
    """Where the embedded default (tiny random-weight) checkpoint is generated."""
    return default_home() / "random-tiny"


@dataclass(frozen=True)
class EngineConfig:
    """Which engine, and where its weights come from.

    ``name="chattts"`` with ``model_dir=None`` and ``source="auto"`` takes the real
    weights from ``$RTTS_HOME/ChatTTS``, else the Hugging Face cache, else a download, and
    only if all fail the embedded default, a tiny random-weight checkpoint generated under
    :func:`default_model_dir` (it speaks noise; logged as such): see
    :mod:`rtts.engines.weights`. ``source="huggingface"``: the cache or a download, no
    fallback; ``model_dir`` with ``source="custom"``: a local copy; ``source="random"``:
    the random checkpoint.
    """

    name: str = "chattts"
    source: str = "auto"  # auto | custom | huggingface | random
    model_dir: Path | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # torch intra-op threads; None = all cores
    max_new_token: int = 384  # GPT steps per segment (~8 s of audio)
    stream_tokens: int = 8  # GPT steps before the first partial decode (first audio)
    decode_tokens: int = 24  # then decode once this many new tokens are ready
    decode_context: int = 16  # tokens of left context when decoding a window
    decode_lookahead: int = 4  # tokens held back until their right context exists
    default_voice_seed: int = 2
    # the GPT decode step through torch.compile (gpt_loop.CompiledDecode; compiled at
    # warm-up, about a minute per graph on 2 cores)
    compile: bool = False
    # GPT linear weights: auto (fp32/bf16, fastest measured) | fp32 | bf16 | int8 | int4
    dtype: str = "auto"
    kernels: str = "auto"  # auto: measure at load; or force one path (see engines/kernels.py)
    # the GPT's keys/values: auto (measured at load) | fp32 | bf16 | int8 (engines/kernels.py)
    kv_dtype: str = "auto"
    batch_rows: int = 8  # most rows a batch can have (the scheduler's slots): kernels timed 1..
    fixed_tokens: int | None = None  # benchmarks: every segment exactly this many GPT steps
    # benchmarks: every segment exactly ceil(this x its characters) GPT steps (at least 8):
    # lengths like speech's (ChatTTS says ~14 characters of English a second, 3.3 steps
    # a character), so a short first segment makes a short anchor as it would for real
    fixed_tokens_per_char: float | None = None
    fake_rtf: float = 0.0  # fake engine only
    fake_first_chunk_ms: float = 0.0  # fake engine only
    # piper voice models (.onnx, config beside it): with name="piper" they are the engine;
    # beside another engine they are its piper voices (rtts.engines.piper)
    voice_models: tuple[Path, ...] = ()
    piper_workers: int | None = None  # piper segments synthesized at once; None = cores


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    ws_path: str = "/v1/stream"
    wyoming_host: str | None = None  # None: the same address as ``host``
    wyoming_port: int | None = None  # the Wyoming (Home Assistant) TCP listener; None = off
    web_dir: Path | None = field(default_factory=lambda: _web_dir())
    max_message_bytes: int = 256 * 1024
    max_connections: int = 2000  # open WebSockets, all clients together (503 beyond)
    # open WebSockets of one client address (429 beyond); None = no cap
    max_connections_per_client: int | None = 256
    # proxies whose X-Forwarded-For names the client (addresses or networks; "*" = any)
    trusted_proxies: tuple[str, ...] = ("127.0.0.1", "::1")
    # a WebSocket with no open context and no message for this long is closed (4000)
    idle_timeout_s: float | None = 300.0
    max_protocol_errors: int = 20
    send_queue_frames: int = 64  # per connection; beyond it the sender waits (pacing)
    slow_client_timeout_s: float = 10.0  # waiting that long for queue space closes 4008
    # an HTTP response body the client stops reading for this long is ended (and its key's
    # session released); a request body that stops arriving for this long is a 408
    http_write_timeout_s: float = 60.0
    http_read_timeout_s: float = 30.0
    frame_ms: int = 100  # audio per binary frame, at most
    lookahead_segments: int = 2  # segments of one context submitted ahead of playback
    max_lead_s: float | None = 2.0  # audio sent ahead of estimated playback; None = no pacing
    shutdown_grace_s: float = 10.0
    close_timeout_s: float = 2.0  # wait this long for the client's close frame, then drop
    ping_interval_s: float | None = 20.0
    gil_switch_interval_s: float = 0.001  # `rtts serve` sets sys.setswitchinterval to this
    freeze_gc: bool = False  # after loading, gc.freeze() what exists (`rtts serve` sets it)
    instance_id: str = field(default_factory=lambda: _instance_id())
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: SessionLimits = field(default_factory=SessionLimits)
    governor: GovernorConfig = field(default_factory=GovernorConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # named voices (rtts.core.voices): a directory instances may share; None = built-ins only
    voices_dir: Path | None = field(default_factory=default_voices_dir)
    max_voices_per_key: int = 100  # named voices one API key may own
    # long-text jobs (rtts.jobs): the API when jobs.redis_url is set, a worker with jobs.worker
    jobs: JobsConfig = field(default_factory=JobsConfig)


def _instance_id() -> str:
    """Names this process in ``ready`` events and ``/v1/info`` (which replica served): the
    operator's ``RTTS_INSTANCE_ID``, else a random id (the host name and PID are logged at
    start-up, not shown to unauthenticated clients)."""
    return os.environ.get("RTTS_INSTANCE_ID") or f"rtts-{secrets.token_hex(4)}"


def packaged_web_dir() -> Path | None:
    """The demo page and JS client installed with the package (``rtts/web`` in the wheel,
    mapped there from the repository's web/ by setup.py); None when not installed so."""
    web = importlib.resources.files("rtts").joinpath("web")
    if isinstance(web, Path) and (web / "index.html").is_file():
        return web
    return None


def _web_dir() -> Path | None:
    """The browser assets ``rtts serve`` serves unless ``--web-dir`` says otherwise: the
    installed package's copy, else web/ beside the source tree (a checkout, editable install)."""
    packaged = packaged_web_dir()
    if packaged is not None:
        return packaged
    source = Path(__file__).resolve().parent.parent / "web"
    return source if (source / "index.html").is_file() else None
