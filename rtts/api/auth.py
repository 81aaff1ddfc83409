"""Access control for the WebSocket endpoint: API keys, short-lived tokens, origins, quotas.

* **API keys** (``--api-key``, or ``RTTS_API_KEYS`` comma-separated): server-side clients
  send ``Authorization: Bearer <key>``. With no key configured, auth is off.
* **Browser tokens**: a key must never reach a page. The app's backend calls
  ``GET /v1/token`` with its key and hands the browser the returned token, which the
  browser passes as ``?token=...`` (browsers cannot set headers on WebSockets). Tokens are
  HMAC-SHA256 signed, name the key they came from (by its key id: an HMAC of the key under
  the server secret), and expire after ``token_ttl_s``. Replicas that share
  ``token_secret`` accept each other's tokens; ``previous_token_secret`` keeps tokens of
  the old secret valid during a rotation.
* **Origins** (``--allowed-origin``): a request that carries an ``Origin`` header not in
  the list is refused (403). Requests without ``Origin`` (non-browser clients) pass.
* **Quotas per key**: concurrent sessions (429) and new sessions per minute (429, with the
  seconds until the window frees a start). They are counted per instance; a session is
  counted only once it really opens, and released on every path out.

Pure logic: the server feeds it headers, query and the time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import secrets
from collections import defaultdict, deque
from dataclasses import dataclass

import orjson

from rtts.errors import RttsError

__all__ = ["AuthConfig", "AuthError", "Authenticator", "key_id"]


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    # Signs browser tokens and derives key ids. None: random per process, so a token works
    # only on the instance that issued it, until it restarts. Replicas share one secret
    # (``--token-secret`` / ``RTTS_TOKEN_SECRET``).
    token_secret: bytes | None = None
    # Rotation: tokens signed with this one are still accepted (set it to the old secret
    # for one token TTL after switching ``token_secret``).
    previous_token_secret: bytes | None = None
    token_ttl_s: int = 300
    allowed_origins: tuple[str, ...] = ()
    max_sessions_per_key: int | None = None
    sessions_per_minute: int | None = None
    # the model and voice *name* lists (GET /v1/models, /v1/audio/models, /v1/audio/voices,
    # and ElevenLabs' /v1/models and /v1/voices) answer without a key (Open WebUI asks for
    # them with none); a key that is presented is still checked
    public_listing: bool = False
    # operator keys (``--admin-key``): the admin API (``/v1/admin/...``: drain) and
    # nothing else; none configured, the admin API is off (403)
    admin_keys: tuple[str, ...] = ()

    @staticmethod
    def keys_from_env() -> tuple[str, ...]:
        return tuple(k.strip() for k in os.environ.get("RTTS_API_KEYS", "").split(",")
                     if k.strip())


class AuthError(RttsError):
    """A refused key, token, origin or quota: ``status`` 401, 403 or 429."""

    def __init__(self, status: int, reason: str, retry_after_s: int | None = None) -> None:
        super().__init__(reason, code=str(status))
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s  # 429: when a retry can succeed (seconds)

    @property
    def kind(self) -> str:
        """Metric label: ``unauthorized``, ``forbidden_origin`` or ``quota``."""
        return {401: "unauthorized", 403: "forbidden_origin"}.get(self.status, "quota")


def key_id(key: str, secret: bytes) -> str:
    """A stable, non-secret name for a key (logs, quotas and tokens never see the key):
    an HMAC under the server's secret, so a weak key cannot be guessed offline from it."""
    return hmac.new(secret, b"rtts-key-id\0" + key.encode(), hashlib.sha256).hexdigest()[:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _same(a: str, b: str) -> bool:
    """Constant-time comparison of any two strings (``compare_digest`` rejects non-ASCII str)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"),
                               b.encode("utf-8", "surrogatepass"))


# A concurrent-session cap frees up when any session of the key ends: retry soon.
CONCURRENCY_RETRY_S = 5


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._secret = config.token_secret or secrets.token_bytes(32)
        self._keys = {key_id(k, self._secret): k for k in config.api_keys}
        # what a key owns on shared storage (its named voices) is filed under a name that
        # does not change with the token secret (random per instance unless configured);
        # slow to derive, so a weak key is not guessed from a directory name
        self._owners = {kid: hashlib.pbkdf2_hmac("sha256", k.encode(), b"rtts-owner",
                                                 20_000).hex()[:32]
                        for kid, k in self._keys.items()}
        # (secret, its key id -> the key id under the current secret), current first
        self._verifiers: list[tuple[bytes, dict[str, str]]] = [
            (self._secret, {kid: kid for kid in self._keys})]
        if config.previous_token_secret:
            old = config.previous_token_secret
            self._verifiers.append(
                (old, {key_id(k, old): key_id(k, self._secret) for k in config.api_keys}))
        self.active: defaultdict[str, int] = defaultdict(int)
        self._starts: defaultdict[str, deque[float]] = defaultdict(deque)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def owner(self, kid: str) -> str | None:
        """The stable owner id of key ``kid`` for what it stores (named voices), the same on
        every instance and across restarts; None when auth is off (everything is shared)."""
        return self._owners.get(kid) if self.enabled else None

    @property
    def shared_secret(self) -> bool:
        """Whether tokens are signed with a configured (shareable) secret."""
        return self.config.token_secret is not None

    # -- keys and tokens -------------------------------------------------------------

    def key_from_header(self, authorization: str | None) -> str | None:
        """The key id for a valid ``Bearer`` key, else None."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        return self.key_from_value(authorization[7:].strip())

    def key_from_value(self, presented: str) -> str | None:
        """The key id for a valid key given as is (``xi-api-key``, a first message...)."""
        kid = key_id(presented, self._secret)
        known = self._keys.get(kid)
        if known is not None and _same(known, presented):
            return kid
        return None

    def check_admin(self, authorization: str | None) -> None:
        """Raise :class:`AuthError` unless ``authorization`` is ``Bearer <admin key>``:
        403 when no admin key is configured (the admin API is off), 401 otherwise."""
        admins = self.config.admin_keys
        if not admins:
            raise AuthError(403, "the admin API is off: start rtts with --admin-key")
        presented = (authorization[7:].strip() if authorization
                     and authorization.lower().startswith("bearer ") else "")
        # every key compared, in constant time each, so timing tells nothing
        if not presented or not sum(_same(presented, k) for k in admins):
            raise AuthError(401, "missing or invalid admin key")

    def issue_token(self, kid: str, now: float) -> str:
        body = _b64(orjson.dumps({"k": kid, "exp": int(now) + self.config.token_ttl_s}))
        sig = _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())
        return f"{body}.{sig}"

    def verify_token(self, token: str, now: float) -> str | None:
        """The key id a valid, unexpired token names, else None (signed with the current
        secret, or with the previous one during a rotation)."""
        try:
            body, sig = token.split(".", 1)
            raw = body.encode("ascii")
        except (ValueError, UnicodeEncodeError):
            return None
        for secret, kids in self._verifiers:
            expected = _b64(hmac.new(secret, raw, hashlib.sha256).digest())
            if not _same(sig, expected):
                continue
            try:
                claims = orjson.loads(_unb64(body))
            except (ValueError, orjson.JSONDecodeError):
                return None
            kid = claims.get("k") if isinstance(claims, dict) else None
            exp = claims.get("exp") if isinstance(claims, dict) else None
            if not isinstance(kid, str) or kid not in kids or not isinstance(exp, int):
                return None
            return kids[kid] if now < exp else None
        return None

    # -- admission ---------------------------------------------------------------------

    def check_origin(self, origin: str | None) -> None:
        allowed = self.config.allowed_origins
        if origin is not None and allowed and origin not in allowed:
            raise AuthError(403, "origin not allowed")

    def identify(self, authorization: str | None, token: str | None, now: float,
                 key: str | None = None) -> str:
        """Who is connecting: a key id, or "anonymous" when auth is off. ``key`` is a key
        presented outside ``Authorization`` (e.g. ElevenLabs' ``xi-api-key``), used only
        when no ``Authorization`` header was sent."""
        if not self.enabled:
            return "anonymous"
        kid = self.key_from_header(authorization)
        if kid is None and key and not authorization:  # Authorization, when sent, decides
            kid = self.key_from_value(key)
        if kid is None and token:
            kid = self.verify_token(token, now)
        if kid is None:
            raise AuthError(401, "missing or invalid API key or token")
        return kid

    def check(self, kid: str, now: float) -> None:
        """Raise the :class:`AuthError` (429, with a computed ``retry_after_s``) that
        :meth:`admit` would raise now, without counting anything."""
        cfg = self.config
        if (cfg.max_sessions_per_key is not None
                and self.active.get(kid, 0) >= cfg.max_sessions_per_key):
            raise AuthError(429, f"at most {cfg.max_sessions_per_key} sessions per key",
                            CONCURRENCY_RETRY_S)
        if cfg.sessions_per_minute is not None:
            starts = self._starts[kid]
            while starts and now - starts[0] >= 60.0:
                starts.popleft()
            if len(starts) >= cfg.sessions_per_minute:
                wait = max(1, math.ceil(starts[0] + 60.0 - now))
                raise AuthError(429, f"at most {cfg.sessions_per_minute} new sessions a minute",
                                wait)
            if not starts:
                del self._starts[kid]

    def admit(self, kid: str, now: float) -> None:
        """Check the key's quotas and count a session that is really opening; every path
        out of it must call :meth:`release` once."""
        self.check(kid, now)
        if self.config.sessions_per_minute is not None:
            self._starts[kid].append(now)
        self.active[kid] += 1

    def release(self, kid: str) -> None:
        left = self.active[kid] - 1
        if left > 0:
            self.active[kid] = left
        else:
            del self.active[kid]
