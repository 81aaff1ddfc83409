"""Phrase cache: pure parts synchronously; the server path over real sockets (fake engine,
the documented test double); the Redis tier against a real redis-server on loopback."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from helpers import base_config, client, server
from procs import free_port
from rtts.core.cache import (
    CacheConfig,
    LruAudio,
    PhraseCache,
    cache_key,
    decode_audio,
    encode_audio,
    normalize_text,
)
from rtts.core.governor import Level
from rtts.core.params import SynthParams
from rtts.engines.fake import FakeEngine

# -- pure ------------------------------------------------------------------------------


def test_normalize_text_collapses_space_and_width_but_keeps_case_and_punctuation():
    assert normalize_text("  Hello \n\t world!  ") == "Hello world!"
    assert normalize_text("你好，世界！") == normalize_text("你好,世界!")  # NFKC: full width
    assert normalize_text("Hello.") != normalize_text("hello.")
    assert normalize_text("Hello.") != normalize_text("Hello?")


def test_cache_key_covers_text_voice_every_param_seed_engine_and_degraded():
    p = SynthParams(voice="seed:3", seed=7)
    base = cache_key("e1", "Hi there.", p, False)
    assert cache_key("e1", " Hi   there. ", p, False) == base
    variants = [
        cache_key("e2", "Hi there.", p, False),
        cache_key("e1", "Hi there!", p, False),
        cache_key("e1", "Hi there.", p, True),
        *(cache_key("e1", "Hi there.", replace(p, **{k: v}), False) for k, v in [
            ("voice", "seed:4"), ("seed", 8), ("seed", None), ("temperature", 0.31),
            ("top_P", 0.8), ("top_K", 21), ("speed", 6), ("refine", True)]),
    ]
    assert len(set(variants)) == len(variants) and base not in variants


def test_audio_encoding_round_trips_and_rejects_foreign_blobs():
    x = np.sin(np.linspace(0, 40, 2400)).astype(np.float32) * 0.5
    blob = encode_audio(x, 24000)
    y = decode_audio(blob, 24000)
    assert y is not None and y.dtype == np.float32 and len(y) == len(x)
    assert np.max(np.abs(x - y)) < 1e-4
    assert decode_audio(blob, 16000) is None  # another sample rate
    assert decode_audio(b"not audio at all", 24000) is None
    assert decode_audio(blob[:-1], 24000) is None


def test_lru_is_bounded_in_bytes_and_evicts_least_recently_used():
    lru = LruAudio(max_bytes=100)
    lru.put("a", b"x" * 40)
    lru.put("b", b"x" * 40)
    assert lru.get("a") is not None  # a is now the most recent
    lru.put("c", b"x" * 40)  # evicts b
    assert lru.get("b") is None and lru.get("a") and lru.get("c")
    assert lru.bytes == 80 and len(lru) == 2
    lru.put("huge", b"x" * 101)  # larger than the budget: not stored, nothing evicted
    assert lru.get("huge") is None and len(lru) == 2
    lru.put("a", b"y" * 10)  # replace updates the byte count
    assert lru.bytes == 50


async def test_memory_cache_skips_overlong_and_empty_entries():
    cache = PhraseCache(CacheConfig(max_entry_s=1.0), "e", 1000)
    cache.put("long", np.zeros(1001, np.float32))
    cache.put("empty", np.zeros(0, np.float32))
    cache.put("ok", np.zeros(1000, np.float32))
    assert await cache.get("long") is None and await cache.get("empty") is None
    got = await cache.get("ok")
    assert got is not None and len(got) == 1000
    assert (cache.stats.hits_memory, cache.stats.misses, cache.stats.stores) == (1, 2, 1)


# -- through the server -------------------------------------------------------------------


async def speak(url, text, cid="a", **start):
    """One context speaking ``text``; returns (segment_started events, audio bytes)."""
    async with client(url) as c:
        await c.send(**{"type": "start", "context_id": cid, "voice": "seed:1", "seed": 5,
                        **start})
        await c.send(type="text", context_id=cid, text=text)
        await c.send(type="end", context_id=cid)
        await c.until("done", cid)
        return c.got.of("segment_started", cid), c.got.audio(1)


async def test_repeated_phrase_is_served_from_cache_with_identical_audio():
    engine = FakeEngine(ms_per_char=20)
    async with server(engine=engine) as (app, url):
        text = "Sure, let me check that for you. One moment please."
        first, audio1 = await speak(url, text)
        batches = len(engine.batches)
        second, audio2 = await speak(url, text)
        assert [e["cached"] for e in first] == [False] * len(first)
        assert [e["cached"] for e in second] == [True] * len(second)
        assert audio2 == audio1 and len(audio1) > 0
        assert len(engine.batches) == batches  # the engine was not asked again
        assert app.cache.stats.hits_memory == len(second)
        # another sample rate is resampled from the same cached engine-rate audio
        third, audio3 = await speak(url, text, sample_rate=16000)
        assert all(e["cached"] for e in third)
        assert abs(len(audio3) / len(audio1) - 16000 / 24000) < 0.01


async def test_cache_opt_out_params_and_degraded_state_miss():
    engine = FakeEngine(ms_per_char=20)
    async with server(engine=engine) as (app, url):
        text = "Good morning."
        await speak(url, text)
        off, _ = await speak(url, text, cache=False)
        other_seed, _ = await speak(url, text, seed=6)
        app.governor._move(Level.DEGRADED, "test")
        app.apply_level(Level.DEGRADED)
        degraded, _ = await speak(url, text)
        assert not any(e["cached"] for e in off + other_seed + degraded)
        async with client(url) as c:
            await c.send(type="start", context_id="x", cache="yes")
            err = await c.until("error")
            assert err["code"] == "invalid_params" and "cache" in err["message"]


async def test_cancelled_segment_is_not_cached():
    engine = FakeEngine(ms_per_char=60, rtf=1.0)  # 1.2 s of audio, produced in real time
    async with server(engine=engine) as (app, url):
        async with client(url) as c:
            await c.send(type="start", context_id="a", seed=5)
            await c.send(type="text", context_id="a", text="A phrase we will cut off.")
            await c.send(type="flush", context_id="a")
            await c.until("segment_started", "a")
            assert isinstance(await c.ws.recv(), bytes)  # audio is flowing
            await c.send(type="cancel", context_id="a")
            await c.until("cancelled", "a")
        await asyncio.sleep(0.2)
        assert app.cache.stats.stores == 0 and len(app.cache.memory) == 0


async def test_cache_off_with_zero_memory_and_no_redis():
    engine = FakeEngine(ms_per_char=20)
    cfg = base_config(cache=CacheConfig(memory_mb=0))
    async with server(cfg, engine) as (app, url):
        await speak(url, "Hello.")
        again, _ = await speak(url, "Hello.")
        assert not app.cache.enabled and not any(e["cached"] for e in again)
        assert len(engine.batches) == 2


# -- Redis -----------------------------------------------------------------------------------


async def test_redis_tier_shares_audio_between_two_servers(redis_url):
    """Two in-process servers (separate memory caches) sharing one real redis-server."""
    cfg = base_config(cache=CacheConfig(redis_url=redis_url))
    text = "Shared between instances, 你好。"
    async with server(cfg, FakeEngine(ms_per_char=20)) as (app_a, url_a), \
            server(cfg, FakeEngine(ms_per_char=20)) as (app_b, url_b):
        first, audio_a = await speak(url_a, text)
        await asyncio.sleep(0.1)  # Redis writes are asynchronous
        second, audio_b = await speak(url_b, text)
        assert not any(e["cached"] for e in first) and all(e["cached"] for e in second)
        assert audio_a == audio_b
        assert app_b.cache.stats.hits_redis == len(second) and app_b.cache.stats.errors == 0
        # B now also holds it in memory: the next hit does not touch Redis
        await speak(url_b, text)
        assert app_b.cache.stats.hits_memory == len(second)


async def test_dead_redis_is_a_miss_not_an_error(caplog):
    cfg = base_config(cache=CacheConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0",
                                        redis_backoff_s=60))
    engine = FakeEngine(ms_per_char=20)
    async with server(cfg, engine) as (app, url):
        first, audio = await speak(url, "Still speaking without Redis.")
        assert first and audio
        again, _ = await speak(url, "Still speaking without Redis.")
        assert all(e["cached"] for e in again)  # the memory tier still works
        assert app.cache.stats.errors >= 1
    assert "Redis unavailable" in caplog.text


@pytest.mark.parametrize("n", [3])
async def test_redis_entries_expire_with_ttl(redis_url, n):
    import redis.asyncio as aioredis

    cfg = base_config(cache=CacheConfig(redis_url=redis_url, redis_ttl_s=n,
                                        key_prefix="rtts:ttl-test:"))
    async with server(cfg, FakeEngine(ms_per_char=20)) as (app, url):
        await speak(url, "Expiring phrase.")
        await asyncio.sleep(0.1)
    r = aioredis.Redis.from_url(redis_url)
    try:
        keys = await r.keys("rtts:ttl-test:*")
        assert keys
        ttl = await r.ttl(keys[0])
        assert 0 < ttl <= n
    finally:
        await r.aclose()
