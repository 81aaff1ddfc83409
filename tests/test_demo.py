"""The demo page shows what rtts is for, in a real browser (Debian chromium via playwright):
live captions that advance while the audio plays (from the server's character timings), the
playing segment marked, a keyed server that says so and works once a key is given, and a
layout that reads on a phone. Screenshots go to ``artifacts/`` (desktop and phone).

The server is a real rtts server with the fake engine (test double) paced at real time, so
audio keeps arriving while it plays; skipped without /usr/bin/chromium or playwright.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from rtts.api.auth import AuthConfig
from rtts.config import EngineConfig, ServerConfig
from rtts.engines.fake import FakeEngine

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("RTTS_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--autoplay-policy=no-user-gesture-required"]
KEY = "demo-key-" + "x" * 16
PHONE = {"width": 390, "height": 844}

if not shutil.which(CHROMIUM):
    pytest.skip(f"{CHROMIUM} not installed", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")

from helpers import ServerThread, base_config  # noqa: E402


def _engine() -> FakeEngine:
    return FakeEngine(ms_per_char=60, chunk_ms=100, rtf=1.0)  # paced: audio keeps coming


def config(**auth: object) -> ServerConfig:
    cfg = replace(base_config(), engine=EngineConfig(name="fake"))
    return replace(cfg, auth=AuthConfig(**auth)) if auth else cfg  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def open_page(browser: object, port: int, **context: object) -> tuple[object, object,
                                                                       list[str]]:
    ctx = browser.new_context(**context)  # type: ignore[attr-defined]
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400
            else None)
    page.goto(f"http://127.0.0.1:{port}/")
    page.wait_for_function("() => window.__rtts !== undefined && window.__rtts.info !== null")
    return ctx, page, errors


def captions(page: object) -> dict[str, object]:
    return page.evaluate("window.__rtts.captions()")  # type: ignore[attr-defined,no-any-return]


def test_live_captions_advance_while_audio_plays(browser: object) -> None:
    with ServerThread(_engine(), config()) as srv:
        ctx, page, errors = open_page(browser, srv.port)
        try:
            text = page.locator("#text").input_value()
            assert text.isascii() and "rtts" in text  # the fake engine's language: English
            page.locator("#speak").click()
            page.wait_for_function("() => window.__rtts.captions().heard > 5", timeout=15000)
            first = captions(page)
            page.wait_for_timeout(800)
            second = captions(page)
            assert page.evaluate("window.__rtts.stats.nonSilent") > 0  # audibly playing
            # lit characters follow playback: more of them now, never all at once
            assert first["heard"] < second["heard"] < second["total"], (first, second)
            assert second["playing"] is not None  # a segment is marked as playing
            assert page.locator("#segments li.playing").count() == 1
            assert page.locator("#captions .seg.playing").count() == 1
            assert page.locator("#captions .heard").count() >= second["heard"]
            # plain words for the buffer figures
            assert "ahead" in page.locator("dt:nth-of-type(2)").inner_text()
            buffered = page.locator("#buffered").inner_text()
            assert "playback waits for" in buffered or buffered == "none (idle)", buffered
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "demo-desktop.png"), full_page=True)
            page.wait_for_function(
                "() => { const c = window.__rtts.captions(); return c.total > 0 && "
                "c.heard === c.total; }", timeout=30000)
        finally:
            ctx.close()  # type: ignore[attr-defined]
        assert not errors, errors


def test_phone_layout_reads_well(browser: object) -> None:
    with ServerThread(_engine(), config()) as srv:
        ctx, page, errors = open_page(browser, srv.port, viewport=PHONE, is_mobile=True,
                                      has_touch=True, device_scale_factor=2)
        try:
            page.locator("#speak").click()
            page.wait_for_function("() => window.__rtts.captions().heard > 5", timeout=15000)
            # nothing wider than the screen; the figures get a full line each
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"], width
            dd = page.locator("#buffered").bounding_box()
            assert dd is not None and dd["width"] > 150, dd
            # each label on one line (one line box for its text)
            lines = page.evaluate("""[...document.querySelectorAll('dt')].map((e) => {
                const r = document.createRange(); r.selectNodeContents(e);
                return r.getClientRects().length; })""")
            assert lines == [1] * len(lines), lines
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "demo-phone.png"), full_page=True)
        finally:
            ctx.close()  # type: ignore[attr-defined]
        assert not errors, errors


def test_keyed_server_says_so_and_works_with_a_key(browser: object) -> None:
    with ServerThread(_engine(), config(api_keys=(KEY,))) as srv:
        ctx, page, errors = open_page(browser, srv.port)
        try:
            form = page.locator("#auth")
            assert form.is_visible()
            assert "needs a key" in form.inner_text()
            assert page.locator("#server").inner_text() == "needs a key"
            # no endless "connecting in 2.4 s": nothing connects without a key
            page.locator("#speak").click()
            page.wait_for_timeout(300)
            assert page.evaluate("window.__rtts.client") is None
            page.locator("#key").fill(KEY)
            page.locator("#usekey").click()
            page.wait_for_function("() => document.querySelector('#server').textContent"
                                   " === 'key accepted'", timeout=5000)
            page.locator("#speak").click()
            page.wait_for_function("() => window.__rtts.captions().heard > 5", timeout=15000)
            assert page.evaluate("window.__rtts.client.state") == "open"
            assert "Key set" in form.inner_text()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "demo-keyed.png"), full_page=True)
        finally:
            ctx.close()  # type: ignore[attr-defined]
        assert not [e for e in errors if "rtts: this server needs a key" not in e], errors


def test_save_this_voice_button_stores_the_voice_just_heard(browser: object,
                                                            tmp_path: Path) -> None:
    fast = FakeEngine(ms_per_char=20, chunk_ms=50)
    with ServerThread(fast, replace(config(), voices_dir=tmp_path)) as srv:
        ctx, page, errors = open_page(browser, srv.port)
        try:
            assert page.locator("#savevoice").is_disabled()
            page.locator("details.params summary").click()
            page.locator("#voice").fill("seed:77")
            page.locator("#speak").click()
            page.wait_for_function("() => !document.querySelector('#savevoice').disabled",
                                   timeout=15000)
            page.once("dialog", lambda d: d.accept("demo-saved"))
            page.locator("#savevoice").click()
            page.wait_for_function(
                "() => document.querySelector('#savedvoice').textContent.includes('Saved')",
                timeout=10000)
            assert page.locator("#voice").input_value() == "demo-saved"
        finally:
            ctx.close()  # type: ignore[attr-defined]
        assert not errors, errors
    saved = (tmp_path / "demo-saved.json").read_text()
    assert '"seed": 77' in saved and '"sample"' in saved
