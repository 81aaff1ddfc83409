"""Shared fixtures. Helpers (servers, client) live in helpers.py.

The fake engine (rtts.engines.fake.FakeEngine) is the documented test double for
server-logic tests; tests marked ``chattts`` run the real ChatTTS code on the tiny
random-weight checkpoint, generated once per test session.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# Never download weights in tests (and fail fast, not after a timeout, where there is no
# network): `--source auto` then falls back to the random checkpoint. Servers started as
# subprocesses inherit it. tests/test_weights.py unsets it where it tests the hub probe.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _collect_before_caplog(request: pytest.FixtureRequest) -> None:
    """A test that asserts no ERROR was logged must not see an earlier test's litter: an
    object an earlier test leaked (an unclosed aiohttp session, say) logs its complaint from
    ``__del__`` whenever the garbage collector meets it. Collect before such a test starts,
    so the complaint lands in the test that leaked, not in a later one."""
    if "caplog" in request.fixturenames:
        gc.collect()


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
