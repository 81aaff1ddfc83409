/**
 * An AudioContext at `sampleRate` where the browser allows it, else at the device's rate.
 * @param {number} sampleRate
 * @returns {AudioContext}
 */
export function createAudioContext(sampleRate: number): AudioContext;
/**
 * @typedef {object} PlayerOptions
 * @property {AudioContext} [audioContext] reuse an existing context
 * @property {number} [sampleRate=24000] rate of the AudioContext the player creates: the
 *   stream's rate (the server's native rate, so nobody resamples in JavaScript; the browser
 *   converts to the device rate itself). Falls back to the device's rate where the browser
 *   refuses it.
 * @property {number} [targetMs=60]  prebuffer before a track starts (grows after underruns)
 * @property {number} [maxMs=400]    largest prebuffer
 * @property {number} [fadeMs=5]     fade-out on interrupt
 * @property {number} [interruptTimeoutMs=500] `interrupt()` resolves from the last stats
 *   if the worklet does not answer by then (a suspended context)
 */
/**
 * @typedef {object} PlayerStats
 * @property {number} calls        render quanta processed
 * @property {number} nonSilent    render quanta with audible output
 * @property {number} samplesOut   audible samples output
 * @property {number} underruns
 * @property {number} bufferedMs
 * @property {number} targetMs     current jitter-buffer target
 * @property {number} level        peak of the last quantum
 * @property {Object<string, {played: number, segments: Object<string, number>}>} positions
 * @property {Object<string, number>} afterInterrupt audible samples played after interrupt
 * @property {number} resampled    input samples that went through the worklet's linear
 *   fallback resampler (0 when the server sends at the context's rate)
 */
/** The server's native rate (ChatTTS): what the player's own AudioContext runs at. */
export const DEFAULT_CONTEXT_RATE: 24000;
export class PcmPlayer extends EventTarget {
    /** @param {PlayerOptions} [options] */
    constructor(options?: PlayerOptions);
    options: PlayerOptions;
    /** @type {AudioContext | null} */
    context: AudioContext | null;
    /** @type {AudioWorkletNode | null} */
    node: AudioWorkletNode | null;
    /** @type {AnalyserNode | null} */
    analyser: AnalyserNode | null;
    /** @type {PlayerStats | null} */
    stats: PlayerStats | null;
    _pending: Map<any, any>;
    _nextId: number;
    /** Create the context (if needed), load the worklet, start output. */
    connect(): Promise<void>;
    /** @returns {number} */
    get sampleRate(): number;
    _onMessage(msg: any): void;
    /** Reserve a track's place in the play order before its audio arrives. */
    announce(track: any): void;
    /**
     * Queue PCM16 samples for a track's segment.
     * @param {number} track @param {number} segment @param {Int16Array} pcm
     * @param {number} rate sample rate of `pcm`
     */
    write(track: number, segment: number, pcm: Int16Array, rate: number): void;
    /** No more audio for this track. */
    end(track: any): void;
    /**
     * Drop the audio of one segment of a track not yet played (the track goes on): the
     * client does it to a segment cut off by a dropped connection, which it says again.
     * @param {number} track @param {number} segment
     */
    dropSegment(track: number, segment: number): void;
    /**
     * Stop a track now (5 ms fade) and drop its queued and late audio.
     * @param {number} track
     * @returns {Promise<{played: number, segments: Object<string, number>}>} samples heard
     */
    interrupt(track: number): Promise<{
        played: number;
        segments: {
            [x: string]: number;
        };
    }>;
    /** Current output level in [0, 1] (for meters). */
    level(): number;
    close(): Promise<void>;
}
export type PlayerOptions = {
    /**
     * reuse an existing context
     */
    audioContext?: AudioContext;
    /**
     * rate of the AudioContext the player creates: the
     * stream's rate (the server's native rate, so nobody resamples in JavaScript; the browser
     * converts to the device rate itself). Falls back to the device's rate where the browser
     * refuses it.
     */
    sampleRate?: number;
    /**
     * prebuffer before a track starts (grows after underruns)
     */
    targetMs?: number;
    /**
     * largest prebuffer
     */
    maxMs?: number;
    /**
     * fade-out on interrupt
     */
    fadeMs?: number;
    /**
     * `interrupt()` resolves from the last stats
     * if the worklet does not answer by then (a suspended context)
     */
    interruptTimeoutMs?: number;
};
export type PlayerStats = {
    /**
     * render quanta processed
     */
    calls: number;
    /**
     * render quanta with audible output
     */
    nonSilent: number;
    /**
     * audible samples output
     */
    samplesOut: number;
    underruns: number;
    bufferedMs: number;
    /**
     * current jitter-buffer target
     */
    targetMs: number;
    /**
     * peak of the last quantum
     */
    level: number;
    positions: {
        [x: string]: {
            played: number;
            segments: {
                [x: string]: number;
            };
        };
    };
    /**
     * audible samples played after interrupt
     */
    afterInterrupt: {
        [x: string]: number;
    };
    /**
     * input samples that went through the worklet's linear
     * fallback resampler (0 when the server sends at the context's rate)
     */
    resampled: number;
};
