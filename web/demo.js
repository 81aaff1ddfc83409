// Demo page: streams typed or simulated-LLM text to rtts and plays it as it arrives.
import { RttsClient } from "./rtts-client.js";

const $ = (id) => document.getElementById(id);
const wsUrl = new URL("/v1/stream", location.href);
wsUrl.protocol = location.protocol === "https:" ? "wss:" : "ws:";

let client = null;
let current = null; // the Utterance playing or being fed
let live = null; // {utterance, sent} while live typing

function params() {
  const p = { voice: $("voice").value || undefined,
              temperature: Number($("temperature").value), top_P: Number($("top_P").value),
              top_K: Number($("top_K").value), speed: Number($("speed").value) };
  if ($("seed").value !== "") p.seed = Number($("seed").value);
  p.timings = true; // character timings: the live captions
  return p;
}

const seconds = (ms) => (ms < 1000 ? `${ms.toFixed(0)} ms` : `${(ms / 1000).toFixed(1)} s`);

function setServer(text, cls) {
  const el = $("server");
  el.textContent = text;
  el.className = `pill ${cls}`;
}

// Live captions: one span per character, lit when playback passes its start time
// (the server's estimated character timings), and the segment being played marked.
const captions = { chars: [], next: 0, segments: [], playing: null };

function resetCaptions() {
  captions.chars = [];
  captions.next = 0;
  captions.segments = [];
  captions.playing = null;
  $("captions").replaceChildren();
}

function addCaptionSegment(u, d) {
  const seg = document.createElement("span");
  seg.className = "seg";
  seg.id = `cap-${u.contextId}-${d.segment}`;
  const spans = [...d.text].map((ch) => {
    const span = document.createElement("span");
    span.textContent = ch;
    return span;
  });
  seg.append(...spans, " ");
  $("captions").append(seg);
  const li = document.createElement("li");
  li.id = `seg-${u.contextId}-${d.segment}`;
  li.textContent = d.text;
  $("segments").append(li);
  captions.segments.push({ seg, li, spans, start: d.audio_start_ms, end: Infinity });
}

function timeCaptionSegment(u, d) {
  const entry = captions.segments.find((s) => s.seg.id === `cap-${u.contextId}-${d.segment}`);
  if (!entry) return;
  entry.end = d.audio_start_ms + d.duration_ms;
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `${(d.duration_ms / 1000).toFixed(2)} s`;
  entry.li.append(meta);
  const starts = d.char_start_ms ?? [];
  entry.spans.forEach((span, i) => {
    const t = starts[i] ?? d.audio_start_ms + (d.duration_ms * i) / entry.spans.length;
    captions.chars.push({ span, t });
  });
}

function updateCaptions() {
  if (!current) return;
  const played = current.heard().playedMs;
  const { chars } = captions;
  while (captions.next < chars.length && chars[captions.next].t <= played) {
    chars[captions.next].span.className = "heard";
    captions.next += 1;
  }
  const playing = captions.segments.find((s) => played >= s.start && played < s.end
    && played > 0) ?? null;
  if (playing && playing.end === Infinity) {
    // Its timings come with its last audio (segment_done): until then, estimate from the
    // segments timed so far, and keep the last character for the real timings.
    const timed = captions.segments.filter((s) => s.end !== Infinity);
    const ms = timed.reduce((a, s) => a + s.end - s.start, 0);
    const n = timed.reduce((a, s) => a + s.spans.length, 0);
    const perChar = n > 0 ? ms / n : 70;
    const lit = Math.min(playing.spans.length - 1, Math.floor((played - playing.start) / perChar));
    for (let i = 0; i < lit; i++) playing.spans[i].className = "heard";
  }
  if (playing !== captions.playing) {
    captions.playing?.li.classList.remove("playing");
    captions.playing?.seg.classList.remove("playing");
    playing?.li.classList.add("playing");
    playing?.seg.classList.add("playing");
    captions.playing = playing;
  }
}

function track(u) {
  current = u;
  $("savevoice").disabled = true;
  $("segments").innerHTML = "";
  resetCaptions();
  $("ttfa").textContent = "…";
  u.addEventListener("started", (e) => { $("ttfa").textContent = `${e.detail.ttfaMs.toFixed(0)} ms`; });
  u.addEventListener("segment_started", (e) => addCaptionSegment(u, e.detail));
  u.addEventListener("segment", (e) => {
    timeCaptionSegment(u, e.detail);
    $("savevoice").disabled = false; // the first segment is what the voice is saved from
  });
  u.addEventListener("error", (e) => console.warn("rtts: utterance failed:", e.detail.code,
                                                   e.detail.message));
  u.addEventListener("cancelled", (e) => {
    if (e.detail.textSpoken !== undefined) {
      $("heardtext").textContent = `“${e.detail.textSpoken}” (not heard: ${
        e.detail.textRemaining.length} chars)`;
    }
  });
  return u;
}

// Test hooks in the query string (the browser tests use them): backoff cap, queue deadline.
const query = new URLSearchParams(location.search);
const num = (key) => (query.has(key) ? Number(query.get(key)) : undefined);
let opening = null;
let backTimer = null;
let countdown = null;

function showState(detail) {
  clearInterval(countdown);
  countdown = null;
  const c = client;
  if (detail.state === "open") {
    const s = c.server ?? {};
    const label = `${s.degraded ? "degraded" : "ready"} · ${s.engine}`;
    if (detail.back) {
      setServer(`back · ${s.engine}`, "ok");
      clearTimeout(backTimer);
      backTimer = setTimeout(() => { if (c.state === "open") setServer(label, "ok"); }, 3000);
    } else {
      setServer(label, s.degraded ? "degraded" : "ok");
    }
  } else if (detail.state === "reconnecting" || detail.state === "connecting") {
    const tickDown = () => {
      const left = c.retryAt === null ? 0 : Math.max(0, c.retryAt - Date.now());
      setServer(left > 0 ? `${detail.state} in ${(left / 1000).toFixed(1)} s`
        : `${detail.state}…`, "waiting");
    };
    tickDown();
    countdown = setInterval(tickDown, 200);
  } else {
    setServer(navigator.onLine === false ? "offline" : `offline · ${c.closedReason ?? ""}`,
              "down");
  }
}

/** The client, created on first use (audio needs a user gesture); it connects in the
 * background, and speak() before it is open is queued by the client itself. */
function getClient() {
  if (client) return client;
  client = new RttsClient(wsUrl.href, {
    reconnect: { maxDelayMs: num("backoff_max_ms"), baseDelayMs: num("backoff_base_ms") },
    queue: { deadlineMs: num("queue_deadline_ms") },
    token: auth.needed ? browserToken : undefined,
  });
  window.__rtts.client = client;
  window.__rtts.states = [];
  client.addEventListener("statechange", (e) => {
    window.__rtts.states.push(e.detail.state);
    showState(e.detail);
  });
  client.player.addEventListener("stats", (e) => {
    const s = e.detail;
    window.__rtts.stats = s;
    $("buffered").textContent = s.bufferedMs > 0
      ? `${seconds(s.bufferedMs)} (playback waits for ${s.targetMs} ms)` : "none (idle)";
    $("underruns").textContent = s.underruns === 0 ? "none"
      : `${s.underruns} (the buffer grew to ${s.targetMs} ms to avoid more)`;
    if (current) $("heard").textContent = seconds(current.heard().playedMs);
  });
  opening = client.open().catch((err) => console.warn("rtts: not connected:", err.message));
  return client;
}

/** The client once it is open (waits out an outage). */
async function ensureClient() {
  const c = getClient();
  await opening;
  return c;
}

async function speak(input) {
  if (auth.needed && !auth.secret) {
    showAuth();
    $("key").focus();
    throw new Error("this server needs a key");
  }
  const c = getClient();
  if (current && (current.state === "open" || current.state === "queued")) {
    await c.cancel(current.contextId);
  }
  return track(c.speak(input, params()));
}

async function* simulatedLlm(text) {
  for (const token of text.match(/\S+\s*|\s+/g) ?? []) {
    await new Promise((r) => setTimeout(r, 30 + Math.random() * 60));
    yield token;
  }
}

const quietly = (p) => p.catch((err) => console.warn("rtts:", err.message));

// "Save this voice": the server stores the voice the last utterance spoke (its speaker
// and its first segment's codes and text) under a name; the voice box then uses it.
async function saveVoice() {
  const u = current;
  if (!u || !client) return;
  const name = prompt("Name for this voice (a-z, 0-9, _ and -):",
                      `voice-${Date.now().toString(36)}`);
  if (!name) return;
  const out = $("savedvoice");
  out.hidden = false;
  try {
    const voice = await client.saveVoice(u.contextId, name.trim().toLowerCase());
    out.textContent = `Saved as “${voice.name}”: the voice box now uses it.`;
    $("voice").value = voice.name;
    quietly(loadVoices());
  } catch (err) {
    out.textContent = `Not saved: ${err.message}`;
  }
}
$("savevoice").addEventListener("click", () => quietly(saveVoice()));
$("speak").addEventListener("click", () => quietly(speak($("text").value)));
$("llm").addEventListener("click", () => quietly(speak(simulatedLlm($("text").value))));
$("cancel").addEventListener("click", async () => {
  if (current && client) await client.cancel(current.contextId);
  live = null;
});
$("server").addEventListener("click", () => { client?.reconnect(); });
$("live").addEventListener("change", async (e) => {
  if (e.target.checked) {
    let u;
    try {
      u = await speak(undefined);
    } catch {
      e.target.checked = false;
      return;
    }
    live = { utterance: u, sent: 0 };
    $("text").value = "";
  } else if (live) {
    live.utterance.end();
    live = null;
  }
});
$("text").addEventListener("input", () => {
  if (!live || !client) return;
  const text = $("text").value;
  if (text.length > live.sent) {
    live.utterance.write(text.slice(live.sent));
    live.sent = text.length;
  }
});
for (const id of ["temperature", "top_P", "speed"]) {
  $(id).addEventListener("input", (e) => { e.target.nextElementSibling.textContent = e.target.value; });
}

function drawMeter() {
  const canvas = $("meter");
  const g = canvas.getContext("2d");
  const level = client?.player ? client.player.level() : 0;
  g.fillStyle = "#101522";
  g.fillRect(0, 0, canvas.width, canvas.height);
  const analyser = client?.player?.analyser;
  if (analyser) {
    const data = new Float32Array(analyser.fftSize);
    analyser.getFloatTimeDomainData(data);
    g.strokeStyle = "#5fd38d";
    g.beginPath();
    for (let i = 0; i < data.length; i++) {
      const x = (i / data.length) * canvas.width;
      const y = canvas.height / 2 - data[i] * canvas.height / 2;
      if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
    }
    g.stroke();
  }
  g.fillStyle = "#2f6fed";
  g.fillRect(0, canvas.height - 6, Math.min(1, level) * canvas.width, 6);
  updateCaptions();
  requestAnimationFrame(drawMeter);
}

window.__rtts = { speak, ensureClient, getClient, client: null, stats: null, states: [],
                 info: null,
                 captions: () => ({
                   heard: document.querySelectorAll("#captions .heard").length,
                   total: captions.segments.reduce((a, s) => a + s.spans.length, 0),
                   playing: captions.playing?.li.id ?? null }) };

const REAL_SPEECH = "For real speech now, offline: stop it and run <code>make run-piper</code>" +
  " (the piper test voice), or give ChatTTS its weights with <code>--model-dir DIR</code>" +
  " (docs: Hear real speech).";

const SAMPLE_TEXT = {
  en: "Hello! This is rtts, streaming speech as the text arrives. " +
      "Each word lights up below as you hear it.",
  zh: "你好！这是实时语音合成，文字一到就开始说话。你听到的每个字都会在下面亮起来。",
};

/** The primary engine's language, from its first voice (piper names start with it). */
function language(info) {
  const primary = (info.engines ?? []).find((e) => e.primary);
  const name = primary?.voices?.[0]?.name ?? "";
  const m = /^([a-z]{2})_[a-z]{2}-/.exec(name);
  return { lang: m ? m[1] : "en", voice: primary?.name === "piper" ? primary.voices[0].voice : null };
}

function showInfo(info) {
  window.__rtts.info = info;
  const banner = $("banner");
  let warning = "";
  if (info.engine === "fake") {
    warning = "This server runs the fake test engine: you will hear tones, not speech. " +
      REAL_SPEECH;
  } else if (info.random_weights) {
    warning = "This server runs a random-weight ChatTTS checkpoint: you will hear " +
      "<strong>noise</strong>, not speech. " + REAL_SPEECH;
  }
  banner.innerHTML = warning;
  banner.hidden = !warning;
  const { lang, voice } = language(info);
  const text = $("text");
  if (text.value === text.defaultValue) text.value = SAMPLE_TEXT[lang] ?? SAMPLE_TEXT.en;
  document.documentElement.lang = lang;
  if (voice && $("voice").value === $("voice").defaultValue) $("voice").value = voice;
  if (!client) setServer(info.state === "ready" ? `ready · ${info.engine}` : info.state,
                         info.state === "ready" ? "ok" : "down");
  auth.needed = Boolean(info.auth);
  showAuth();
}

// -- a server started with --api-key: a key (traded for a token) or a token -------------
const auth = { needed: false, secret: sessionStorage.getItem("rtts-key") ?? "", token: null,
               error: "" };

function showAuth() {
  const form = $("auth");
  form.hidden = !auth.needed;
  if (!auth.needed) return;
  if (!auth.secret) {
    $("authmsg").querySelector("strong").textContent = "This server needs a key.";
    setServer("needs a key", "down");
  } else if (auth.error) {
    $("authmsg").querySelector("strong").textContent = `That did not work: ${auth.error}.`;
    setServer("key refused", "down");
  } else {
    $("authmsg").querySelector("strong").textContent = "Key set.";
  }
}

/** A browser token: the secret traded at /v1/token when it is a key, else the secret. */
async function browserToken() {
  if (!auth.secret) throw new Error("no key given");
  const r = await fetch("/v1/token", { headers: { Authorization: `Bearer ${auth.secret}` } });
  if (r.ok) {
    auth.error = "";
    return (await r.json()).token;
  }
  return auth.secret; // not a key: perhaps a token from the user's backend
}

async function useKey(secret) {
  auth.secret = secret.trim();
  auth.error = "";
  sessionStorage.setItem("rtts-key", auth.secret);
  try {
    const token = await browserToken();
    const r = await fetch(`/v1/voices?token=${encodeURIComponent(token)}`);
    if (!r.ok) auth.error = r.status === 401 ? "neither a key nor a valid token" : `HTTP ${r.status}`;
  } catch (err) {
    auth.error = String(err?.message ?? err);
  }
  showAuth();
  if (!auth.error) {
    setServer("key accepted", "ok");
    loadVoices();
    client?.reconnect();
  }
}

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  useKey($("key").value);
});

async function loadVoices(seedsOnly = false) {
  const list = $("voices");
  const names = [];
  if (!seedsOnly) try {
    const query = auth.needed && auth.secret ? `?token=${encodeURIComponent(await browserToken())}` : "";
    const r = await fetch(`/v1/voices${query}`);
    if (r.ok) for (const v of (await r.json()).voices ?? []) names.push(v.name);
  } catch {
    // no voice list (an older server, or a key is needed): seeds only
  }
  for (let i = 1; i <= 5; i++) names.push(`seed:${i}`);
  list.replaceChildren(...names.map((n) => Object.assign(document.createElement("option"),
                                                         { value: n })));
}

fetch("/v1/info").then((r) => r.json()).then((info) => {
  showInfo(info);
  if (!auth.needed || auth.secret) loadVoices();
  else loadVoices(true);
}).catch(() => setServer("unreachable", "down"));
requestAnimationFrame(drawMeter);
