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
export function parseFrame(buffer: ArrayBuffer): {
    header: FrameHeader;
    pcm: Int16Array;
};
/**
 * Build a frame (used by tests and by servers written in JS).
 * @param {FrameHeader} header
 * @param {Int16Array} pcm
 * @returns {ArrayBuffer}
 */
export function buildFrame(header: FrameHeader, pcm: Int16Array): ArrayBuffer;
/**
 * PCM16 -> Float32 in [-1, 1).
 * @param {Int16Array} pcm
 * @returns {Float32Array}
 */
export function pcm16ToFloat32(pcm: Int16Array): Float32Array;
/**
 * Pick the rate to ask the server for: the AudioContext's own rate when the server
 * supports it, else the server's native rate (the worklet then resamples, linearly).
 * @param {number} contextRate
 * @param {number} [nativeRate=24000] the server's rate (`sample_rate` of its `ready` event)
 * @returns {number}
 */
export function pickServerRate(contextRate: number, nativeRate?: number): number;
/** Bytes in the binary audio frame header. */
export const FRAME_HEADER_BYTES: 12;
export const PROTOCOL_VERSION: 1;
/** Sample rates the server can produce directly (no client-side resampling needed). */
export const SERVER_SAMPLE_RATES: number[];
export type FrameHeader = {
    /**
     * protocol version (1)
     */
    version: number;
    /**
     * reserved (0)
     */
    flags: number;
    /**
     * the context's number on this connection
     */
    stream: number;
    /**
     * segment index within the context
     */
    segment: number;
    /**
     * frame index within the segment
     */
    sequence: number;
};
