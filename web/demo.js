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
  return p;
}

function setServer(text, cls) {
  const el = $("server");
  el.textContent = text;
  el.className = `pill ${cls}`;
}

function track(u) {
  current = u;
  $("segments").innerHTML = "";
  $("ttfa").textContent = "…";
  u.addEventListener("started", (e) => { $("ttfa").textContent = `${e.detail.ttfaMs.toFixed(0)} ms`; });
  u.addEventListener("segment_started", (e) => {
    const li = document.createElement("li");
    li.id = `seg-${u.contextId}-${e.detail.segment}`;
    li.textContent = e.detail.text;
    $("segments").append(li);
  });
  u.addEventListener("segment", (e) => {
    const li = document.getElementById(`seg-${u.contextId}-${e.detail.segment}`);
    if (li) {
      const meta = document.createElement("span");
      meta.className = "meta";
      meta.textContent = `${(e.detail.duration_ms / 1000).toFixed(2)} s`;
      li.append(meta);
    }
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
    $("buffered").textContent = `${s.bufferedMs.toFixed(0)} ms (target ${s.targetMs} ms)`;
    $("underruns").textContent = String(s.underruns);
    if (current) $("heard").textContent = `${(current.heard().playedMs / 1000).toFixed(2)} s`;
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

$("speak").addEventListener("click", () => speak($("text").value));
$("llm").addEventListener("click", () => speak(simulatedLlm($("text").value)));
$("cancel").addEventListener("click", async () => {
  if (current && client) await client.cancel(current.contextId);
  live = null;
});
$("server").addEventListener("click", () => { client?.reconnect(); });
$("live").addEventListener("change", async (e) => {
  if (e.target.checked) {
    const u = await speak(undefined);
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
  requestAnimationFrame(drawMeter);
}

window.__rtts = { speak, ensureClient, getClient, client: null, stats: null, states: [],
                 info: null };

function showInfo(info) {
  window.__rtts.info = info;
  const banner = $("banner");
  let warning = "";
  if (info.engine === "fake") {
    warning = "This server runs the fake test engine: you will hear tones, not speech.";
  } else if (info.random_weights) {
    warning = "This server runs a random-weight ChatTTS checkpoint: you will hear noise, " +
      "not speech. Start it with real weights (--model-dir) for speech.";
  }
  banner.textContent = warning;
  banner.hidden = !warning;
  if (!client) setServer(info.state === "ready" ? `ready · ${info.engine}` : info.state,
                         info.state === "ready" ? "ok" : "down");
}

async function loadVoices() {
  const list = $("voices");
  const names = [];
  try {
    const r = await fetch("/v1/voices");
    if (r.ok) for (const v of (await r.json()).voices ?? []) names.push(v.name);
  } catch {
    // no voice list (an older server, or a key is needed): seeds only
  }
  for (let i = 1; i <= 5; i++) names.push(`seed:${i}`);
  list.replaceChildren(...names.map((n) => Object.assign(document.createElement("option"),
                                                         { value: n })));
}

fetch("/v1/info").then((r) => r.json()).then(showInfo)
  .catch(() => setServer("unreachable", "down"));
loadVoices();
requestAnimationFrame(drawMeter);
