// Demo page: streams typed or simulated-LLM text to rtts and plays it as it arrives.
import { connect } from "./rtts-client.js";

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
  u.addEventListener("error", (e) => console.warn("utterance error", e.detail));
  return u;
}

async function ensureClient() {
  if (client) return client;
  client = await connect(wsUrl.href, { reconnect: { retries: 10 } });
  window.__rtts.client = client;
  setServer(client.server.degraded ? "degraded" : `ready · ${client.server.engine}`,
            client.server.degraded ? "degraded" : "ok");
  client.addEventListener("close", () => setServer("disconnected", "down"));
  client.addEventListener("open", (e) =>
    setServer(e.detail.degraded ? "degraded" : `ready · ${e.detail.engine}`,
              e.detail.degraded ? "degraded" : "ok"));
  client.player.addEventListener("stats", (e) => {
    const s = e.detail;
    window.__rtts.stats = s;
    $("buffered").textContent = `${s.bufferedMs.toFixed(0)} ms (target ${s.targetMs} ms)`;
    $("underruns").textContent = String(s.underruns);
    if (current) $("heard").textContent = `${(current.heard().playedMs / 1000).toFixed(2)} s`;
  });
  return client;
}

async function speak(input) {
  const c = await ensureClient();
  if (current && current.state === "open") await c.cancel(current.contextId);
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

window.__rtts = { speak, ensureClient, client: null, stats: null };
fetch("/v1/info").then((r) => r.json()).then((info) => {
  if (!client) setServer(info.state === "ready" ? `ready · ${info.engine}` : info.state,
                         info.state === "ready" ? "ok" : "down");
}).catch(() => setServer("unreachable", "down"));
requestAnimationFrame(drawMeter);
