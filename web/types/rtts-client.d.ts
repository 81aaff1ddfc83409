/**
 * Connect to an rtts server and get a ready client (waits out an outage, see `open()`).
 * @param {string} url e.g. "ws://localhost:8765/v1/stream"
 * @param {ConnectOptions} [options]
 * @returns {Promise<RttsClient>}
 */
export function connect(url: string, options?: ConnectOptions): Promise<RttsClient>;
export { PcmPlayer } from "./pcm-player.js";
/**
 * @typedef {object} Heard
 * @property {number} playedMs   what the player really played of this utterance
 * @property {Array<{segment: number, text: string, heardMs: number}>} segments
 * @property {number} [heardMs]        the server's figure (from the playback reports)
 * @property {string} [textSpoken]     the input up to the last heard character (server)
 * @property {string} [textRemaining]  the rest of the input (server)
 */
/** One utterance (a server "context"): events `started`, `segment_started`, `segment`,
 * `audio`, `done`, `ended`, `cancelled`, `error`. `state`: `queued` (waiting for the
 * connection), `open`, `done`, `cancelled`, `error`. */
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
    /** @type {Array<{segment: number, text: string, spoken: string, textStart: number,
     *   textEnd: number, audioStartMs: number, durationMs: number | null, heardMs: number,
     *   cached: boolean}>} */
    segments: Array<{
        segment: number;
        text: string;
        spoken: string;
        textStart: number;
        textEnd: number;
        audioStartMs: number;
        durationMs: number | null;
        heardMs: number;
        cached: boolean;
    }>;
    /** @type {"queued" | "open" | "done" | "cancelled" | "error"} */
    state: "queued" | "open" | "done" | "cancelled" | "error";
    audioMs: number;
    /** @type {Promise<{segments: number, audioMs: number, cancelled?: boolean}>} resolves
     * on the server's `done` (or on cancel, with `cancelled: true`); rejects on error */
    done: Promise<{
        segments: number;
        audioMs: number;
        cancelled?: boolean;
    }>;
    _resolve: (value: {
        segments: number;
        audioMs: number;
        cancelled?: boolean;
    } | PromiseLike<{
        segments: number;
        audioMs: number;
        cancelled?: boolean;
    }>) => void;
    _reject: (reason?: any) => void;
    /** @type {Promise<{played: number, segments: Object<string, number>}>} playback over
     * (always settles: ended, cancelled or failed) */
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
    /** @type {Array<object>} messages waiting for the connection (state `queued`) */
    _queue: Array<object>;
    _deadline: any;
    _reportedMs: number;
    _reportAt: number;
    /** @type {((msg: object) => void) | null} */
    _onServerCancelled: ((msg: object) => void) | null;
    /** @type {Promise<Heard> | null} */
    _cancelling: Promise<Heard> | null;
    _inputEnded: boolean;
    /** @type {object | null} the `start` message, sent again to resume */
    _start: object | null;
    _text: string;
    _base: number;
    _segBase: number;
    _audioBaseMs: number;
    /** @type {number | null} code point of `_text` to resume from, while waiting */
    _resumeFrom: number | null;
    _resumeFlush: boolean;
    /** @type {Map<number, number>} samples received per (utterance) segment */
    _received: Map<number, number>;
    resumes: number;
    _emit(type: any, detail: any): void;
    /** Stop this utterance now (server generation and local playback).
     * @returns {Promise<Heard>} */
    cancel(): Promise<Heard>;
    /** Append text (for utterances opened with `speak()` and no input). Ignored once the
     * input has ended or the utterance is over. @param {string} text */
    write(text: string): void;
    /** Synthesize what is buffered now, without waiting for punctuation. */
    flush(): void;
    /** No more text: the server finishes the audio and `done` follows. */
    end(): void;
    /**
     * Report playback yourself (a client created with `play: false` and its own player):
     * ms of this utterance's audio really played. The server paces on it.
     * @param {number} playedMs @param {number} [bufferedMs]
     */
    reportPlayback(playedMs: number, bufferedMs?: number): void;
    /** How much of each segment was actually heard, in ms.
     * @returns {Heard} */
    heard(): Heard;
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
    /** @type {"connecting" | "open" | "reconnecting" | "closed"} */
    state: "connecting" | "open" | "reconnecting" | "closed";
    /** @type {string | null} why the client is `closed` */
    closedReason: string | null;
    /** @type {number | null} when the next attempt starts (Date.now() ms), while waiting */
    retryAt: number | null;
    _closedByUser: boolean;
    _disposed: boolean;
    _attempt: number;
    _connecting: boolean;
    _playerReady: boolean;
    _gen: number;
    _timer: number;
    _queued: number;
    /** @type {Utterance[]} utterances waiting for the connection, in creation order */
    _pending: Utterance[];
    /** @type {Array<{open: (c: RttsClient) => void, closed: (reason: string) => void}>} */
    _waiters: Array<{
        open: (c: RttsClient) => void;
        closed: (reason: string) => void;
    }>;
    _wakeUp: () => void;
    _onVisibility: () => void;
    /** @type {any} */
    _window: any;
    get _retry(): ReconnectOptions;
    _setState(state: any, detail?: {}): void;
    /** Open the socket (and the audio player). Resolves on the server's `ready`; a failed
     * attempt is retried like any outage. Rejects once the client is `closed` (close(), a
     * permanent close code, or `retries` used up). */
    open(): Promise<any>;
    /**
     * Reconnect now: from `reconnecting` (skip the wait) or `closed` (start again with a
     * fresh backoff). Resolves true once open, false if the client ends up `closed` (after
     * `close()` it stays closed: false at once). Never rejects.
     * @returns {Promise<boolean>}
     */
    reconnect(): Promise<boolean>;
    /** Start the audio player (once), then the first attempt. */
    _startConnect(): Promise<void>;
    /** The browser came online or the tab became visible: do not wait out the backoff. */
    _wake(): void;
    _attemptConnect(): Promise<void>;
    _onReady(msg: any): void;
    _socketClosed(ws: any, code: any, reason: any, wasReady: any): void;
    _attemptFailed(code: any, reason: any): void;
    _giveUp(reason: any): void;
    /** Send a message now if the socket is open. Never throws. @returns {boolean} */
    _send(obj: any): boolean;
    /** A message of one utterance: sent, queued with it, or ignored once it is over. */
    _sendFor(u: any, msg: any): boolean;
    /**
     * Speak text: a string, or an (async) iterable of text pieces such as LLM tokens.
     * With no input the utterance stays open: feed it with `write()`, then `end()`.
     * While the client is (re)connecting the utterance is queued and sent on reconnect;
     * when it is `closed`, the utterance fails at once (its `error` event fires and `done`
     * rejects, after speak() returns).
     * @param {string | Iterable<string> | AsyncIterable<string>} [input]
     * @param {SpeakOptions} [options]
     * @returns {Utterance}
     */
    speak(input?: string | Iterable<string> | AsyncIterable<string>, options?: SpeakOptions): Utterance;
    _feed(u: any, input: any): Promise<void>;
    /** Synthesize what is buffered for a context now. @param {string} contextId */
    flush(contextId: string): void;
    /** Send a `playback` report for an utterance (rate-limited unless `force`). */
    _report(u: any, playedMs: any, bufferedMs: any, force?: boolean): void;
    _onStats(stats: any): void;
    /**
     * Store the voice a context spoke (its speaker plus its first segment's codes and text)
     * as a named voice on the server (native `save_voice`): later contexts started with
     * `voice: name` speak with it. The context may be open or recently done.
     * @param {string} contextId
     * @param {string} name  1-64 characters of a-z, 0-9, `_` and `-`
     * @returns {Promise<object>} the saved voice, as `GET /v1/voices/{name}` describes it
     */
    saveVoice(contextId: string, name: string): Promise<object>;
    /**
     * Barge-in: stop a context now, in any state. Playback fades out within 5 ms, late
     * frames are dropped. An utterance still queued is dropped from the queue. When the
     * server has it, the client reports what was played and sends `cancel`; the promise
     * then carries the server's `heardMs`, `textSpoken` and `textRemaining` too.
     * @param {string} contextId
     * @returns {Promise<Heard>} what was heard
     */
    cancel(contextId: string): Promise<Heard>;
    _cancel(u: any): Promise<Heard>;
    _unqueue(u: any): void;
    /** Close the connection for good (no reconnect); queued and open utterances fail. */
    close(): Promise<void>;
    _onFrame(buffer: any): void;
    _onEvent(msg: any): void;
    /** End an utterance with an error: reject `done`, emit `error`, release its track. */
    _fail(u: any, err: any): void;
    /** A server event's segment numbers, text offsets and times -> the utterance's (they
     * differ from the server context's after a resume). */
    _toUtterance(u: any, msg: any): void;
    /**
     * Where a dropped utterance resumes: the end of the last segment whose audio arrived
     * whole (`segment_done`), in code points of its text, and the segments after it (whose
     * audio arrived in part, or not at all). Their audio not yet played is dropped from the
     * player, and the text is said again from the segment's start: what was heard of a
     * segment cut off mid-way (at most one: the one playing) is the only audio said twice.
     * @returns {{from: number, partial: number[], keptMs: number}}
     */
    _resumePoint(u: any): {
        from: number;
        partial: number[];
        keptMs: number;
    };
    /** The connection dropped under an open utterance: wait for the next one, then resume. */
    _awaitResume(u: any, code: any): void;
    /** Open the dropped utterance's context again and send the rest of its text. */
    _sendResume(u: any): void;
    _forget(u: any): void;
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
    /**
     * false: synthesize the text as written (no spelled-out numbers)
     */
    normalize?: boolean;
    /**
     * true: `segment` events carry estimated character timings
     * (`chars`, `char_start_ms`, `char_duration_ms`)
     */
    timings?: boolean;
};
export type ReconnectOptions = {
    /**
     * failed attempts in a row before giving up (state
     * `closed`, `reason: "retries exhausted"`); `client.reconnect()` starts again
     */
    retries?: number;
    /**
     * first delay; doubles each failed attempt
     */
    baseDelayMs?: number;
    /**
     * cap of the delay (jitter: 50-100 % of it)
     */
    maxDelayMs?: number;
    /**
     * one attempt: token, handshake, `ready`
     */
    connectTimeoutMs?: number;
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
    /**
     * retry policy after a drop (and on the first
     * connect): capped exponential backoff with jitter, forever by default
     */
    reconnect?: ReconnectOptions;
    /**
     * what `speak()` may queue
     * while not connected: at most `maxMessages` messages in all (default 256; consecutive
     * text pieces merge), each utterance sent within `deadlineMs` (default 10000) or failed
     */
    queue?: {
        maxMessages?: number;
        deadlineMs?: number;
    };
    /**
     * send `playback` reports (what the player
     * really played) so the server paces on them, about every `reportEveryMs` (250)
     */
    reportPlayback?: boolean;
    reportEveryMs?: number;
    /**
     * how long `cancel()` waits for the server's
     * `cancelled` (with the heard text) before resolving with the local figures only
     */
    cancelReplyMs?: number;
    /**
     * where `online` and `visibilitychange` come
     * from (default: the page's window; tests pass their own)
     */
    window?: {
        addEventListener: Function;
        removeEventListener: Function;
        document?: {
            visibilityState?: string;
            addEventListener: Function;
            removeEventListener: Function;
        };
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
    /**
     * an utterance being spoken when the connection drops is
     * resumed on reconnect from its first unheard character (false: it fails with
     * `disconnected`); it waits for the connection at most `queue.deadlineMs`
     */
    resume?: boolean;
};
export type Heard = {
    /**
     * what the player really played of this utterance
     */
    playedMs: number;
    segments: Array<{
        segment: number;
        text: string;
        heardMs: number;
    }>;
    /**
     * the server's figure (from the playback reports)
     */
    heardMs?: number;
    /**
     * the input up to the last heard character (server)
     */
    textSpoken?: string;
    /**
     * the rest of the input (server)
     */
    textRemaining?: string;
};
import { PcmPlayer } from "./pcm-player.js";
export { parseFrame, buildFrame, pcm16ToFloat32 } from "./protocol.js";
