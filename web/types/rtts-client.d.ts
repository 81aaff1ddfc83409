/**
 * Connect to an rtts server and get a ready client.
 * @param {string} url e.g. "ws://localhost:8765/v1/stream"
 * @param {ConnectOptions} [options]
 * @returns {Promise<RttsClient>}
 */
export function connect(url: string, options?: ConnectOptions): Promise<RttsClient>;
export { PcmPlayer } from "./pcm-player.js";
/** One utterance (a server "context"): events `started`, `segment`, `done`, `ended`,
 * `cancelled`, `error`. */
export class Utterance extends EventTarget {
    /** @param {RttsClient} client @param {string} contextId */
    constructor(client: RttsClient, contextId: string);
    client: RttsClient;
    contextId: string;
    track: number;
    /** @type {number | null} server stream number, known at the first segment */
    stream: number | null;
    sampleRate: number;
    createdAt: number;
    /** @type {number | null} ms from speak() to the first audio frame */
    ttfaMs: number | null;
    /** @type {Array<{segment: number, text: string, textStart: number, textEnd: number,
     *   audioStartMs: number, durationMs: number | null, heardMs: number, cached: boolean}>} */
    segments: Array<{
        segment: number;
        text: string;
        textStart: number;
        textEnd: number;
        audioStartMs: number;
        durationMs: number | null;
        heardMs: number;
        cached: boolean;
    }>;
    state: string;
    audioMs: number;
    /** @type {Promise<{segments: number, audioMs: number}>} resolves on server `done` */
    done: Promise<{
        segments: number;
        audioMs: number;
    }>;
    _resolve: (value: {
        segments: number;
        audioMs: number;
    } | PromiseLike<{
        segments: number;
        audioMs: number;
    }>) => void;
    _reject: (reason?: any) => void;
    /** @type {Promise<{played: number, segments: Object<string, number>}>} playback over */
    ended: Promise<{
        played: number;
        segments: {
            [x: string]: number;
        };
    }>;
    _ended: (value: {
        played: number;
        segments: {
            [x: string]: number;
        };
    } | PromiseLike<{
        played: number;
        segments: {
            [x: string]: number;
        };
    }>) => void;
    _emit(type: any, detail: any): void;
    /** Stop this utterance now (server generation and local playback). */
    cancel(): Promise<{
        playedMs: number;
        segments: any[];
    }>;
    /** Append text (for utterances opened with `speak()` and no input). @param {string} text */
    write(text: string): void;
    /** Synthesize what is buffered now, without waiting for punctuation. */
    flush(): void;
    /** No more text: the server finishes the audio and `done` follows. */
    end(): void;
    /** How much of each segment was actually heard, in ms. */
    heard(): {
        playedMs: number;
        segments: {
            segment: number;
            text: string;
            heardMs: number;
        }[];
    };
}
export class RttsClient extends EventTarget {
    /** @param {string} url @param {ConnectOptions} [options] */
    constructor(url: string, options?: ConnectOptions);
    url: string;
    options: ConnectOptions;
    WebSocketImpl: {
        new (url: string | URL, protocols?: string | string[]): WebSocket;
        prototype: WebSocket;
        readonly CONNECTING: 0;
        readonly OPEN: 1;
        readonly CLOSING: 2;
        readonly CLOSED: 3;
    };
    /** @type {PcmPlayer | null} */
    player: PcmPlayer | null;
    /** @type {WebSocket | null} */
    ws: WebSocket | null;
    /** @type {Map<string, Utterance>} */
    utterances: Map<string, Utterance>;
    byStream: Map<any, any>;
    byTrack: Map<any, any>;
    server: any;
    state: string;
    _closedByUser: boolean;
    _attempt: number;
    /** Open the socket (and the audio player); resolves on the server's `ready`. */
    open(): Promise<void>;
    _connectOnce(): Promise<any>;
    _onClose(code: any, reason: any): void;
    _send(obj: any): void;
    /**
     * Speak text: a string, or an (async) iterable of text pieces such as LLM tokens.
     * With no input the utterance stays open: feed it with `write()`, then `end()`.
     * @param {string | Iterable<string> | AsyncIterable<string>} [input]
     * @param {SpeakOptions} [options]
     * @returns {Utterance}
     */
    speak(input?: string | Iterable<string> | AsyncIterable<string>, options?: SpeakOptions): Utterance;
    _feed(u: any, input: any): Promise<void>;
    /** Synthesize what is buffered for a context now. @param {string} contextId */
    flush(contextId: string): void;
    /**
     * Barge-in: stop a context now. Playback fades out within 5 ms, late frames are dropped.
     * @param {string} contextId
     * @returns {Promise<{playedMs: number, segments: Array}>} what was heard
     */
    cancel(contextId: string): Promise<{
        playedMs: number;
        segments: any[];
    }>;
    /** Close the connection for good (no reconnect). */
    close(): Promise<void>;
    _onFrame(buffer: any): void;
    _onEvent(msg: any): void;
    _fail(u: any, err: any): void;
    _onFinished(info: any): void;
}
export type SpeakOptions = {
    /**
     * defaults to a fresh id
     */
    contextId?: string;
    /**
     * "seed:N" or a ChatTTS speaker embedding string
     */
    voice?: string;
    seed?: number;
    temperature?: number;
    top_P?: number;
    top_K?: number;
    /**
     * 0-9
     */
    speed?: number;
    refine?: boolean;
    /**
     * characters before each chunk may be cut
     */
    chunkSchedule?: number[];
    idleFlushMs?: number;
    /**
     * false: never serve or store this utterance in the phrase cache
     */
    cache?: boolean;
};
export type ConnectOptions = {
    /**
     * play audio through a PcmPlayer
     */
    play?: boolean;
    /**
     * bring your own player
     */
    player?: PcmPlayer;
    /**
     * used when the client creates the player
     */
    audioContext?: AudioContext;
    /**
     * rate to request, and the rate of the AudioContext
     * the client's player creates (default: 24000, the server's native rate, so neither side
     * resamples; with `audioContext`, the default is that context's rate)
     */
    sampleRate?: number;
    reconnect?: {
        retries?: number;
        baseDelayMs?: number;
        maxDelayMs?: number;
    };
    /**
     * WebSocket implementation (Node, tests)
     */
    WebSocket?: typeof WebSocket;
    /**
     * params applied to every speak()
     */
    defaults?: SpeakOptions;
    /**
     * short-lived browser token from your
     * backend (GET /v1/token with the API key); a function is called before each (re)connect
     */
    token?: string | (() => Promise<string>);
};
import { PcmPlayer } from "./pcm-player.js";
export { parseFrame, buildFrame, pcm16ToFloat32 } from "./protocol.js";
