"""API keys, browser tokens, origins and per-key quotas, over real sockets where it matters."""

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from helpers import base_config, server
from rtts.api.auth import AuthConfig, Authenticator, AuthError
from rtts.server import bound_port

KEY = "sk-test-123"


def make(**kw):
    return Authenticator(AuthConfig(api_keys=(KEY, "other-key"), **kw))


def test_tokens_sign_expire_and_resist_tampering():
    a = make(token_ttl_s=60)
    kid = a.key_from_header(f"Bearer {KEY}")
    assert kid is not None and KEY not in kid
    token = a.issue_token(kid, now=1000)
    assert KEY not in token
    assert a.verify_token(token, now=1059) == kid
    assert a.verify_token(token, now=1060) is None  # expired
    body, sig = token.split(".")
    assert a.verify_token(body + "." + sig[:-2] + "AA", now=1000) is None
    assert a.verify_token("garbage", now=1000) is None
    assert make().verify_token(token, now=1000) is None  # another process's secret
    assert a.key_from_header("Bearer nope") is None and a.key_from_header(None) is None


def test_identify_origin_and_quotas():
    a = make(allowed_origins=("https://app.example",), max_sessions_per_key=2,
             sessions_per_minute=3)
    with pytest.raises(AuthError) as info:
        a.identify(None, None, 0)
    assert info.value.status == 401
    kid = a.identify(f"Bearer {KEY}", None, 0)
    a.check_origin("https://app.example")
    a.check_origin(None)  # non-browser clients send no Origin
    with pytest.raises(AuthError) as info:
        a.check_origin("https://evil.example")
    assert info.value.status == 403
    a.admit(kid, 0)
    a.admit(kid, 1)
    with pytest.raises(AuthError) as info:
        a.admit(kid, 2)  # concurrency
    assert info.value.status == 429
    a.release(kid)
    a.admit(kid, 3)
    a.release(kid)
    with pytest.raises(AuthError):
        a.admit(kid, 4)  # 4th new session within a minute
    a.admit(kid, 61)  # the window moved on
    assert Authenticator(AuthConfig()).identify(None, None, 0) == "anonymous"


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def _status(url, **kw) -> int:
    try:
        async with connect(url, **kw) as ws:
            await ws.recv()
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def test_server_enforces_keys_tokens_origins_and_quotas():
    cfg = replace(base_config(), auth=AuthConfig(
        api_keys=(KEY,), allowed_origins=("http://good.example",), max_sessions_per_key=2))
    async with server(cfg) as (app, url):
        base = f"http://127.0.0.1:{bound_port(app)}"
        assert await _status(url) == 401
        assert await _status(url, additional_headers={"Authorization": "Bearer wrong"}) == 401
        assert await _status(url, additional_headers={"Authorization": f"Bearer {KEY}"}) == 101
        # a browser: gets a token from its backend, never sees the key
        status, body = await asyncio.to_thread(_get, base + "/v1/token")
        assert status == 401
        status, body = await asyncio.to_thread(
            _get, base + "/v1/token", {"Authorization": f"Bearer {KEY}"})
        token = json.loads(body)["token"]
        assert status == 200 and KEY not in token
        assert await _status(f"{url}?token={token}", origin="http://good.example") == 101
        assert await _status(f"{url}?token={token}", origin="http://evil.example") == 403
        assert await _status(f"{url}?token={token[:-3]}xyz") == 401
        # quota: two sessions per key at once
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with connect(url, additional_headers=hdr) as a, \
                connect(url, additional_headers=hdr) as b:
            await a.recv()
            await b.recv()
            assert await _status(url, additional_headers=hdr) == 429
        await asyncio.sleep(0.2)  # both closed: the key has room again
        assert await _status(url, additional_headers=hdr) == 101
        # health probes stay open
        assert (await asyncio.to_thread(_get, base + "/healthz"))[0] == 200
        assert app.stats.auth_rejected >= 5
