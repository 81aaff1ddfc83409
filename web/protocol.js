// Pure helpers for the rtts wire protocol v1 (no DOM, no I/O): usable in browsers,
// workers and Node.

/** Bytes in the binary audio frame header. */
export const FRAME_HEADER_BYTES = 12;
export const PROTOCOL_VERSION = 1;

/**
 * @typedef {object} FrameHeader
 * @property {number} version  protocol version (1)
 * @property {number} flags    reserved (0)
 * @property {number} stream   the context's number on this connection
 * @property {number} segment  segment index within the context
 * @property {number} sequence frame index within the segment
 */

/**
 * Parse a binary audio frame: 12-byte little-endian header + PCM16 mono samples.
 * @param {ArrayBuffer} buffer
 * @returns {{header: FrameHeader, pcm: Int16Array}}
 */
export function parseFrame(buffer) {
  if (!(buffer instanceof ArrayBuffer) || buffer.byteLength < FRAME_HEADER_BYTES) {
    throw new RangeError("frame shorter than its 12-byte header");
  }
  const view = new DataView(buffer);
  const header = {
    version: view.getUint8(0),
    flags: view.getUint8(1),
    stream: view.getUint16(2, true),
    segment: view.getUint32(4, true),
    sequence: view.getUint32(8, true),
  };
  if (header.version !== PROTOCOL_VERSION) {
    throw new RangeError(`unsupported frame version ${header.version}`);
  }
  const bytes = buffer.byteLength - FRAME_HEADER_BYTES;
  if (bytes % 2 !== 0) throw new RangeError("PCM16 payload has an odd byte count");
  // Copy: the payload starts at byte 12, which is aligned for Int16Array.
  const pcm = new Int16Array(buffer.slice(FRAME_HEADER_BYTES));
  return { header, pcm };
}

/**
 * Build a frame (used by tests and by servers written in JS).
 * @param {FrameHeader} header
 * @param {Int16Array} pcm
 * @returns {ArrayBuffer}
 */
export function buildFrame(header, pcm) {
  const out = new ArrayBuffer(FRAME_HEADER_BYTES + pcm.byteLength);
  const view = new DataView(out);
  view.setUint8(0, header.version ?? PROTOCOL_VERSION);
  view.setUint8(1, header.flags ?? 0);
  view.setUint16(2, header.stream, true);
  view.setUint32(4, header.segment, true);
  view.setUint32(8, header.sequence, true);
  new Int16Array(out, FRAME_HEADER_BYTES).set(pcm);
  return out;
}

/**
 * PCM16 -> Float32 in [-1, 1).
 * @param {Int16Array} pcm
 * @returns {Float32Array}
 */
export function pcm16ToFloat32(pcm) {
  const out = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 32768;
  return out;
}

/** Sample rates the server can produce directly (no client-side resampling needed). */
export const SERVER_SAMPLE_RATES = [8000, 16000, 22050, 24000, 44100, 48000];

/**
 * Pick the rate to ask the server for: the AudioContext's own rate when the server
 * supports it, else the server's native rate (the worklet then resamples, linearly).
 * @param {number} contextRate
 * @param {number} [nativeRate=24000] the server's rate (`sample_rate` of its `ready` event)
 * @returns {number}
 */
export function pickServerRate(contextRate, nativeRate = 24000) {
  return SERVER_SAMPLE_RATES.includes(contextRate) ? contextRate : nativeRate;
}
