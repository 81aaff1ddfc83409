import { test } from "node:test";
import assert from "node:assert/strict";
import { buildFrame, parseFrame, pcm16ToFloat32, pickServerRate } from "../protocol.js";

test("frame header round trip, little endian", () => {
  const pcm = Int16Array.from([0, 1, -1, 32767, -32768]);
  const buf = buildFrame({ stream: 513, segment: 70000, sequence: 3 }, pcm);
  assert.equal(buf.byteLength, 12 + 10);
  const bytes = new Uint8Array(buf);
  assert.deepEqual([...bytes.slice(0, 4)], [1, 0, 1, 2]); // version, flags, stream LE
  const { header, pcm: out } = parseFrame(buf);
  assert.deepEqual(header, { version: 1, flags: 0, stream: 513, segment: 70000, sequence: 3 });
  assert.deepEqual([...out], [...pcm]);
});

test("frame produced by the Python server layout parses", () => {
  // struct.pack("<BBHII", 1, 0, 2, 5, 9) + int16 LE 1000
  const bytes = Uint8Array.from([1, 0, 2, 0, 5, 0, 0, 0, 9, 0, 0, 0, 0xe8, 0x03]);
  const { header, pcm } = parseFrame(bytes.buffer);
  assert.equal(header.stream, 2);
  assert.equal(header.segment, 5);
  assert.equal(header.sequence, 9);
  assert.equal(pcm[0], 1000);
});

test("bad frames are rejected", () => {
  assert.throws(() => parseFrame(new ArrayBuffer(4)), RangeError);
  const wrongVersion = new Uint8Array(14);
  wrongVersion[0] = 7;
  assert.throws(() => parseFrame(wrongVersion.buffer), /version/);
  const odd = new Uint8Array(13);
  odd[0] = 1;
  assert.throws(() => parseFrame(odd.buffer), /odd/);
});

test("pcm16 to float and server rate choice", () => {
  assert.deepEqual([...pcm16ToFloat32(Int16Array.from([16384, -32768]))], [0.5, -1]);
  assert.equal(pickServerRate(48000), 48000);
  assert.equal(pickServerRate(96000), 24000);
  assert.equal(pickServerRate(96000, 22050), 22050); // the server's native rate from `ready`
  assert.equal(pickServerRate(16000, 22050), 16000);
});
