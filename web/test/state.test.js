// The client's connection state machine against a scripted socket: every public call in
// every state (connecting, open, reconnecting, closed), queueing, deadlines, backoff that
// does not give up, wake-ups, playback reports, and that no path leaves a player track
// (or a promise) hanging or rejects unhandled.
import { test, beforeEach, afterEach } from "node:test";
import assert from "node:assert/strict";
import { RttsClient } from "../rtts-client.js";
import { buildFrame } from "../protocol.js";

const tick = (ms = 0) => new Promise((r) => setTimeout(r, ms));

/** What the scripted server does with each new socket, in order; then `fallback`. */
class Script {
  constructor() {
    this.plan = [];
    this.fallback = "accept";
    this.sockets = [];
  }
  socketClass() {
    const script = this;
    return class ScriptedSocket {
      constructor(url) {
        this.url = url;
        this.sent = [];
        this.readyState = 0;
        this.closedByClient = null;
        script.sockets.push(this);
        const mode = script.plan.length ? script.plan.shift() : script.fallback;
        setTimeout(() => {
          if (mode === "accept") {
            this.readyState = 1;
            this.serverSays({ type: "ready", protocol: 1, engine: "fake", sample_rate: 24000 });
          } else if (mode === "refuse") {
            this.readyState = 3;
            this.onclose?.({ code: 1006, reason: "" });
          } // "hang": nothing happens
        }, 1);
      }
      send(data) {
        if (this.readyState !== 1) throw new Error("InvalidStateError");
        this.sent.push(JSON.parse(data));
      }
      close(code) {
        this.closedByClient = code ?? 1005;
        this.readyState = 3;
      }
      serverSays(obj) { this.onmessage?.({ data: JSON.stringify(obj) }); }
      serverFrame(buf) { this.onmessage?.({ data: buf }); }
      drop(code = 1006) {
        this.readyState = 3;
        this.onclose?.({ code, reason: "" });
      }
    };
  }
  get last() { return this.sockets[this.sockets.length - 1]; }
}

/** A player stand-in that records what the client asks of it. */
class FakePlayer extends EventTarget {
  constructor() {
    super();
    this.sampleRate = 24000;
    this.calls = [];
    this.open = new Set(); // announced tracks not yet ended or interrupted
  }
  async connect() {}
  announce(track) { this.calls.push(["announce", track]); this.open.add(track); }
  write(track) { this.calls.push(["write", track]); }
  end(track) {
    this.calls.push(["end", track]);
    this.open.delete(track);
    setTimeout(() => this.dispatchEvent(new CustomEvent("finished", {
      detail: { stream: track, played: 0, segments: {}, reason: "ended" } })), 1);
  }
  async interrupt(track) {
    this.calls.push(["interrupt", track]);
    this.open.delete(track);
    return { played: 4800, segments: { 0: 4800 } };
  }
  stats(positions) {
    this.dispatchEvent(new CustomEvent("stats", { detail: { positions, bufferedMs: 120 } }));
  }
  async close() {}
}

/** A window stand-in for `online` and `visibilitychange`. */
function fakeWindow() {
  const win = new EventTarget();
  win.document = new EventTarget();
  win.document.visibilityState = "visible";
  return win;
}

let rejections;
const onRejection = (reason) => rejections.push(reason);
beforeEach(() => {
  rejections = [];
  process.on("unhandledRejection", onRejection);
});
afterEach(async () => {
  await tick(5);
  process.off("unhandledRejection", onRejection);
  assert.deepEqual(rejections, [], "no unhandled rejections");
});

function makeClient(script, extra = {}) {
  const player = new FakePlayer();
  const client = new RttsClient("ws://h/v1/stream", {
    WebSocket: script.socketClass(), player, window: fakeWindow(),
    reconnect: { baseDelayMs: 2, maxDelayMs: 10, ...(extra.reconnect ?? {}) },
    cancelReplyMs: 50, ...extra });
  return { client, player };
}

async function until(pred, ms = 2000) {
  const t0 = Date.now();
  while (!pred()) {
    if (Date.now() - t0 > ms) throw new Error("timed out waiting");
    await tick(1);
  }
}

test("connecting: speak/write/flush/end are queued and sent in order on ready", async () => {
  const script = new Script();
  script.plan = ["hang"];
  const { client } = makeClient(script, { reconnect: { connectTimeoutMs: 30 } });
  const opened = client.open();
  await tick(2);
  assert.equal(client.state, "connecting");
  const u = client.speak(undefined, { contextId: "q1", voice: "seed:1" });
  assert.equal(u.state, "queued");
  u.write("Hello ");
  u.write("world.");
  u.flush();
  u.end();
  const v = client.speak("Second.", { contextId: "q2" });
  await opened; // the hung attempt timed out; the next one was accepted
  assert.equal(client.state, "open");
  const sent = script.last.sent.map((m) => `${m.type}:${m.context_id}`);
  assert.deepEqual(sent, ["start:q1", "text:q1", "flush:q1", "end:q1",
                          "start:q2", "text:q2", "end:q2"]);
  assert.equal(script.last.sent[1].text, "Hello world."); // pieces merged while queued
  assert.equal(u.state, "open");
  assert.equal(v.state, "open");
  await client.close();
});

test("open: every call goes straight to the socket; close fails what is open", async () => {
  const script = new Script();
  const { client, player } = makeClient(script);
  await client.open();
  const ws = script.last;
  const u = client.speak(undefined, { contextId: "o1" });
  u.write("Hi.");
  client.flush("o1");
  u.end();
  assert.deepEqual(ws.sent.map((m) => m.type), ["start", "text", "flush", "end"]);
  assert.equal(await client.reconnect(), true); // no-op when open
  assert.equal(script.sockets.length, 1);
  const errors = [];
  u.addEventListener("error", (e) => errors.push(e.detail.code));
  await client.close();
  assert.equal(ws.closedByClient, 1000);
  assert.equal(client.state, "closed");
  assert.deepEqual(errors, ["closed"]);
  await assert.rejects(u.done, /client closed/);
  await u.ended; // settles
  assert.equal(player.open.size, 0, "no track left waiting");
  assert.equal(await client.reconnect(), false); // closed for good after close()
  await client.close(); // idempotent
});

test("reconnecting (resume off): a drop fails open utterances, queues new ones, backoff "
  + "never gives up", async () => {
    const script = new Script();
    const { client, player } = makeClient(script, { resume: false });
    await client.open();
    const a = client.speak("Before the drop.", { contextId: "a" });
    script.last.serverSays({ type: "segment_started", context_id: "a", stream: 1,
                             segment: 0, text: "Before the drop.", text_start: 0,
                             text_end: 16, audio_start_ms: 0 });
    script.last.serverFrame(buildFrame({ stream: 1, segment: 0, sequence: 0 },
                                       new Int16Array(240)));
    script.fallback = "refuse";
    const states = [];
    client.addEventListener("statechange", (e) => states.push(e.detail.state));
    script.last.drop(1006);
    assert.equal(client.state, "reconnecting");
    await assert.rejects(a.done, (err) => err.code === "disconnected");
    assert.ok(player.calls.some(([k, t]) => k === "end" && t === a.track)); // plays out, ends
    // 30 refused attempts in a row: still trying (retries default to forever)
    await until(() => script.sockets.length >= 31);
    assert.equal(client.state, "reconnecting");
    assert.ok(client.retryAt === null || client.retryAt >= Date.now() - 50);
    // calls while reconnecting
    const b = client.speak("During the outage.", { contextId: "b" });
    assert.equal(b.state, "queued");
    b.flush(); // after the string's end: ignored (the server would refuse it)
    client.flush("b");
    const c = client.speak(undefined, { contextId: "c" });
    const heard = await client.cancel("c"); // a queued utterance: dropped, track freed
    assert.equal(c.state, "cancelled");
    assert.equal(heard.textSpoken, undefined);
    assert.ok(player.calls.some(([k, t]) => k === "interrupt" && t === c.track));
    script.fallback = "accept";
    await until(() => client.state === "open");
    const sent = script.last.sent.map((m) => `${m.type}:${m.context_id}`);
    assert.deepEqual(sent, ["start:b", "text:b", "end:b"]);
    // a frame for stream 1 on the new connection is not the old utterance's
    script.last.serverFrame(buildFrame({ stream: 1, segment: 0, sequence: 0 },
                                       new Int16Array(240)));
    assert.equal(player.calls.filter(([k, t]) => k === "write" && t === a.track).length, 1);
    assert.ok(states.includes("reconnecting") && states.at(-1) === "open");
    await client.close();
  });

test("reconnecting: a queued utterance past its deadline fails and frees its track",
  async () => {
    const script = new Script();
    const { client, player } = makeClient(script, { queue: { deadlineMs: 30 },
                                                     reconnect: { baseDelayMs: 1000,
                                                                  maxDelayMs: 1000 } });
    await client.open();
    script.fallback = "refuse";
    script.last.drop(1001);
    const u = client.speak("Nobody will hear this.");
    const failed = new Promise((r) => u.addEventListener("error", (e) => r(e.detail)));
    const err = await failed;
    assert.equal(err.code, "not_connected");
    assert.equal(u.state, "error");
    await u.ended;
    assert.ok(player.calls.some(([k, t]) => k === "interrupt" && t === u.track));
    assert.equal(player.open.size, 0);
    await client.close();
  });

test("the queue is bounded: the utterance that overflows it fails", async () => {
  const script = new Script();
  script.plan = ["hang"];
  const { client } = makeClient(script, { queue: { maxMessages: 3 },
                                          reconnect: { connectTimeoutMs: 1000 } });
  client.open().catch(() => {});
  await tick(2);
  const u = client.speak(undefined, { contextId: "big" });
  u.write("one");
  u.flush(); // 3 messages: start, text, flush
  const codes = [];
  u.addEventListener("error", (e) => codes.push(e.detail.code));
  u.end(); // the 4th
  assert.deepEqual(codes, ["queue_full"]);
  assert.equal(client._queued, 0);
  await client.close();
});

test("closed: speak fails at once (after it returns), write/end/cancel are harmless",
  async () => {
    const script = new Script();
    script.fallback = "refuse";
    const { client, player } = makeClient(script, { reconnect: { retries: 2 } });
    await assert.rejects(client.open(), /retries exhausted/);
    assert.equal(client.state, "closed");
    assert.equal(client.closedReason, "retries exhausted");
    assert.equal(script.sockets.length, 3); // the first attempt and 2 retries
    const u = client.speak("Too late.");
    const errors = [];
    u.addEventListener("error", (e) => errors.push(e.detail.code)); // attached after speak
    u.write("more");
    u.flush();
    u.end();
    await assert.rejects(u.done, (err) => err.code === "not_connected");
    assert.deepEqual(errors, ["not_connected"]);
    assert.equal((await client.cancel(u.contextId)).playedMs, 0);
    assert.equal(u.state, "error");
    assert.equal(player.open.size, 0);
    // reconnect() starts again from closed
    script.fallback = "accept";
    assert.equal(await client.reconnect(), true);
    assert.equal(client.state, "open");
    const v = client.speak("Back.");
    assert.equal(v.state, "open");
    await client.close();
  });

test("a permanent close code goes to closed; reconnect() is the way back", async () => {
  const script = new Script();
  const { client } = makeClient(script);
  await client.open();
  script.last.drop(1008);
  assert.equal(client.state, "closed");
  assert.match(client.closedReason, /1008/);
  assert.equal(await client.reconnect(), true);
  await client.close();
});

test("online and visible tab reconnect at once instead of waiting out the backoff",
  async () => {
    const script = new Script();
    const win = fakeWindow();
    const { client } = makeClient(script, { window: win,
                                            reconnect: { baseDelayMs: 60000,
                                                         maxDelayMs: 60000 } });
    await client.open();
    script.fallback = "refuse";
    script.last.drop(1006);
    await until(() => client.state === "reconnecting" && client.retryAt !== null);
    const n = script.sockets.length;
    win.dispatchEvent(new Event("online"));
    await until(() => script.sockets.length === n + 1); // immediately, not in 30-60 s
    await until(() => !client._connecting);
    script.fallback = "accept";
    win.document.visibilityState = "hidden";
    win.document.dispatchEvent(new Event("visibilitychange"));
    await tick(5);
    assert.equal(script.sockets.length, n + 1); // hidden: no attempt
    win.document.visibilityState = "visible";
    win.document.dispatchEvent(new Event("visibilitychange"));
    await until(() => client.state === "open");
    await client.close();
  });

test("a failing token function is one failed attempt, retried", async () => {
  const script = new Script();
  let calls = 0;
  const { client } = makeClient(script, {
    token: async () => {
      calls += 1;
      if (calls < 3) throw new Error("backend down");
      return "tok";
    } });
  await client.open();
  assert.equal(calls, 3);
  assert.match(script.last.url, /token=tok$/);
  await client.close();
});

test("playback reports follow the player, rate-limited; cancel reports then cancels",
  async () => {
    const script = new Script();
    const { client, player } = makeClient(script, { reportEveryMs: 20 });
    await client.open();
    const ws = script.last;
    const u = client.speak("Report me.", { contextId: "p", timings: true });
    assert.equal(ws.sent[0].timings, true);
    player.stats({ [u.track]: { played: 2400, segments: { 0: 2400 } } });
    player.stats({ [u.track]: { played: 4800, segments: { 0: 4800 } } }); // too soon
    await tick(25);
    player.stats({ [u.track]: { played: 7200, segments: { 0: 7200 } } });
    const reports = ws.sent.filter((m) => m.type === "playback");
    assert.deepEqual(reports.map((m) => m.played_ms), [100, 300]);
    assert.equal(reports[0].buffered_ms, 120);
    const cancelled = client.cancel("p");
    await tick(2);
    const tail = ws.sent.slice(-2);
    assert.deepEqual(tail.map((m) => m.type), ["playback", "cancel"]);
    assert.equal(tail[0].played_ms, 200); // what the interrupt says was heard (4800 samples)
    ws.serverSays({ type: "cancelled", context_id: "p", heard_ms: 200, heard_source: "reported",
                    text_spoken: "Report", text_remaining: " me." });
    const heard = await cancelled;
    assert.equal(heard.textSpoken, "Report");
    assert.equal(heard.textRemaining, " me.");
    assert.equal(heard.playedMs, 200);
    assert.deepEqual(await u.done, { segments: 0, audioMs: 0, cancelled: true });
    assert.equal(await u.cancel(), heard); // a second cancel: the same answer
    await client.close();
  });

test("cancel without a server reply resolves with the local figures after cancelReplyMs",
  async () => {
    const script = new Script();
    const { client } = makeClient(script);
    await client.open();
    const u = client.speak("Quiet server.");
    const t0 = Date.now();
    const heard = await u.cancel();
    assert.ok(Date.now() - t0 < 1000);
    assert.equal(heard.playedMs, 200);
    assert.equal(heard.textSpoken, undefined);
    await client.close();
  });

test("ten cancel-then-speak rounds leave no track open and nothing queued", async () => {
  const script = new Script();
  const { client, player } = makeClient(script);
  await client.open();
  let u = null;
  for (let i = 0; i < 10; i++) {
    if (u) await client.cancel(u.contextId);
    u = client.speak(`Round ${i}.`);
  }
  script.last.serverSays({ type: "done", context_id: u.contextId, segments: 1, audio_ms: 10 });
  await u.done;
  await u.ended;
  assert.equal(player.open.size, 0);
  assert.equal(client.utterances.size, 0);
  await client.close();
});

test("a drop mid-utterance resumes it on the next connection from the first segment not "
  + "received whole, with utterance-level segments, offsets and reports", async () => {
  const script = new Script();
  const { client, player } = makeClient(script);
  player.dropped = [];
  player.dropSegment = (track, seg) => player.dropped.push([track, seg]);
  await client.open();
  const text = "First sentence here. Second one. Third and last.";
  const u = client.speak(undefined, { contextId: "r", voice: "seed:4", timings: true });
  u.write("First sentence here. Second one.");
  u.write(" Third and last.");
  u.end();
  const ws1 = script.last;
  const seg = (ws, n, start, end, audioStart) => ws.serverSays({
    type: "segment_started", context_id: "r", stream: 3, segment: n,
    text: text.slice(start, end), text_start: start, text_end: end,
    audio_start_ms: audioStart });
  seg(ws1, 0, 0, 20, 0);
  ws1.serverFrame(buildFrame({ stream: 3, segment: 0, sequence: 0 }, new Int16Array(2400)));
  ws1.serverSays({ type: "segment_done", context_id: "r", segment: 0, text_start: 0,
                   text_end: 20, audio_start_ms: 0, duration_ms: 1000 });
  seg(ws1, 1, 21, 32, 1000); // audio of it arrives in part: said again after the drop
  ws1.serverFrame(buildFrame({ stream: 3, segment: 1, sequence: 0 }, new Int16Array(2400)));
  const events = [];
  u.addEventListener("resuming", (e) => events.push(["resuming", e.detail]));
  u.addEventListener("resumed", (e) => events.push(["resumed", e.detail]));
  script.plan = ["refuse"];
  ws1.drop(1006); // the instance died
  assert.equal(u.state, "queued");
  assert.deepEqual(player.dropped, [[u.track, 1]]); // its unplayed audio is dropped
  u.flush(); // ignored after end(); harmless
  await until(() => client.state === "open");
  const ws2 = script.last;
  assert.notEqual(ws2, ws1);
  assert.equal(u.state, "open");
  assert.deepEqual(ws2.sent.map((m) => m.type), ["start", "text", "end"]);
  assert.equal(ws2.sent[0].voice, "seed:4"); // the same params
  assert.equal(ws2.sent[0].context_id, "r");
  assert.equal(ws2.sent[1].text, " Second one. Third and last."); // from code point 20
  assert.deepEqual(events.map(([k]) => k), ["resuming", "resumed"]);
  assert.equal(events[0][1].from, 20);
  // the new context's segment 0 is the utterance's segment 2, its offsets shifted by 20
  ws2.serverSays({ type: "segment_started", context_id: "r", stream: 1, segment: 0,
                   text: " Second one.", text_start: 0, text_end: 12, audio_start_ms: 0 });
  ws2.serverFrame(buildFrame({ stream: 1, segment: 0, sequence: 0 }, new Int16Array(240)));
  assert.deepEqual(u.segments.map((s) => [s.segment, s.textStart, s.textEnd, s.audioStartMs]),
                   [[0, 0, 20, 0], [2, 20, 32, 1000]]);
  // playback reports are of the new context's audio: 1000 ms before it
  player.stats({ [u.track]: { played: 36000, segments: { 0: 24000, 2: 12000 } } });
  const report = ws2.sent.find((m) => m.type === "playback");
  assert.equal(report.played_ms, 500);
  ws2.serverSays({ type: "done", context_id: "r", segments: 2, audio_ms: 2000 });
  const done = await u.done;
  assert.deepEqual(done, { segments: 4, audioMs: 3000 });
  assert.equal(u.resumes, 1);
  await client.close();
});

test("a resumed utterance that cannot reconnect in time fails and plays out what it has",
  async () => {
    const script = new Script();
    const { client, player } = makeClient(script, { queue: { deadlineMs: 30 },
                                                     reconnect: { baseDelayMs: 1000,
                                                                  maxDelayMs: 1000 } });
    await client.open();
    const u = client.speak("Hello there.", { contextId: "x" });
    script.last.serverSays({ type: "segment_started", context_id: "x", stream: 1,
                             segment: 0, text: "Hello there.", text_start: 0, text_end: 12,
                             audio_start_ms: 0 });
    script.last.serverFrame(buildFrame({ stream: 1, segment: 0, sequence: 0 },
                                       new Int16Array(240)));
    script.fallback = "refuse";
    script.last.drop(1001); // drained past its grace
    await assert.rejects(u.done, (err) => err.code === "disconnected");
    assert.ok(player.calls.some(([k, t]) => k === "end" && t === u.track));
    assert.ok(!player.calls.some(([k, t]) => k === "interrupt" && t === u.track));
    await client.close();
  });

test("a permanent close or close() does not resume", async () => {
  const script = new Script();
  const { client } = makeClient(script);
  await client.open();
  const u = client.speak("Hello there.", { contextId: "p" });
  script.last.drop(1008);
  await assert.rejects(u.done, (err) => err.code === "disconnected");
  assert.equal(client.state, "closed");
  await client.close();
});
