"""Shared fixtures. Helpers (servers, client) live in helpers.py.

The fake engine (rtts.engines.fake.FakeEngine) is the documented test double for
server-logic tests; tests marked ``chattts`` run the real ChatTTS code on the tiny
random-weight checkpoint, generated once per test session.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# Never download weights in tests (and fail fast, not after a timeout, where there is no
# network): `--source auto` then falls back to the random checkpoint. Servers started as
# subprocesses inherit it. tests/test_weights.py unsets it where it tests the hub probe.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("ChatTTS")
    from rtts.engines.checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on loopback for the test session (installed by .ci/run)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    from procs import start_redis

    with start_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
