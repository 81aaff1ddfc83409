import { test } from "node:test";
import assert from "node:assert/strict";
import { RttsClient } from "../rtts-client.js";
import { buildFrame } from "../protocol.js";

/** A scripted stand-in for the browser WebSocket (the real server is tested in pytest). */
class ScriptedSocket {
  static last = null;
  constructor(url) {
    this.url = url;
    this.sent = [];
    this.readyState = 1;
    ScriptedSocket.last = this;
    setTimeout(() => this.serverSays({ type: "ready", protocol: 1, engine: "fake" }), 0);
  }
  send(data) { this.sent.push(JSON.parse(data)); }
  close() {}
  serverSays(obj) { this.onmessage({ data: JSON.stringify(obj) }); }
  serverFrame(buf) { this.onmessage({ data: buf }); }
}

test("token goes in the query string, from a value or a function", async () => {
  const c = new RttsClient("ws://h/v1/stream", { play: false, WebSocket: ScriptedSocket,
                                                token: async () => "t o/k" });
  await c.open();
  assert.equal(ScriptedSocket.last.url, "ws://h/v1/stream?token=t%20o%2Fk");
  const d = new RttsClient("ws://h/v1/stream?x=1", { play: false, WebSocket: ScriptedSocket,
                                                    token: "abc" });
  await d.open();
  assert.equal(ScriptedSocket.last.url, "ws://h/v1/stream?x=1&token=abc");
});

test("speak streams an async iterable, then ends; events map to the utterance", async () => {
  const c = new RttsClient("ws://h/v1/stream", { play: false, WebSocket: ScriptedSocket });
  await c.open();
  const ws = ScriptedSocket.last;
  async function* tokens() { yield "Hello "; yield "world."; }
  const u = c.speak(tokens(), { contextId: "c1", voice: "seed:2" });
  await new Promise((r) => setTimeout(r, 10));
  assert.deepEqual(ws.sent.map((m) => m.type), ["start", "text", "text", "end"]);
  assert.equal(ws.sent[0].voice, "seed:2");
  const audio = [];
  u.addEventListener("audio", (e) => audio.push(e.detail.pcm.length));
  ws.serverSays({ type: "segment_started", context_id: "c1", stream: 4, segment: 0,
                  text: "Hello world.", text_start: 0, text_end: 12, audio_start_ms: 0 });
  ws.serverFrame(buildFrame({ stream: 4, segment: 0, sequence: 0 }, new Int16Array(480)));
  ws.serverFrame(buildFrame({ stream: 9, segment: 0, sequence: 0 }, new Int16Array(480)));
  ws.serverSays({ type: "segment_done", context_id: "c1", segment: 0, duration_ms: 20 });
  ws.serverSays({ type: "done", context_id: "c1", segments: 1, audio_ms: 20 });
  const done = await u.done;
  assert.deepEqual(done, { segments: 1, audioMs: 20 });
  assert.deepEqual(audio, [480]); // the frame of an unknown stream was not delivered
  assert.ok(u.ttfaMs !== null && u.segments[0].durationMs === 20);
});

test("cancel sends cancel and drops late frames", async () => {
  const c = new RttsClient("ws://h/v1/stream", { play: false, WebSocket: ScriptedSocket });
  await c.open();
  const ws = ScriptedSocket.last;
  const u = c.speak(undefined, { contextId: "c2" });
  u.write("Some text");
  ws.serverSays({ type: "segment_started", context_id: "c2", stream: 1, segment: 0,
                  text: "Some text", text_start: 0, text_end: 9, audio_start_ms: 0 });
  let frames = 0;
  u.addEventListener("audio", () => { frames += 1; });
  await c.cancel("c2");
  ws.serverFrame(buildFrame({ stream: 1, segment: 0, sequence: 0 }, new Int16Array(10)));
  assert.equal(frames, 0);
  assert.equal(u.state, "cancelled");
  assert.deepEqual(ws.sent.map((m) => m.type), ["start", "text", "cancel"]);
});

test("the player's own AudioContext runs at the stream's rate, else the device's", async () => {
  const { PcmPlayer, createAudioContext, DEFAULT_CONTEXT_RATE } = await import("../pcm-player.js");
  const made = [];
  const saved = [globalThis.AudioContext, globalThis.AudioWorkletNode];
  try {
    globalThis.AudioContext = class {
      constructor(opts) {
        made.push(opts);
        if (opts.sampleRate === 12345) throw new DOMException("rate", "NotSupportedError");
        this.sampleRate = opts.sampleRate ?? 44100;
        this.state = "running";
        this.audioWorklet = { addModule: async () => {} };
      }
      createAnalyser() { return { connect() {} }; }
    };
    globalThis.AudioWorkletNode = class { constructor() { this.port = {}; } connect() {} };
    assert.equal(DEFAULT_CONTEXT_RATE, 24000);
    assert.equal(createAudioContext(12345).sampleRate, 44100); // refused: the device's rate
    const p = new PcmPlayer();
    await p.connect();
    assert.equal(p.sampleRate, 24000);
    const q = new PcmPlayer({ sampleRate: 16000 });
    await q.connect();
    assert.equal(q.sampleRate, 16000);
    assert.deepEqual(made.map((o) => o.sampleRate), [12345, undefined, 24000, 16000]);
  } finally {
    [globalThis.AudioContext, globalThis.AudioWorkletNode] = saved;
  }
});

test("speak asks for the player's rate, or the server's native rate when it cannot send it",
  async () => {
    class NativeRateSocket extends ScriptedSocket {
      serverSays(obj) {
        super.serverSays(obj.type === "ready" ? { ...obj, sample_rate: 22050 } : obj);
      }
    }
    const player = (rate) => ({ sampleRate: rate, connect: async () => {}, announce() {},
                                addEventListener() {}, end() {}, write() {} });
    for (const [rate, asked] of [[24000, 24000], [48000, 48000], [96000, 22050]]) {
      const c = new RttsClient("ws://h/v1/stream", { player: player(rate),
                                                    WebSocket: NativeRateSocket });
      await c.open();
      c.speak(undefined, { contextId: `r${rate}` });
      assert.equal(ScriptedSocket.last.sent[0].sample_rate, asked);
    }
  });
