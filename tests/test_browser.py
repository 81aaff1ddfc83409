"""The JS client and AudioWorklet player in a real browser (Debian chromium via playwright).

Skipped when /usr/bin/chromium or playwright is missing; .ci/run installs both.
The server is a real rtts server on 127.0.0.1 with the fake engine (test double) paced
at real time, serving web/ as it does in production.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rtts.engines.fake import FakeEngine

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("RTTS_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--autoplay-policy=no-user-gesture-required"]

if not shutil.which(CHROMIUM):
    pytest.skip(f"{CHROMIUM} not installed", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

from helpers import ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def rtts_server() -> Iterator[ServerThread]:
    # Paced at real time (rtf 1.0) so audio keeps arriving while it plays.
    with ServerThread(FakeEngine(ms_per_char=50, chunk_ms=100, rtf=1.0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser: object, rtts_server: ServerThread) -> Iterator[object]:
    context = browser.new_context()  # type: ignore[attr-defined]
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # a clean load and run: no console errors, no failed requests (there were 404s)
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400
          else None)
    pg.goto(f"http://127.0.0.1:{rtts_server.port}/")
    pg.wait_for_function("() => window.__rtts !== undefined && window.__rtts.info !== null")
    yield pg
    context.close()
    assert not errors, errors


def test_page_connects_plays_audio_and_screenshot(page: object) -> None:
    info = page.evaluate("""async () => {
        const u = await window.__rtts.speak("Hello there. This is the browser test speaking.");
        const done = await u.done;
        return {done, ttfa: u.ttfaMs, rate: window.__rtts.client.player.sampleRate,
                state: window.__rtts.client.player.context.state};
    }""")
    assert info["state"] == "running"
    assert info["done"]["segments"] >= 1 and info["ttfa"] is not None
    # the worklet itself counts render quanta with audible output
    page.wait_for_function("() => window.__rtts.stats && window.__rtts.stats.nonSilent > 100",
                           timeout=15000)
    stats = page.evaluate("window.__rtts.stats")
    assert stats["samplesOut"] > 0.5 * info["rate"]
    assert page.locator("#ttfa").inner_text().endswith("ms")
    assert page.locator("#segments li").count() >= 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
    assert (ARTIFACTS / "demo.png").stat().st_size > 10_000


def test_cancel_stops_output_within_100ms_of_audio(page: object) -> None:
    result = page.evaluate("""async () => {
        const c = await window.__rtts.ensureClient();
        const u = c.speak("This is a long utterance that keeps going for many seconds, " +
                          "so that cancelling it in the middle really matters here.");
        // wait until it is audibly playing
        await new Promise((resolve) => {
          const tick = () => (window.__rtts.stats?.positions?.[u.track]?.played > 4000)
              ? resolve() : setTimeout(tick, 20);
          tick();
        });
        const heard = await c.cancel(u.contextId);
        const before = window.__rtts.stats.samplesOut;
        await new Promise((r) => setTimeout(r, 600));
        return {heard, track: u.track, rate: c.player.sampleRate,
                after: window.__rtts.stats.afterInterrupt[u.track] ?? 0,
                grew: window.__rtts.stats.samplesOut - before, state: u.state};
    }""")
    assert result["state"] == "cancelled"
    assert result["heard"]["playedMs"] > 0
    # audible samples the worklet output after the interrupt: the 5 ms fade, < 100 ms
    assert result["after"] <= 0.1 * result["rate"], result
    assert result["grew"] <= 0.1 * result["rate"], result


def test_two_contexts_play_in_order_gaplessly(page: object) -> None:
    result = page.evaluate("""async () => {
        const c = await window.__rtts.ensureClient();
        const finished = [];
        c.player.addEventListener("finished", (e) => finished.push(e.detail));
        const received = {};
        const a = c.speak("First context, first.", {voice: "seed:1"});
        const b = c.speak("Second context, after.", {voice: "seed:2"});
        for (const u of [a, b]) {
          received[u.track] = 0;
          u.addEventListener("audio", (e) => { received[u.track] += e.detail.pcm.length; });
        }
        await Promise.all([a.done, b.done]);
        await Promise.all([a.ended, b.ended]);
        return {finished, received, a: a.track, b: b.track, rate: c.player.sampleRate,
                sent: a.sampleRate, ha: a.heard(), hb: b.heard()};
    }""")
    order = [f["stream"] for f in result["finished"] if f["reason"] == "ended"]
    assert order.index(result["a"]) < order.index(result["b"])
    for key in ("a", "b"):
        track = result[key]
        played = next(f["played"] for f in result["finished"] if f["stream"] == track)
        expected = result["received"][str(track)] * result["rate"] / result["sent"]
        assert abs(played - expected) <= 2, (played, expected)  # nothing lost or doubled
    assert result["ha"]["segments"] and result["ha"]["playedMs"] > 0


def test_no_resampling_in_javascript_unless_the_server_cannot_send_the_rate(page: object) -> None:
    result = page.evaluate("""async () => {
        const { connect } = await import("/rtts-client.js");
        const url = new URL("/v1/stream", location.href).href.replace(/^http/, "ws");
        async function run(options) {
          const c = await connect(url, options);
          let stats = null;
          c.player.addEventListener("stats", (e) => { stats = e.detail; });
          let received = 0;
          const u = c.speak("Rates and resamplers.");
          u.addEventListener("audio", (e) => { received += e.detail.pcm.length; });
          await u.done;
          await u.ended;
          await new Promise((r) => setTimeout(r, 120));  // one more stats message
          const out = {context: c.player.sampleRate, sent: u.sampleRate,
                       native: c.server.sample_rate, received,
                       played: u.heard().playedMs * c.player.sampleRate / 1000,
                       resampled: stats.resampled};
          await c.close();
          return out;
        }
        // the player's own context runs at the stream's rate: nobody resamples
        const plain = await run({});
        // a context at a rate the server cannot send: the worklet's linear fallback
        const odd = await run({audioContext: new AudioContext({sampleRate: 32000})});
        return {plain, odd};
    }""")
    plain, odd = result["plain"], result["odd"]
    assert plain["context"] == plain["sent"] == plain["native"] == 24000, plain
    assert plain["resampled"] == 0 and plain["received"] > 0, plain
    assert odd["context"] == 32000 and odd["sent"] == 24000, odd
    assert odd["resampled"] == odd["received"] > 0, odd
    assert abs(odd["played"] - odd["received"] * 32000 / 24000) <= 2, odd
