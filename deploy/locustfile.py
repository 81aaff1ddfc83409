"""Load-test an rtts server with locust: native WebSocket streams and OpenAI speech.

    locust -f deploy/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8765

Two kinds of users, each one listener speaking the same text over and over:

* ``NativeStreamUser`` (weight 3): one ``/v1/stream`` WebSocket (websocket-client), one
  context per turn, PCM16 at 24 kHz;
* ``OpenAISpeechUser`` (weight 1): ``POST /v1/audio/speech`` with
  ``response_format=pcm`` (24 kHz PCM16), the body read as it streams.

Besides locust's own row per request, every turn reports two custom metrics as locust
request events (so they appear in the statistics table, the CSV files and the web UI):

* ``TTFA <name>``: time to first audio, ms, from sending the text to the first audio byte;
* ``STALL <name>``: silence heard, ms: a listener starts playing at the first audio byte
  and plays in real time; each moment it has run out of audio counts. 0 means the
  stream kept up with real time.

**The ramp that finds the knee.** With ``RTTS_RAMP=STEP,SECONDS,MAX`` (e.g. ``2,30,24``)
the ``StepRamp`` shape adds ``STEP`` users every ``SECONDS`` up to ``MAX`` (``-u``, ``-r``
and ``-t`` are then the shape's), and at the end prints one line per step: users, turns,
TTFA p50/p95 and the stall ratio (silence / audio). The knee is the first step whose
TTFA p95 passes ``RTTS_KNEE_TTFA_MS`` (default 1000) or whose stall ratio passes
``RTTS_KNEE_STALL`` (default 0.01); it is marked. (The per-step table is kept by this
process, so it needs the local runner, not ``--master``/``--worker``.)

Every turn is synthesized afresh, so the phrase cache does not answer the repeats: the
native context asks ``"cache": false``, the OpenAI request names a new ``seed:N`` voice
each turn (OpenAI's body has no cache switch). ``RTTS_LOAD_CACHE=1`` lets the cache
answer (and the OpenAI users then speak ``RTTS_LOAD_VOICE``).

Settings (environment): ``RTTS_API_KEY`` (sent as ``Authorization: Bearer``),
``RTTS_LOAD_TEXT`` (the text of a turn), ``RTTS_LOAD_VOICE`` (with the cache allowed, or
set explicitly: the OpenAI users' voice; default ``alloy``), ``RTTS_LOAD_CACHE``.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from typing import Any

import websocket
from locust import HttpUser, LoadTestShape, User, between, events, task

TEXT = os.environ.get("RTTS_LOAD_TEXT",
                      "The quick brown fox jumps over the lazy dog. It was a bright cold "
                      "day in April, and the clocks were striking thirteen.")
VOICE = os.environ.get("RTTS_LOAD_VOICE")
CACHE = os.environ.get("RTTS_LOAD_CACHE", "0").lower() in ("1", "true", "yes")
KEY = os.environ.get("RTTS_API_KEY")
RATE = 24000
HEADER_BYTES = 12  # the native binary frame's header (docs/protocols/native.md)

# (seconds since the test started, users then, ttfa ms, stall ms, audio ms) per turn
_TURNS: list[tuple[float, int, float, float, float]] = []
_LOCK = threading.Lock()
_T0 = time.monotonic()


class Listener:
    """Plays what arrives in real time from the first byte; sums the silence."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.first: float | None = None
        self.audio_s = 0.0  # audio received
        self.stall_s = 0.0

    def got(self, nbytes: int, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            playhead = now - self.first - self.stall_s  # audio played by now, had it had it
            if playhead > self.audio_s:
                self.stall_s += playhead - self.audio_s
        self.audio_s += nbytes / 2 / RATE

    @property
    def ttfa_ms(self) -> float:
        return 1000 * ((self.first or time.monotonic()) - self.sent_at)


def report(environment: Any, name: str, listener: Listener, error: str | None,
           users: int) -> None:
    """TTFA and stall as locust request events (failed turns count as failures)."""
    fire = environment.events.request.fire
    exc = RuntimeError(error) if error else None
    fire(request_type="TTFA", name=name, response_time=listener.ttfa_ms,
         response_length=int(listener.audio_s * RATE * 2), exception=exc, context={})
    fire(request_type="STALL", name=name, response_time=1000 * listener.stall_s,
         response_length=0, exception=exc, context={})
    if error is None:
        with _LOCK:
            _TURNS.append((time.monotonic() - _T0, users, listener.ttfa_ms,
                           1000 * listener.stall_s, 1000 * listener.audio_s))


def _users(user: User) -> int:
    runner = user.environment.runner
    return runner.user_count if runner is not None else 0


class NativeStreamUser(User):
    """One ``/v1/stream`` WebSocket per user; one context per turn."""

    weight = 3
    wait_time = between(0.5, 1.5)

    def on_start(self) -> None:
        host = (self.host or "http://127.0.0.1:8765").rstrip("/")
        url = host.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        headers = [f"Authorization: Bearer {KEY}"] if KEY else []
        self.ws = websocket.create_connection(f"{url}/v1/stream", header=headers, timeout=30)
        self.turn = 0
        while json.loads(self.ws.recv()).get("type") != "ready":
            pass

    def on_stop(self) -> None:
        self.ws.close()

    @task
    def speak(self) -> None:
        self.turn += 1
        cid = f"t{self.turn}"
        started = time.monotonic()
        self.ws.send(json.dumps({"type": "start", "context_id": cid, "sample_rate": RATE,
                                 "cache": CACHE}))
        listener = Listener(time.monotonic())
        self.ws.send(json.dumps({"type": "text", "context_id": cid, "text": TEXT}))
        self.ws.send(json.dumps({"type": "end", "context_id": cid}))
        error = None
        try:
            while True:
                msg = self.ws.recv()
                if isinstance(msg, bytes):
                    listener.got(len(msg) - HEADER_BYTES, time.monotonic())
                    continue
                event = json.loads(msg)
                if event.get("type") == "error":
                    error = f"{event.get('code')}: {event.get('message')}"
                    if event.get("context_id") in (cid, None):
                        break
                elif event.get("type") == "done" and event.get("context_id") == cid:
                    break
        except (websocket.WebSocketException, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.on_start()  # a fresh socket for the next turn
        self.environment.events.request.fire(
            request_type="WS", name="/v1/stream turn",
            response_time=1000 * (time.monotonic() - started),
            response_length=int(listener.audio_s * RATE * 2),
            exception=RuntimeError(error) if error else None, context={})
        report(self.environment, "native /v1/stream", listener, error, _users(self))


class OpenAISpeechUser(HttpUser):
    """``POST /v1/audio/speech``, the PCM body read as it streams."""

    weight = 1
    wait_time = between(0.5, 1.5)

    @task
    def speech(self) -> None:
        headers = {"Authorization": f"Bearer {KEY}"} if KEY else {}
        # a new speaker each turn unless the cache may answer: no two requests alike
        voice = VOICE or ("alloy" if CACHE else f"seed:{random.randrange(1, 10**9)}")
        listener = Listener(time.monotonic())
        error = None
        with self.client.post("/v1/audio/speech", headers=headers, stream=True,
                              catch_response=True, name="/v1/audio/speech",
                              json={"model": "tts-1", "voice": voice, "input": TEXT,
                                    "response_format": "pcm"}) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                resp.failure(error)
            else:
                odd = 0
                for chunk in resp.iter_content(chunk_size=None):
                    n = len(chunk) + odd
                    odd = n % 2
                    listener.got(n - odd, time.monotonic())
        report(self.environment, "openai /v1/audio/speech", listener, error, _users(self))


_RAMP = os.environ.get("RTTS_RAMP")

if _RAMP:
    _STEP, _SECONDS, _MAX = (int(float(x)) for x in _RAMP.split(","))

    class StepRamp(LoadTestShape):
        """``STEP`` more users every ``SECONDS`` up to ``MAX``, then one more step's
        time at ``MAX``; spawned at ``STEP`` a second."""

        def tick(self) -> tuple[int, float] | None:
            t = self.get_run_time()
            steps = int(t // _SECONDS) + 1
            if steps * _STEP > _MAX + _STEP:
                return None
            return min(_MAX, steps * _STEP), float(_STEP)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def step_table(turns: list[tuple[float, int, float, float, float]], knee_ttfa_ms: float,
               knee_stall: float) -> list[str]:
    """One line per user count: turns, TTFA p50/p95, stall ratio; the knee marked."""
    by_users: dict[int, list[tuple[float, float, float]]] = {}
    for _, users, ttfa, stall, audio in turns:
        by_users.setdefault(users, []).append((ttfa, stall, audio))
    lines = ["users  turns  ttfa_p50_ms  ttfa_p95_ms  stall_ratio"]
    knee = False
    for users in sorted(by_users):
        rows = by_users[users]
        ttfa = [r[0] for r in rows]
        ratio = sum(r[1] for r in rows) / max(1e-9, sum(r[2] for r in rows))
        p95 = _percentile(ttfa, 0.95)
        mark = ""
        if not knee and (p95 > knee_ttfa_ms or ratio > knee_stall):
            knee, mark = True, "  <- knee"
        lines.append(f"{users:5d}  {len(rows):5d}  {_percentile(ttfa, 0.5):11.0f}  "
                     f"{p95:11.0f}  {ratio:11.4f}{mark}")
    return lines


@events.quitting.add_listener
def _print_steps(environment: Any, **_: Any) -> None:
    with _LOCK:
        turns = list(_TURNS)
    if not turns:
        return
    table = step_table(turns, float(os.environ.get("RTTS_KNEE_TTFA_MS", "1000")),
                       float(os.environ.get("RTTS_KNEE_STALL", "0.01")))
    print("rtts turns by user count (TTFA from text sent; stall = silence / audio):")
    print("\n".join(table))
