"""The demo page and JS client through server restarts and outages, in a real browser
(Debian chromium via playwright) against a real ``rtts serve --engine fake`` process that the
test kills and starts again on the same port (issue 14).

One page lives through the whole run, and nothing reloads it:

1. it speaks and is heard (audio counted inside the AudioWorklet);
2. the server stops (SIGTERM, a restart): speak() during the outage is queued and delivered
   once the server is back, and a speak() right after the reconnect plays audibly;
3. a long outage (SIGKILL, the server stays down ~9 s) with the client's backoff capped at
   200 ms: that is dozens of failed attempts, far past the old 5-attempt budget, so it shows
   "never gives up" as well as a 60-second outage would (a 60 s cap-bound outage is the same
   loop, just longer; the cap is a test hook, `?backoff_max_ms=`, the default is 5 s). An
   utterance spoken during it fails at its queue deadline (`?queue_deadline_ms=6000`) with an
   `error` event and a rejected (handled) `done`, and frees its player track; after the
   restart the page recovers without a reload and speaks again;
4. cancel-then-speak ten times in a row, each while audibly playing, never jams: the last
   one plays to its end;
5. across the whole run: no page errors, no unhandled rejections, and no console errors
   except the browser's own network log line for each refused WebSocket attempt while the
   server is down (chromium prints those itself; a page cannot suppress them).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from procs import free_port, start_rtts

pytestmark = [pytest.mark.browser, pytest.mark.long]

CHROMIUM = os.environ.get("RTTS_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--autoplay-policy=no-user-gesture-required"]
WEB = Path(__file__).resolve().parent.parent / "web"

if not shutil.which(CHROMIUM):
    pytest.skip(f"{CHROMIUM} not installed", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


class Server:
    """``rtts serve --engine fake`` on a fixed port, stopped and started at will."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self._cm: contextlib.AbstractContextManager[subprocess.Popen[bytes]] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._cm = start_rtts(["--engine", "fake", "--fake-rtf", "1.0", "--web-dir", str(WEB),
                               "--shutdown-grace", "0.5"], self.port, self.log)
        self.proc = self._cm.__enter__()

    def stop(self, kill: bool = False) -> None:
        assert self._cm is not None and self.proc is not None
        if kill:
            self.proc.kill()
        self._cm.__exit__(None, None, None)  # SIGTERM (if still running) and reap
        self._cm = self.proc = None


@pytest.fixture()
def rtts_proc(tmp_path: Path) -> Iterator[Server]:
    srv = Server(free_port(), tmp_path / "rtts.log")
    srv.start()
    try:
        yield srv
    finally:
        if srv.proc is not None:
            srv.stop()


WAIT_AUDIBLE = """async (u) => {
  // resolves with the samples the worklet played of this utterance's track
  const c = window.__rtts.client;
  return await new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error("not audible in time")), 15000);
    const tick = () => {
      const played = window.__rtts.stats?.positions?.[u.track]?.played ?? 0;
      if (played > 0.25 * c.player.sampleRate) { clearTimeout(t); resolve(played); }
      else setTimeout(tick, 20);
    };
    tick();
  });
}"""


@contextlib.contextmanager
def demo_page(port: int) -> Iterator[Any]:
    """The demo page in chromium. On exit it checks the whole run: no page errors, no
    unhandled rejections, and no console errors but chromium's own line for each refused
    WebSocket attempt while the server is down (a page cannot suppress those)."""
    console: list[str] = []
    page_errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = browser.new_context().new_page()
        page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        page.add_init_script("""
          window.__rejections = [];
          addEventListener("unhandledrejection", (e) => window.__rejections.push(String(e.reason)));
        """)
        yield page
        rejections = page.evaluate("window.__rejections")
        browser.close()
    assert not page_errors, page_errors
    assert not rejections, rejections
    refused = re.compile(rf"WebSocket connection to 'ws://127\.0\.0\.1:{port}/v1/stream' failed")
    assert all(refused.search(m) for m in console), [m for m in console
                                                     if not refused.search(m)]


def state(page: Any) -> str:
    return str(page.evaluate("window.__rtts.client.state"))


def test_restarts_outages_and_barge_in_never_jam(rtts_proc: Server) -> None:
    port = rtts_proc.port
    with demo_page(port) as page:
        page.goto(f"http://127.0.0.1:{port}/?backoff_max_ms=200&backoff_base_ms=50"
                  "&queue_deadline_ms=6000")
        page.wait_for_function("() => window.__rtts && window.__rtts.info !== null")
        # the demo tells the truth: a banner for the fake engine, voices from the server
        assert "tones, not speech" in page.locator("#banner").inner_text()
        assert page.locator("#banner").is_visible()
        voices = page.evaluate("[...document.querySelectorAll('#voices option')].map(o => o.value)")
        assert "seed:1" in voices and any(not v.startswith("seed:") for v in voices), voices

        # 1. speaks and is heard
        page.evaluate("window.__u = window.__rtts.speak('Hello there. This is the first one.')")
        page.evaluate("async () => { const u = await window.__u; await u.done; }")
        assert page.evaluate(f"async () => ({WAIT_AUDIBLE})(await window.__u)") > 0

        # 2. a restart: speak during the outage is queued, then delivered
        rtts_proc.stop()
        page.wait_for_function("() => window.__rtts.client.state === 'reconnecting'", timeout=10000)
        queued = page.evaluate("""async () => {
          window.__q = await window.__rtts.speak('Spoken while the server was restarting.');
          return window.__q.state; }""")
        assert queued == "queued"
        pill = page.locator("#server").inner_text()
        assert pill.startswith("reconnecting"), pill
        rtts_proc.start()
        page.wait_for_function("() => window.__rtts.client.state === 'open'", timeout=15000)
        assert page.evaluate("async () => (await window.__q.done).segments") >= 1
        assert page.evaluate(f"async () => ({WAIT_AUDIBLE})(window.__q)") > 0
        # right after the reconnect: plays audibly
        page.evaluate("window.__r = window.__rtts.speak('Right after the reconnect.')")
        assert page.evaluate(f"async () => ({WAIT_AUDIBLE})(await window.__r)") > 0

        # 3. a long outage with a short backoff cap: it keeps trying, then recovers
        page.evaluate("async () => { await (await window.__r).done; }")
        rtts_proc.stop(kill=True)
        page.wait_for_function("() => window.__rtts.client.state === 'reconnecting'", timeout=10000)
        before = page.evaluate("window.__rtts.states.length")
        page.evaluate("""async () => {
          const u = await window.__rtts.speak('Nobody is there to hear this.');
          window.__lost = {state: u.state, error: null, rejected: false};
          u.addEventListener('error', (e) => { window.__lost.error = e.detail.code; });
          u.done.catch(() => { window.__lost.rejected = true; });
          u.ended.then(() => { window.__lost.ended = true; });
        }""")
        time.sleep(9.0)
        lost = page.evaluate("window.__lost")
        assert lost == {"state": "queued", "error": "not_connected", "rejected": True,
                        "ended": True}, lost
        attempts = page.evaluate(f"window.__rtts.states.slice({before})"
                                 ".filter(s => s === 'reconnecting').length")
        assert attempts >= 15, attempts  # the old client gave up after 5
        assert state(page) == "reconnecting"
        rtts_proc.start()
        page.wait_for_function("() => window.__rtts.client.state === 'open'", timeout=15000)
        page.wait_for_function("() => document.querySelector('#server').textContent"
                               ".startsWith('back')"
                               " || document.querySelector('#server').textContent"
                               ".startsWith('ready')")
        page.evaluate("window.__b = window.__rtts.speak('Back after the long outage.')")
        assert page.evaluate(f"async () => ({WAIT_AUDIBLE})(await window.__b)") > 0

        # 4. cancel-then-speak ten times, each while audibly playing; the last plays out
        result = page.evaluate(f"""async () => {{
          const wait = {WAIT_AUDIBLE};
          const heard = [];
          let u = null;
          for (let i = 0; i < 10; i++) {{
            u = await window.__rtts.speak(`Round ${{i}}: a sentence long enough to be ` +
                                          `interrupted while it is still playing.`);
            heard.push(await wait(u));
          }}
          const c = window.__rtts.client;
          const last = await window.__rtts.speak('The last word.');
          await last.done;
          const ended = await last.ended;
          await new Promise((r) => setTimeout(r, 150));
          return {{heard, played: ended.played, reason: ended.reason,
                   left: Object.keys(window.__rtts.stats.positions).length,
                   open: [...c.utterances.values()].map((x) => x.state)}};
        }}""")
        assert len(result["heard"]) == 10 and min(result["heard"]) > 0, result
        assert result["reason"] == "ended" and result["played"] > 0, result
        assert result["left"] == 0, result  # no track left in the play queue
        text = page.locator("#heardtext").inner_text()
        assert text.startswith("“"), text  # the server's heard text of the last barge-in



def test_a_sixty_second_outage_with_default_settings_recovers_without_reload(
        rtts_proc: Server) -> None:
    """The outage a user meets, literally: the page on its default settings (backoff capped
    at 5 s, no test hooks), the server killed and down for 60 s, then started again. The
    page is back within one backoff step and speaks audibly, with no reload, no page error
    and no unhandled rejection."""
    port = rtts_proc.port
    with demo_page(port) as page:
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_function("() => window.__rtts && window.__rtts.info !== null")
        page.evaluate("window.__u = window.__rtts.speak('Before the outage.')")
        assert page.evaluate(f"async () => ({WAIT_AUDIBLE})(await window.__u)") > 0
        page.evaluate("async () => { await (await window.__u).done; }")

        rtts_proc.stop(kill=True)
        page.wait_for_function("() => window.__rtts.client.state === 'reconnecting'",
                               timeout=10000)
        before = page.evaluate("window.__rtts.states.length")
        time.sleep(60.0)
        assert state(page) == "reconnecting"  # still trying after a minute
        attempts = page.evaluate(f"window.__rtts.states.slice({before})"
                                 ".filter(s => s === 'reconnecting').length")
        assert attempts >= 10, attempts  # 5 s cap: a try every 2.5-5 s, never given up
        rtts_proc.start()
        started = time.monotonic()
        page.wait_for_function("() => window.__rtts.client.state === 'open'", timeout=15000)
        assert time.monotonic() - started < 7.0  # within one capped backoff step
        page.evaluate("window.__b = window.__rtts.speak('Back after a minute away.')")
        assert page.evaluate(f"async () => ({WAIT_AUDIBLE})(await window.__b)") > 0
