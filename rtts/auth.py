"""Access control for the WebSocket endpoint: API keys, short-lived tokens, origins, quotas.

* **API keys** (``--api-key``, or ``RTTS_API_KEYS`` comma-separated): server-side clients
  send ``Authorization: Bearer <key>``. With no key configured, auth is off.
* **Browser tokens**: a key must never reach a page. The app's backend calls
  ``GET /v1/token`` with its key and hands the browser the returned token, which the
  browser passes as ``?token=...`` (browsers cannot set headers on WebSockets). Tokens are
  HMAC-SHA256 signed, name the key they came from, and expire after ``token_ttl_s``.
* **Origins** (``--allowed-origin``): a request that carries an ``Origin`` header not in
  the list is refused (403). Requests without ``Origin`` (non-browser clients) pass.
* **Quotas per key**: concurrent sessions (429) and new sessions per minute (429).

Pure logic: the server feeds it headers, query and the time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections import defaultdict, deque
from dataclasses import dataclass

import orjson

__all__ = ["AuthConfig", "AuthError", "Authenticator", "key_id"]


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    token_secret: bytes | None = None  # default: random per process
    token_ttl_s: int = 300
    allowed_origins: tuple[str, ...] = ()
    max_sessions_per_key: int | None = None
    sessions_per_minute: int | None = None

    @staticmethod
    def keys_from_env() -> tuple[str, ...]:
        return tuple(k.strip() for k in os.environ.get("RTTS_API_KEYS", "").split(",")
                     if k.strip())


class AuthError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def key_id(key: str) -> str:
    """A stable, non-secret name for a key (logs and quotas never see the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._keys = {key_id(k): k for k in config.api_keys}
        self._secret = config.token_secret or secrets.token_bytes(32)
        self.active: defaultdict[str, int] = defaultdict(int)
        self._starts: defaultdict[str, deque[float]] = defaultdict(deque)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    # -- keys and tokens -------------------------------------------------------------

    def key_from_header(self, authorization: str | None) -> str | None:
        """The key id for a valid ``Bearer`` key, else None."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        presented = authorization[7:].strip()
        kid = key_id(presented)
        known = self._keys.get(kid)
        if known is not None and hmac.compare_digest(known, presented):
            return kid
        return None

    def issue_token(self, kid: str, now: float) -> str:
        body = _b64(orjson.dumps({"k": kid, "exp": int(now) + self.config.token_ttl_s}))
        sig = _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())
        return f"{body}.{sig}"

    def verify_token(self, token: str, now: float) -> str | None:
        """The key id a valid, unexpired token names, else None."""
        try:
            body, sig = token.split(".", 1)
            expected = _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())
            if not hmac.compare_digest(sig, expected):
                return None
            claims = orjson.loads(_unb64(body))
        except (ValueError, orjson.JSONDecodeError):
            return None
        kid = claims.get("k") if isinstance(claims, dict) else None
        exp = claims.get("exp") if isinstance(claims, dict) else None
        if not isinstance(kid, str) or kid not in self._keys or not isinstance(exp, int):
            return None
        return kid if now < exp else None

    # -- admission ---------------------------------------------------------------------

    def check_origin(self, origin: str | None) -> None:
        allowed = self.config.allowed_origins
        if origin is not None and allowed and origin not in allowed:
            raise AuthError(403, "origin not allowed")

    def identify(self, authorization: str | None, token: str | None, now: float) -> str:
        """Who is connecting: a key id, or "anonymous" when auth is off."""
        if not self.enabled:
            return "anonymous"
        kid = self.key_from_header(authorization)
        if kid is None and token:
            kid = self.verify_token(token, now)
        if kid is None:
            raise AuthError(401, "missing or invalid API key or token")
        return kid

    def admit(self, kid: str, now: float) -> None:
        """Check the key's quotas and count a new session; call :meth:`release` at its end."""
        cfg = self.config
        if cfg.max_sessions_per_key is not None and self.active[kid] >= cfg.max_sessions_per_key:
            raise AuthError(429, f"at most {cfg.max_sessions_per_key} sessions per key")
        if cfg.sessions_per_minute is not None:
            starts = self._starts[kid]
            while starts and now - starts[0] >= 60.0:
                starts.popleft()
            if len(starts) >= cfg.sessions_per_minute:
                raise AuthError(429, f"at most {cfg.sessions_per_minute} new sessions a minute")
            starts.append(now)
        self.active[kid] += 1

    def release(self, kid: str) -> None:
        self.active[kid] = max(0, self.active[kid] - 1)
