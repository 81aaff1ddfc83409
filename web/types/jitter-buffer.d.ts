/**
 * @typedef {object} JitterOptions
 * @property {number} sampleRate     output rate (the AudioContext's)
 * @property {number} [targetMs=60]  initial prebuffer before a stream starts
 * @property {number} [growMs=40]    added to the target after each underrun
 * @property {number} [maxMs=400]    largest target
 * @property {number} [fadeMs=5]     fade-out on interrupt (no click)
 */
export class JitterBuffer {
    /** @param {JitterOptions} options */
    constructor(options: JitterOptions);
    rate: number;
    targetMs: number;
    growMs: number;
    maxMs: number;
    fadeSamples: number;
    /** @type {Map<number, {chunks: Float32Array[], segs: number[], offset: number,
     *   buffered: number, ended: boolean, started: boolean, played: number,
     *   segments: Map<number, number>}>} */
    streams: Map<number, {
        chunks: Float32Array[];
        segs: number[];
        offset: number;
        buffered: number;
        ended: boolean;
        started: boolean;
        played: number;
        segments: Map<number, number>;
    }>;
    /** @type {number[]} play order */
    order: number[];
    underruns: number;
    playedTotal: number;
    fade: {
        stream: number;
        left: number;
    };
    dropped: Set<any>;
    /** @type {{stream: number, played: number, segments: Object<number, number>,
     *   reason: string}[]} streams that left the queue since the last drain */
    finished: {
        stream: number;
        played: number;
        segments: {
            [x: number]: number;
        };
        reason: string;
    }[];
    /** @param {number} stream */
    _stream(stream: number): {
        chunks: Float32Array[];
        segs: number[];
        offset: number;
        buffered: number;
        ended: boolean;
        started: boolean;
        played: number;
        segments: Map<number, number>;
    };
    /**
     * Queue samples for (stream, segment). Late chunks of an interrupted stream are ignored.
     * @param {number} stream @param {number} segment @param {Float32Array} samples
     */
    push(stream: number, segment: number, samples: Float32Array): void;
    /** No more audio will come for this stream. @param {number} stream */
    end(stream: number): void;
    /** Announce a stream so it takes its place in the play order before audio arrives. */
    announce(stream: any): void;
    /**
     * Stop a stream now: a short fade if it is playing, then drop everything it has.
     * @param {number} stream
     * @returns {{played: number, segments: Object<number, number>}} samples heard
     */
    interrupt(stream: number): {
        played: number;
        segments: {
            [x: number]: number;
        };
    };
    /**
     * Drop the queued audio of one segment of a stream (a chunk already playing finishes);
     * the stream goes on. Returns the samples dropped.
     * @param {number} stream @param {number} segment
     * @returns {number}
     */
    dropSegment(stream: number, segment: number): number;
    _remove(stream: any, reason: any): void;
    get bufferedMs(): number;
    /**
     * Fill `out` (one render quantum) and return how many samples were audio.
     * @param {Float32Array} out
     * @returns {number}
     */
    pull(out: Float32Array): number;
    _copy(s: any, out: any, at: any, want: any, gainStart: any, gainStep: any): number;
    _fadeOut(s: any, out: any, at: any): any;
    /** Samples heard per stream and segment (for playback position reporting). */
    positions(): {};
}
export type JitterOptions = {
    /**
     * output rate (the AudioContext's)
     */
    sampleRate: number;
    /**
     * initial prebuffer before a stream starts
     */
    targetMs?: number;
    /**
     * added to the target after each underrun
     */
    growMs?: number;
    /**
     * largest target
     */
    maxMs?: number;
    /**
     * fade-out on interrupt (no click)
     */
    fadeMs?: number;
};
