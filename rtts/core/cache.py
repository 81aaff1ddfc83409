"""Phrase-level audio cache: a segment's audio, keyed on what determines it.

Two tiers: an in-process LRU bounded in bytes (always, unless sized 0), and Redis when
``redis_url`` is set, shared by every instance behind a load balancer. A lookup tries
memory, then Redis (with a short timeout); a finished, uncancelled segment is stored
in both. Redis is best-effort: an error or a slow answer counts as a miss, is counted
in ``rtts_cache_errors_total``, and Redis is skipped for ``redis_backoff_s`` after it,
so a dead Redis never adds latency to every segment. Writes to Redis go through one
bounded queue and one owned task; when the queue is full the write is dropped.

The key (:func:`cache_key`) hashes the engine identity (model, sample rate), the
normalized segment text, the voice, every sampling param including ``seed``, and
whether the server was degraded. Stored audio is PCM16 at the engine sample rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import struct
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from rtts.core.params import SpeakerSample, SynthParams

__all__ = ["CacheConfig", "CachedStream", "LruAudio", "PhraseCache", "cache_key", "decode_audio",
           "encode_audio", "normalize_text"]

logger = logging.getLogger("rtts.core.cache")

_FORMAT = 1  # bump when the key recipe or the stored encoding changes
_HEADER = struct.Struct("<4sBI")  # magic, format, sample rate
_MAGIC = b"RTTS"
_MAX_SAMPLES = 2048  # codes kept for cached segments (a few KiB each)
_CODES = ".codes"  # the Redis key of a cached segment's codes: its audio's key + this
_SAMPLE_HEADER = struct.Struct("<4sBI")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class CacheConfig:
    memory_mb: float = 64.0  # in-process LRU budget; 0 turns the cache off
    max_entry_s: float = 20.0  # longer segments are not stored
    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0
    redis_ttl_s: int = 7 * 24 * 3600
    redis_timeout_s: float = 0.05  # a lookup slower than this is a miss
    redis_backoff_s: float = 5.0  # after a Redis error, skip Redis this long
    redis_write_queue: int = 256
    key_prefix: str = "rtts:phrase:"

    @property
    def enabled(self) -> bool:
        return self.memory_mb > 0 or self.redis_url is not None


# -- pure parts --------------------------------------------------------------------------

def normalize_text(text: str) -> str:
    """NFKC, whitespace runs collapsed to one space, trimmed. Case and punctuation stay:
    both change prosody."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def cache_key(engine_id: str, text: str, params: SynthParams, degraded: bool) -> str:
    """Hex digest naming the audio of ``text`` spoken with ``params`` by ``engine_id``."""
    recipe = orjson.dumps({
        "f": _FORMAT, "e": engine_id, "t": normalize_text(text), "v": params.voice,
        "s": params.seed, "T": params.temperature, "P": params.top_P, "K": params.top_K,
        "sp": params.speed, "r": params.refine, "d": degraded,
        # recipes before these keys existed hash as before (their defaults are left out)
        **({"rp": params.repetition_penalty} if params.repetition_penalty != 1.05 else {}),
        **({"rf": params.refine_prompt} if params.refine_prompt else {}),
        **({"smp": params.sample.digest} if params.sample is not None else {}),
    }, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(recipe).hexdigest()


def encode_audio(samples: npt.NDArray[np.float32], sample_rate: int) -> bytes:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    return _HEADER.pack(_MAGIC, _FORMAT, sample_rate) + pcm.tobytes()


def encode_sample(sample: SpeakerSample) -> bytes:
    text = sample.text.encode()
    return _SAMPLE_HEADER.pack(b"RSMP", sample.num_vq, len(text)) + text + sample.codes


def decode_sample(blob: bytes) -> SpeakerSample | None:
    """A sample from :func:`encode_sample`, or None if the blob is not one."""
    if len(blob) < _SAMPLE_HEADER.size:
        return None
    magic, vq, n = _SAMPLE_HEADER.unpack_from(blob)
    codes = blob[_SAMPLE_HEADER.size + n:]
    if magic != b"RSMP" or not vq or len(codes) % (2 * vq) or not codes:
        return None
    try:
        text = blob[_SAMPLE_HEADER.size:_SAMPLE_HEADER.size + n].decode()
    except UnicodeDecodeError:
        return None
    return SpeakerSample(bytes(codes), text, vq)


def decode_audio(blob: bytes, sample_rate: int) -> npt.NDArray[np.float32] | None:
    """Samples from :func:`encode_audio`, or None if the blob is foreign or for another rate."""
    if len(blob) < _HEADER.size or (len(blob) - _HEADER.size) % 2:
        return None
    magic, fmt, rate = _HEADER.unpack_from(blob)
    if magic != _MAGIC or fmt != _FORMAT or rate != sample_rate:
        return None
    pcm = np.frombuffer(blob, dtype="<i2", offset=_HEADER.size)
    return (pcm.astype(np.float32) / 32767.0)


class LruAudio:
    """Byte-bounded LRU of encoded audio blobs. Pure; not thread-safe (event loop only)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> bytes | None:
        blob = self._items.get(key)
        if blob is not None:
            self._items.move_to_end(key)
        return blob

    def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old)
        self._items[key] = blob
        self.bytes += len(blob)
        while self.bytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.bytes -= len(evicted)


# -- the cache, with its Redis I/O ---------------------------------------------------------

@dataclass
class CacheStats:
    hits_memory: int = 0
    hits_redis: int = 0
    misses: int = 0
    stores: int = 0
    errors: int = 0
    dropped_writes: int = 0


class PhraseCache:
    """``await get(key)`` / ``put(key, samples)`` from the event loop; ``start``/``close``."""

    def __init__(self, config: CacheConfig, engine_id: str, sample_rate: int) -> None:
        self.config = config
        self.engine_id = engine_id
        self.sample_rate = sample_rate
        self.memory = LruAudio(int(config.memory_mb * 2**20))
        # the codes of cached segments (this instance's memory only): a context whose first
        # segment is a hit anchors its later ones on the codes of that very audio
        self._samples: OrderedDict[str, SpeakerSample] = OrderedDict()
        self.stats = CacheStats()
        self._redis: Any = None
        self._redis_down_until = 0.0
        self._writes: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(
            maxsize=config.redis_write_queue)
        self._writer: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def max_entry_samples(self) -> int:
        return int(self.config.max_entry_s * self.sample_rate)

    def key(self, text: str, params: SynthParams, degraded: bool) -> str | None:
        """The cache key for this segment, or None when the cache is off."""
        return cache_key(self.engine_id, text, params, degraded) if self.enabled else None

    async def start(self) -> None:
        if self.config.redis_url is None:
            return
        import redis.asyncio as aioredis  # optional dependency: pip install 'rtts[redis]'

        t = self.config.redis_timeout_s
        self._redis = aioredis.Redis.from_url(
            self.config.redis_url, socket_timeout=max(t, 0.5), socket_connect_timeout=1.0)
        try:
            await asyncio.wait_for(self._redis.ping(), timeout=2.0)
            logger.info("phrase cache: Redis at %s", _redact(self.config.redis_url))
        except Exception as exc:  # serve anyway; lookups retry after the backoff
            self._redis_failed(exc)
        self._writer = asyncio.create_task(self._write_loop(), name="rtts-cache-writer")

    async def close(self) -> None:
        if self._writer is not None:
            # Give queued writes a moment, then stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._writes.join()
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            self._redis = None

    def _redis_up(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_down_until

    def _redis_failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        self._redis_down_until = time.monotonic() + self.config.redis_backoff_s
        logger.warning("phrase cache: Redis unavailable (%s: %s); skipping it for %.0fs",
                       type(exc).__name__, exc, self.config.redis_backoff_s)

    async def get(self, key: str) -> npt.NDArray[np.float32] | None:
        blob = self.memory.get(key)
        if blob is not None:
            self.stats.hits_memory += 1
            return decode_audio(blob, self.sample_rate)
        if self._redis_up():
            codes: bytes | None = None
            try:
                async with asyncio.timeout(self.config.redis_timeout_s):
                    name = self.config.key_prefix + key
                    blob, codes = await self._redis.mget([name, name + _CODES])
            except Exception as exc:
                self._redis_failed(exc)
                blob = None
            if blob is not None:
                samples = decode_audio(blob, self.sample_rate)
                if samples is not None:
                    self.stats.hits_redis += 1
                    self.memory.put(key, blob)
                    sample = None if codes is None else decode_sample(codes)
                    if sample is not None:
                        self.put_sample(key, sample)
                    return samples
        self.stats.misses += 1
        return None

    def put_sample(self, key: str, sample: SpeakerSample) -> None:
        """The codes of the audio just stored under ``key`` (kept beside it, in Redis too)."""
        if self._redis is not None:
            with contextlib.suppress(asyncio.QueueFull):
                self._writes.put_nowait((key + _CODES, encode_sample(sample)))
        self._samples[key] = sample
        self._samples.move_to_end(key)
        while len(self._samples) > _MAX_SAMPLES:
            self._samples.popitem(last=False)

    def sample(self, key: str) -> SpeakerSample | None:
        """The codes of the audio cached under ``key``, when this instance made it."""
        return self._samples.get(key)

    def put(self, key: str, samples: npt.NDArray[np.float32]) -> None:
        if len(samples) == 0 or len(samples) > self.max_entry_samples:
            return
        blob = encode_audio(samples, self.sample_rate)
        self.memory.put(key, blob)
        self.stats.stores += 1
        if self._redis is not None:
            try:
                self._writes.put_nowait((key, blob))
            except asyncio.QueueFull:
                self.stats.dropped_writes += 1

    async def _write_loop(self) -> None:
        while True:
            key, blob = await self._writes.get()
            try:
                if self._redis_up():
                    await self._redis.set(self.config.key_prefix + key, blob,
                                          ex=self.config.redis_ttl_s)
            except Exception as exc:
                self._redis_failed(exc)
            finally:
                self._writes.task_done()


def _redact(url: str) -> str:
    """Hide a password in a redis:// URL for logs."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


class CachedStream:
    """A cache hit, shaped like :class:`rtts.core.scheduler.RequestStream` for the sender."""

    cached = True
    ready = True  # the audio is all here

    def __init__(self, samples: npt.NDArray[np.float32],
                 sample: SpeakerSample | None = None) -> None:
        self._samples: npt.NDArray[np.float32] | None = samples
        self.sample = sample  # the codes of this audio, when known (speaker anchoring)
        self.submitted_at = self.produced_at = time.monotonic()

    def cancel(self) -> None:
        self._samples = None

    def __aiter__(self) -> CachedStream:
        return self

    async def __anext__(self) -> npt.NDArray[np.float32]:
        if self._samples is None:
            raise StopAsyncIteration
        samples, self._samples = self._samples, None
        self.produced_at = time.monotonic()
        return samples
