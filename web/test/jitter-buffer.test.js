import { test } from "node:test";
import assert from "node:assert/strict";
import { JitterBuffer } from "../jitter-buffer.js";
import { LinearResampler } from "../resampler.js";

const RATE = 1000; // 1 sample per ms keeps the arithmetic readable
const ones = (n, v = 1) => new Float32Array(n).fill(v);
const quantum = () => new Float32Array(10);

function drain(jb, quanta) {
  const out = [];
  for (let i = 0; i < quanta; i++) {
    const q = quantum();
    jb.pull(q);
    out.push(...q);
  }
  return out;
}

test("prebuffers to the target before starting", () => {
  const jb = new JitterBuffer({ sampleRate: RATE, targetMs: 30 });
  jb.push(1, 0, ones(20));
  assert.deepEqual(drain(jb, 1), new Array(10).fill(0)); // 20 < 30: waiting
  jb.push(1, 0, ones(20));
  assert.equal(drain(jb, 1).filter((x) => x === 1).length, 10);
});

test("an ended stream starts at once even below the target", () => {
  const jb = new JitterBuffer({ sampleRate: RATE, targetMs: 100 });
  jb.push(1, 0, ones(5));
  jb.end(1);
  const out = drain(jb, 1);
  assert.equal(out.filter((x) => x === 1).length, 5);
  assert.equal(jb.finished[0].reason, "ended");
  assert.equal(jb.finished[0].played, 5);
});

test("gapless across segments and streams, in announce order", () => {
  const jb = new JitterBuffer({ sampleRate: RATE, targetMs: 0 });
  jb.announce(1);
  jb.announce(2);
  jb.push(2, 0, ones(10, 0.2)); // stream 2 audio arrives first
  jb.push(1, 0, ones(7, 0.5));
  jb.push(1, 1, ones(8, 0.6));
  jb.end(1);
  jb.end(2);
  const out = drain(jb, 3);
  assert.deepEqual(out.slice(0, 25), [...ones(7, 0.5), ...ones(8, 0.6), ...ones(10, 0.2)]
    .map((x) => Math.fround(x)));
  assert.deepEqual(jb.finished.map((f) => f.stream), [1, 2]);
  assert.deepEqual(jb.finished[0].segments, { 0: 7, 1: 8 });
});

test("underrun counts, grows the target and rebuffers", () => {
  const jb = new JitterBuffer({ sampleRate: RATE, targetMs: 10, growMs: 20, maxMs: 35 });
  jb.push(1, 0, ones(10));
  drain(jb, 1); // plays 10
  drain(jb, 1); // empty, not ended: underrun
  assert.equal(jb.underruns, 1);
  assert.equal(jb.targetMs, 30);
  jb.push(1, 0, ones(20));
  assert.equal(drain(jb, 1).filter((x) => x > 0).length, 0); // 20 < 30: rebuffering
  jb.push(1, 0, ones(20));
  assert.ok(drain(jb, 1).filter((x) => x > 0).length === 10);
  drain(jb, 4);
  drain(jb, 1);
  assert.equal(jb.targetMs, 35); // capped at maxMs
});

test("interrupt fades out within fadeMs and drops the rest and late chunks", () => {
  const jb = new JitterBuffer({ sampleRate: RATE, targetMs: 0, fadeMs: 5 });
  jb.push(1, 0, ones(100));
  drain(jb, 1);
  const heard = jb.interrupt(1);
  assert.equal(heard.played, 10);
  const out = drain(jb, 2);
  const audible = out.filter((x) => x > 0);
  assert.ok(audible.length <= 5, `faded over ${audible.length} samples`);
  for (let i = 1; i < audible.length; i++) assert.ok(audible[i] < audible[i - 1]); // a ramp
  jb.push(1, 0, ones(50)); // a late frame
  assert.deepEqual(drain(jb, 2), new Array(20).fill(0));
  assert.equal(jb.finished.at(-1).reason, "interrupted");
});

test("interrupting a queued stream leaves the playing one alone", () => {
  const jb = new JitterBuffer({ sampleRate: RATE, targetMs: 0 });
  jb.push(1, 0, ones(30, 0.5));
  jb.push(2, 0, ones(30, 0.9));
  jb.interrupt(2);
  jb.end(1);
  const out = drain(jb, 4);
  assert.equal(out.filter((x) => x === 0.5).length, 30);
  assert.equal(out.filter((x) => Math.abs(x - 0.9) < 1e-6).length, 0);
});

test("linear resampler: chunked equals whole, length follows the ratio", () => {
  const input = Float32Array.from({ length: 2400 }, (_, i) => Math.sin(i / 10));
  const whole = new LinearResampler(24000, 48000).process(input);
  const r = new LinearResampler(24000, 48000);
  const parts = [];
  for (let i = 0; i < input.length; i += 97) parts.push(...r.process(input.subarray(i, i + 97)));
  assert.ok(Math.abs(whole.length - 4800) <= 2);
  assert.equal(parts.length, whole.length);
  for (let i = 0; i < whole.length; i++) assert.ok(Math.abs(parts[i] - whole[i]) < 1e-6);
  const down = new LinearResampler(48000, 16000).process(input);
  assert.ok(Math.abs(down.length - 800) <= 1);
});
