// rtts JavaScript client: stream text in, play audio as it arrives.
//
//   import { connect } from "./rtts-client.js";
//   const client = await connect("ws://localhost:8765/v1/stream");
//   const u = client.speak(llmTokens(), { voice: "seed:3" });   // string or (async) iterable
//   u.addEventListener("segment", (e) => console.log(e.detail.text));
//   await u.done;            // server finished sending
//   client.cancel(u.contextId);   // barge-in: stops playback within a few ms
//
// Connection states (`client.state`, `statechange` event): connecting -> open ->
// reconnecting -> open ... and closed. Every public call is defined in every state:
//
//   call        connecting / reconnecting          open              closed
//   speak()     queued (bounded, deadline), sent   sent              utterance fails at once
//               on reconnect; else it fails                          (error event, done
//                                                                     rejected, track freed)
//   write/flush/end  queued with its utterance     sent              ignored (utterance over)
//   cancel()    local stop; a queued utterance     local stop +      local stop
//               is dropped from the queue          playback+cancel
//   close()     stops retrying, fails queued       closes 1000       no-op
//   reconnect() attempt now (backoff reset)        no-op (true)      attempt now; false
//                                                                     after close()
//
// Nothing throws out of a timer or an event handler, and a failed or cancelled utterance
// always releases its player track, so later utterances never wait behind it.
//
// Resume: an utterance the server was speaking when the connection dropped (the instance
// died or drained, the network went) is not lost. The client keeps its text; on reconnect
// (same URL: behind a balancer, maybe another instance) it opens the context again with
// the same params and sends the text from the first character whose audio it has not
// received whole, so nothing heard is said again and nothing is skipped (see
// `_resumePoint`; docs/protocols/native.md, "Resuming after a drop").
import { parseFrame, pickServerRate } from "./protocol.js";
import { PcmPlayer } from "./pcm-player.js";

export { PcmPlayer } from "./pcm-player.js";
export { parseFrame, buildFrame, pcm16ToFloat32 } from "./protocol.js";

/**
 * @typedef {object} SpeakOptions
 * @property {string} [contextId]   defaults to a fresh id
 * @property {string} [voice]       "seed:N" or a ChatTTS speaker embedding string
 * @property {number} [seed]
 * @property {number} [temperature]
 * @property {number} [top_P]
 * @property {number} [top_K]
 * @property {number} [speed]       0-9
 * @property {boolean} [refine]
 * @property {number[]} [chunkSchedule] characters before each chunk may be cut
 * @property {number} [idleFlushMs]
 * @property {boolean} [cache]      false: never serve or store this utterance in the phrase cache
 * @property {boolean} [normalize]  false: synthesize the text as written (no spelled-out numbers)
 * @property {boolean} [timings]    true: `segment` events carry estimated character timings
 *   (`chars`, `char_start_ms`, `char_duration_ms`)
 */

/**
 * @typedef {object} ReconnectOptions
 * @property {number} [retries=Infinity] failed attempts in a row before giving up (state
 *   `closed`, `reason: "retries exhausted"`); `client.reconnect()` starts again
 * @property {number} [baseDelayMs=250] first delay; doubles each failed attempt
 * @property {number} [maxDelayMs=5000] cap of the delay (jitter: 50-100 % of it)
 * @property {number} [connectTimeoutMs=10000] one attempt: token, handshake, `ready`
 */

/**
 * @typedef {object} ConnectOptions
 * @property {boolean} [play=true]          play audio through a PcmPlayer
 * @property {PcmPlayer} [player]           bring your own player
 * @property {AudioContext} [audioContext]  used when the client creates the player
 * @property {number} [sampleRate]          rate to request, and the rate of the AudioContext
 *   the client's player creates (default: 24000, the server's native rate, so neither side
 *   resamples; with `audioContext`, the default is that context's rate)
 * @property {ReconnectOptions} [reconnect] retry policy after a drop (and on the first
 *   connect): capped exponential backoff with jitter, forever by default
 * @property {{maxMessages?: number, deadlineMs?: number}} [queue] what `speak()` may queue
 *   while not connected: at most `maxMessages` messages in all (default 256; consecutive
 *   text pieces merge), each utterance sent within `deadlineMs` (default 10000) or failed
 * @property {boolean} [reportPlayback=true] send `playback` reports (what the player
 *   really played) so the server paces on them, about every `reportEveryMs` (250)
 * @property {number} [reportEveryMs=250]
 * @property {number} [cancelReplyMs=1000] how long `cancel()` waits for the server's
 *   `cancelled` (with the heard text) before resolving with the local figures only
 * @property {{addEventListener: Function, removeEventListener: Function,
 *   document?: {visibilityState?: string, addEventListener: Function,
 *   removeEventListener: Function}}} [window] where `online` and `visibilitychange` come
 *   from (default: the page's window; tests pass their own)
 * @property {typeof WebSocket} [WebSocket] WebSocket implementation (Node, tests)
 * @property {SpeakOptions} [defaults]      params applied to every speak()
 * @property {string | (() => Promise<string>)} [token] short-lived browser token from your
 *   backend (GET /v1/token with the API key); a function is called before each (re)connect
 * @property {boolean} [resume=true] an utterance being spoken when the connection drops is
 *   resumed on reconnect from its first unheard character (false: it fails with
 *   `disconnected`); it waits for the connection at most `queue.deadlineMs`
 */

let contextCounter = 0;
let trackCounter = 0;

/** Close codes after which retrying would only repeat the failure. */
const PERMANENT_CLOSE = new Set([1000, 1007, 1008, 1009]);
const MAX_MERGED_TEXT = 10000;

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
  constructor(client, contextId) {
    super();
    this.client = client;
    this.contextId = contextId;
    this.track = ++trackCounter; // player track: utterances play in creation order
    /** @type {number | null} server stream number, known at the first segment */
    this.stream = null;
    this.sampleRate = 24000;
    this.createdAt = performance.now();
    /** @type {number | null} ms from speak() to the first audio frame */
    this.ttfaMs = null;
    /** @type {Array<{segment: number, text: string, spoken: string, textStart: number,
     *   textEnd: number, audioStartMs: number, durationMs: number | null, heardMs: number,
     *   cached: boolean}>} */
    this.segments = [];
    /** @type {"queued" | "open" | "done" | "cancelled" | "error"} */
    this.state = "open";
    this.audioMs = 0;
    /** @type {Promise<{segments: number, audioMs: number, cancelled?: boolean}>} resolves
     * on the server's `done` (or on cancel, with `cancelled: true`); rejects on error */
    this.done = new Promise((resolve, reject) => {
      this._resolve = resolve;
      this._reject = reject;
    });
    this.done.catch(() => {}); // handled through the `error` event too
    /** @type {Promise<{played: number, segments: Object<string, number>}>} playback over
     * (always settles: ended, cancelled or failed) */
    this.ended = new Promise((resolve) => { this._ended = resolve; });
    /** @type {Array<object>} messages waiting for the connection (state `queued`) */
    this._queue = [];
    this._deadline = null;
    this._reportedMs = -1;
    this._reportAt = 0;
    /** @type {((msg: object) => void) | null} */
    this._onServerCancelled = null;
    /** @type {Promise<Heard> | null} */
    this._cancelling = null;
    this._inputEnded = false; // `end` was sent or queued: no more write/flush/end
    /** @type {object | null} the `start` message, sent again to resume */
    this._start = null;
    this._text = ""; // all the text given so far (what a resume sends the rest of)
    this._base = 0; // code points of `_text` before the server context's input (resumes)
    this._segBase = 0; // utterance segment number of the server context's segment 0
    this._audioBaseMs = 0; // ms of this utterance's audio before the server context's
    /** @type {number | null} code point of `_text` to resume from, while waiting */
    this._resumeFrom = null;
    this._resumeFlush = false;
    /** @type {Map<number, number>} samples received per (utterance) segment */
    this._received = new Map();
    this.resumes = 0; // times this utterance was resumed after a drop
  }

  _emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** Stop this utterance now (server generation and local playback).
   * @returns {Promise<Heard>} */
  cancel() {
    return this._cancelling ?? this.client.cancel(this.contextId);
  }

  /** Append text (for utterances opened with `speak()` and no input). Ignored once the
   * input has ended or the utterance is over. @param {string} text */
  write(text) {
    if (text && !this._inputEnded) {
      this.client._sendFor(this, { type: "text", context_id: this.contextId, text });
    }
  }

  /** Synthesize what is buffered now, without waiting for punctuation. */
  flush() {
    if (!this._inputEnded) this.client._sendFor(this, { type: "flush",
                                                        context_id: this.contextId });
  }

  /** No more text: the server finishes the audio and `done` follows. */
  end() {
    if (this._inputEnded) return;
    this._inputEnded = true;
    this.client._sendFor(this, { type: "end", context_id: this.contextId });
  }

  /**
   * Report playback yourself (a client created with `play: false` and its own player):
   * ms of this utterance's audio really played. The server paces on it.
   * @param {number} playedMs @param {number} [bufferedMs]
   */
  reportPlayback(playedMs, bufferedMs) {
    this.client._report(this, playedMs, bufferedMs, true);
  }

  /** How much of each segment was actually heard, in ms.
   * @returns {Heard} */
  heard() {
    const pos = this.client.player?.stats?.positions?.[this.track];
    const rate = this.client.player?.sampleRate ?? this.sampleRate;
    const segs = pos?.segments ?? this._heardSegments ?? {};
    for (const s of this.segments) s.heardMs = ((segs[s.segment] ?? 0) * 1000) / rate;
    return { playedMs: ((pos?.played ?? this._heardTotal ?? 0) * 1000) / rate,
             segments: this.segments.map((s) => ({ segment: s.segment, text: s.text,
                                                   heardMs: s.heardMs })) };
  }
}

/** The code points of a string (the server counts text offsets in them).
 * @param {string} text @returns {string[]} */
function codePoints(text) {
  return Array.from(text);
}

/** `promise`, or `fallback()` after `ms` (the timer is cleared either way). */
function within(promise, ms, fallback) {
  let timer;
  const late = new Promise((resolve, reject) => {
    timer = setTimeout(() => { try { resolve(fallback()); } catch (e) { reject(e); } }, ms);
  });
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

export class RttsClient extends EventTarget {
  /** @param {string} url @param {ConnectOptions} [options] */
  constructor(url, options = {}) {
    super();
    this.url = url;
    this.options = options;
    this.WebSocketImpl = options.WebSocket ?? globalThis.WebSocket;
    /** @type {PcmPlayer | null} */
    this.player = options.player ?? (options.play === false ? null
      : new PcmPlayer({ audioContext: options.audioContext, sampleRate: options.sampleRate }));
    /** @type {WebSocket | null} */
    this.ws = null;
    /** @type {Map<string, Utterance>} */
    this.utterances = new Map();
    this.byStream = new Map();
    this.byTrack = new Map();
    this.server = null; // the `ready` event
    /** @type {"connecting" | "open" | "reconnecting" | "closed"} */
    this.state = "closed";
    /** @type {string | null} why the client is `closed` */
    this.closedReason = null;
    /** @type {number | null} when the next attempt starts (Date.now() ms), while waiting */
    this.retryAt = null;
    this._closedByUser = false;
    this._disposed = false;
    this._attempt = 0;
    this._connecting = false; // an attempt is in flight
    this._playerReady = false;
    this._gen = 0; // bumps on close(): stale attempts and timers do nothing
    this._timer = null;
    this._queued = 0; // messages queued over all queued utterances
    /** @type {Utterance[]} utterances waiting for the connection, in creation order */
    this._pending = [];
    /** @type {Array<{open: (c: RttsClient) => void, closed: (reason: string) => void}>} */
    this._waiters = [];
    this._wakeUp = () => this._wake();
    this._onVisibility = () => {
      if (this._window?.document?.visibilityState !== "hidden") this._wake();
    };
    /** @type {any} */
    this._window = options.window ?? globalThis.window ?? null;
    this._window?.addEventListener?.("online", this._wakeUp);
    this._window?.document?.addEventListener?.("visibilitychange", this._onVisibility);
    if (this.player) {
      this.player.addEventListener("finished", (e) => this._onFinished(e.detail));
      this.player.addEventListener("stats", (e) => this._onStats(e.detail));
    }
  }

  get _retry() {
    return this.options.reconnect ?? {};
  }

  _setState(state, detail = {}) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("statechange", {
      detail: { state, attempt: this._attempt, retryAt: this.retryAt,
                reason: this.closedReason, ...detail } }));
  }

  /** Open the socket (and the audio player). Resolves on the server's `ready`; a failed
   * attempt is retried like any outage. Rejects once the client is `closed` (close(), a
   * permanent close code, or `retries` used up). */
  async open() {
    if (this._disposed) throw new Error("client closed");
    if (this.state === "open") return this;
    this._closedByUser = false;
    const opened = new Promise((resolve, reject) => {
      this._waiters.push({ open: resolve, closed: (r) => reject(new Error(r)) });
    });
    if (this.state === "closed") {
      this.closedReason = null;
      this._setState(this.server ? "reconnecting" : "connecting");
      this._startConnect();
    }
    return opened;
  }

  /**
   * Reconnect now: from `reconnecting` (skip the wait) or `closed` (start again with a
   * fresh backoff). Resolves true once open, false if the client ends up `closed` (after
   * `close()` it stays closed: false at once). Never rejects.
   * @returns {Promise<boolean>}
   */
  reconnect() {
    if (this.state === "open") return Promise.resolve(true);
    if (this._disposed) return Promise.resolve(false);
    this._closedByUser = false;
    this._attempt = 0;
    const result = new Promise((resolve) => {
      this._waiters.push({ open: () => resolve(true), closed: () => resolve(false) });
    });
    if (!this._connecting) {
      this.closedReason = null;
      if (this.state === "closed") this._setState(this.server ? "reconnecting" : "connecting");
      this._startConnect();
    }
    return result;
  }

  /** Start the audio player (once), then the first attempt. */
  async _startConnect() {
    this._connecting = true;
    if (this.player && !this._playerReady) {
      try {
        await this.player.connect();
        this._playerReady = true;
      } catch (err) {
        this._connecting = false;
        this._giveUp(`audio output failed: ${err?.message ?? err}`);
        return;
      }
    }
    if (!this._disposed) this._attemptConnect();
  }

  /** The browser came online or the tab became visible: do not wait out the backoff. */
  _wake() {
    const waiting = this.state === "reconnecting" || this.state === "connecting";
    if (waiting && !this._connecting && !this._closedByUser) {
      this._attemptConnect();
    }
  }

  async _attemptConnect() {
    clearTimeout(this._timer);
    this._timer = null;
    this.retryAt = null;
    this._connecting = true;
    const gen = this._gen;
    const timeoutMs = this._retry.connectTimeoutMs ?? 10000;
    let url = this.url;
    try {
      const token = typeof this.options.token === "function"
        ? await within(Promise.resolve().then(() => this.options.token()), timeoutMs, () => {
          throw new Error("token request timed out");
        })
        : this.options.token;
      if (token) url += (url.includes("?") ? "&" : "?") + `token=${encodeURIComponent(token)}`;
    } catch (err) {
      if (gen === this._gen) this._attemptFailed(1006, `token: ${err?.message ?? err}`);
      return;
    }
    if (gen !== this._gen) return;
    let ws;
    try {
      ws = new this.WebSocketImpl(url);
    } catch (err) {
      this._connecting = false;
      this._giveUp(`cannot connect: ${err?.message ?? err}`);
      return;
    }
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    let ready = false;
    const timer = setTimeout(() => {
      if (!ready && this.ws === ws) {
        try { ws.close(); } catch { /* closing anyway */ }
        this._socketClosed(ws, 1006, "connect timeout", false);
      }
    }, timeoutMs);
    ws.onmessage = (e) => {
      if (this.ws !== ws) return;
      if (typeof e.data !== "string") { this._onFrame(e.data); return; }
      let msg;
      try {
        msg = JSON.parse(e.data);
      } catch {
        this.dispatchEvent(new CustomEvent("warning", { detail: "server sent bad JSON" }));
        return;
      }
      if (msg.type === "ready" && !ready) {
        ready = true;
        clearTimeout(timer);
        this._onReady(msg);
      }
      this._onEvent(msg);
    };
    ws.onclose = (e) => {
      clearTimeout(timer);
      this._socketClosed(ws, e.code, e.reason, ready);
    };
    ws.onerror = () => {}; // onclose follows with the code
  }

  _onReady(msg) {
    const back = this.server !== null;
    this._connecting = false;
    this._attempt = 0;
    this.server = msg;
    this.closedReason = null;
    this._setState("open", { back });
    this.dispatchEvent(new CustomEvent("open", { detail: msg }));
    for (const u of this._pending.splice(0)) {
      clearTimeout(u._deadline);
      const queue = u._queue;
      u._queue = [];
      this._queued -= queue.length;
      if (u.state !== "queued") continue;
      u.state = "open";
      if (u._resumeFrom !== null) this._sendResume(u);
      else for (const m of queue) this._send(m);
    }
    for (const w of this._waiters.splice(0)) w.open(this);
  }

  _socketClosed(ws, code, reason, wasReady) {
    if (this.ws !== ws) return; // an attempt we already gave up on
    this.ws = null;
    this._connecting = false;
    this.byStream.clear(); // stream numbers start again on the next connection
    const permanent = (wasReady && PERMANENT_CLOSE.has(code))
      || (!wasReady && (code === 1008 || code === 1009));
    const resume = this.options.resume !== false && !this._closedByUser && !permanent;
    for (const u of this.utterances.values()) {
      if (u.state !== "open") continue;
      if (resume) this._awaitResume(u, code);
      else this._fail(u, { code: "disconnected", message: `connection closed (${code})` });
    }
    if (wasReady) this.dispatchEvent(new CustomEvent("close", { detail: { code, reason } }));
    if (this._closedByUser) return;
    if (wasReady && PERMANENT_CLOSE.has(code)) {
      this._giveUp(`server closed the connection (${code}${reason ? ` ${reason}` : ""})`);
      return;
    }
    if (!wasReady && (code === 1008 || code === 1009)) {
      this._giveUp(`connection refused (${code})`);
      return;
    }
    this._attemptFailed(code, reason);
  }

  _attemptFailed(code, reason) {
    this._connecting = false;
    const retries = this._retry.retries ?? Infinity;
    if (this._attempt >= retries) {
      this._giveUp("retries exhausted");
      return;
    }
    this._attempt += 1;
    const base = this._retry.baseDelayMs ?? 250;
    const delay = Math.min(this._retry.maxDelayMs ?? 5000, base * 2 ** (this._attempt - 1))
      * (0.5 + Math.random() / 2);
    this.retryAt = Date.now() + delay;
    const gen = this._gen;
    this._timer = setTimeout(() => {
      if (gen === this._gen && !this._closedByUser) this._attemptConnect();
    }, delay);
    // `connecting` until the client has been open once, `reconnecting` after
    this._setState(this.server ? "reconnecting" : "connecting",
                   { delayMs: delay, code, lastError: reason ?? "" });
    this.dispatchEvent(new CustomEvent("reconnecting", {
      detail: { attempt: this._attempt, delayMs: delay, code } }));
  }

  _giveUp(reason) {
    clearTimeout(this._timer);
    this._timer = null;
    this.retryAt = null;
    this.closedReason = reason;
    for (const u of [...this._pending]) this._fail(u, { code: "closed", message: reason });
    this._setState("closed");
    for (const w of this._waiters.splice(0)) w.closed(reason);
  }

  /** Send a message now if the socket is open. Never throws. @returns {boolean} */
  _send(obj) {
    const ws = this.ws;
    if (!ws || ws.readyState !== 1 || this.state !== "open") return false;
    try {
      ws.send(JSON.stringify(obj));
      return true;
    } catch {
      return false; // closing under us: onclose fails the utterances
    }
  }

  /** A message of one utterance: sent, queued with it, or ignored once it is over. */
  _sendFor(u, msg) {
    if (msg.type === "text" && (u.state === "open" || u.state === "queued")) u._text += msg.text;
    if (u.state === "open") return this._send(msg);
    if (u.state !== "queued") return false;
    if (u._resumeFrom !== null) { // waiting to resume: the text is kept in `_text`
      if (msg.type === "flush") u._resumeFlush = true;
      return true;
    }
    const last = u._queue[u._queue.length - 1];
    if (msg.type === "text" && last?.type === "text"
        && last.text.length + msg.text.length <= MAX_MERGED_TEXT) {
      last.text += msg.text;
      return true;
    }
    const max = this.options.queue?.maxMessages ?? 256;
    if (this._queued >= max) {
      this._fail(u, { code: "queue_full",
                      message: `more than ${max} messages queued while not connected` });
      return false;
    }
    u._queue.push(msg);
    this._queued += 1;
    return true;
  }

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
  speak(input, options = {}) {
    const o = { ...(this.options.defaults ?? {}), ...options };
    const contextId = o.contextId ?? `u${Date.now().toString(36)}${++contextCounter}`;
    const u = new Utterance(this, contextId);
    u.sampleRate = this.options.sampleRate
      ?? (this.player ? pickServerRate(this.player.sampleRate, this.server?.sample_rate)
        : (this.server?.sample_rate ?? 24000));
    this.utterances.set(contextId, u);
    this.byTrack.set(u.track, u);
    if (this.state === "closed") {
      u.state = "queued"; // so that _fail releases it like a queued one
      queueMicrotask(() => this._fail(u, {
        code: "not_connected",
        message: `not connected${this.closedReason ? `: ${this.closedReason}` : ""}` }));
      return u;
    }
    this.player?.announce(u.track);
    const start = { type: "start", context_id: contextId, sample_rate: u.sampleRate };
    for (const [k, key] of [["voice", "voice"], ["seed", "seed"], ["temperature", "temperature"],
      ["top_P", "top_P"], ["top_K", "top_K"], ["speed", "speed"], ["refine", "refine"],
      ["chunkSchedule", "chunk_schedule"], ["idleFlushMs", "idle_flush_ms"], ["cache", "cache"],
      ["normalize", "normalize"], ["timings", "timings"]]) {
      if (o[k] !== undefined) start[key] = o[k];
    }
    u._start = start;
    if (this.state !== "open") {
      u.state = "queued";
      this._pending.push(u);
      const deadlineMs = this.options.queue?.deadlineMs ?? 10000;
      u._deadline = setTimeout(() => this._fail(u, {
        code: "not_connected", message: `not connected within ${deadlineMs} ms` }),
      deadlineMs);
      this._sendFor(u, start);
    } else {
      this._send(start);
    }
    if (input !== undefined) {
      this._feed(u, input).catch((err) => this._fail(u, { code: "input_error",
                                                           message: String(err) }));
    }
    return u;
  }

  async _feed(u, input) {
    const live = () => u.state === "open" || u.state === "queued";
    if (typeof input === "string") {
      this._sendFor(u, { type: "text", context_id: u.contextId, text: input });
    } else {
      for await (const piece of input) {
        if (!live()) return;
        if (piece) this._sendFor(u, { type: "text", context_id: u.contextId, text: piece });
      }
    }
    if (live()) u.end();
  }

  /** Synthesize what is buffered for a context now. @param {string} contextId */
  flush(contextId) {
    const u = this.utterances.get(contextId);
    if (u) u.flush();
  }

  /** Send a `playback` report for an utterance (rate-limited unless `force`). */
  _report(u, playedMs, bufferedMs, force = false) {
    if (u.state !== "open" || !Number.isFinite(playedMs)) return;
    playedMs = Math.max(0, playedMs - u._audioBaseMs); // of the server context's audio
    if (!(playedMs >= 0)) return;
    const now = performance.now();
    const every = this.options.reportEveryMs ?? 250;
    if (!force && (playedMs <= u._reportedMs || now - u._reportAt < every)) return;
    const msg = { type: "playback", context_id: u.contextId,
                  played_ms: Math.round(playedMs * 10) / 10 };
    if (bufferedMs !== undefined && bufferedMs >= 0 && Number.isFinite(bufferedMs)) {
      msg.buffered_ms = Math.round(bufferedMs);
    }
    if (this._send(msg)) {
      u._reportedMs = playedMs;
      u._reportAt = now;
    }
  }

  _onStats(stats) {
    if (this.options.reportPlayback === false || this.state !== "open") return;
    const rate = this.player?.sampleRate;
    if (!rate) return;
    for (const u of this.utterances.values()) {
      const pos = stats.positions?.[u.track];
      if (u.state === "open" && pos) this._report(u, (pos.played * 1000) / rate, stats.bufferedMs);
    }
  }

  /**
   * Store the voice a context spoke (its speaker plus its first segment's codes and text)
   * as a named voice on the server (native `save_voice`): later contexts started with
   * `voice: name` speak with it. The context may be open or recently done.
   * @param {string} contextId
   * @param {string} name  1-64 characters of a-z, 0-9, `_` and `-`
   * @returns {Promise<object>} the saved voice, as `GET /v1/voices/{name}` describes it
   */
  saveVoice(contextId, name) {
    this._saves ??= new Map();
    const pending = this._saves;
    return new Promise((resolve, reject) => {
      if (pending.has(contextId)) {
        reject(new Error("a save of this context is already pending"));
        return;
      }
      if (!this._send({ type: "save_voice", context_id: contextId, name })) {
        reject(new Error("not connected"));
        return;
      }
      pending.set(contextId, { resolve, reject });
    });
  }

  /**
   * Barge-in: stop a context now, in any state. Playback fades out within 5 ms, late
   * frames are dropped. An utterance still queued is dropped from the queue. When the
   * server has it, the client reports what was played and sends `cancel`; the promise
   * then carries the server's `heardMs`, `textSpoken` and `textRemaining` too.
   * @param {string} contextId
   * @returns {Promise<Heard>} what was heard
   */
  cancel(contextId) {
    const u = this.utterances.get(contextId);
    if (!u) return Promise.resolve({ playedMs: 0, segments: [] });
    u._cancelling ??= this._cancel(u);
    return u._cancelling;
  }

  async _cancel(u) {
    const before = u.state;
    if (before === "queued") this._unqueue(u);
    const live = before === "open" && this.state === "open";
    const stops = before === "open" || before === "queued" || before === "done";
    if (stops) u.state = "cancelled";
    u._resolve({ segments: u.segments.length, audioMs: u.audioMs, cancelled: true });
    /** @type {Promise<object | null>} */
    const reply = live ? new Promise((resolve) => { u._onServerCancelled = resolve; })
      : Promise.resolve(null);
    const heard = this.player ? await this.player.interrupt(u.track)
      : { played: 0, segments: {} };
    u._heardTotal = heard.played;
    u._heardSegments = heard.segments;
    if (live) {
      const playedMs = this.player
        ? Math.max(0, (heard.played * 1000) / this.player.sampleRate - u._audioBaseMs)
        : u._reportedMs;
      if (playedMs >= 0) {
        this._send({ type: "playback", context_id: u.contextId,
                     played_ms: Math.round(playedMs * 10) / 10 });
      }
      if (!this._send({ type: "cancel", context_id: u.contextId })) u._onServerCancelled(null);
    }
    const server = await within(reply, this.options.cancelReplyMs ?? 1000, () => null);
    u._onServerCancelled = null;
    /** @type {Heard} */
    const result = u.heard();
    if (server) {
      result.heardMs = server.heard_ms + u._audioBaseMs;
      // the server knows the text since the last resume only
      result.textSpoken = codePoints(u._text).slice(0, u._base).join("") + server.text_spoken;
      result.textRemaining = server.text_remaining;
    }
    if (stops) u._emit("cancelled", result);
    u._ended(heard);
    this._forget(u); // its track is gone (an interrupted track may not report "finished")
    return result;
  }

  _unqueue(u) {
    clearTimeout(u._deadline);
    const i = this._pending.indexOf(u);
    if (i >= 0) this._pending.splice(i, 1);
    this._queued -= u._queue.length;
    u._queue = [];
  }

  /** Close the connection for good (no reconnect); queued and open utterances fail. */
  async close() {
    if (this._disposed) return;
    this._closedByUser = true;
    this._disposed = true;
    this._gen += 1;
    this.closedReason = "closed by the client";
    clearTimeout(this._timer);
    this._timer = null;
    this.retryAt = null;
    this._connecting = false;
    this._window?.removeEventListener?.("online", this._wakeUp);
    this._window?.document?.removeEventListener?.("visibilitychange", this._onVisibility);
    for (const u of [...this.utterances.values()]) {
      this._fail(u, { code: "closed", message: "client closed" });
    }
    const ws = this.ws;
    this.ws = null;
    try { ws?.close(1000, "client closing"); } catch { /* already closing */ }
    if (this.state !== "closed") this._setState("closed");
    for (const w of this._waiters.splice(0)) w.closed("client closed");
    if (this.player && !this.options.player) await this.player.close();
  }

  _onFrame(buffer) {
    let frame;
    try {
      frame = parseFrame(buffer);
    } catch (err) {
      this.dispatchEvent(new CustomEvent("warning", { detail: String(err) }));
      return;
    }
    const u = this.byStream.get(frame.header.stream);
    if (!u || u.state !== "open") return; // late frame of a cancelled or failed context
    if (u.ttfaMs === null) {
      u.ttfaMs = performance.now() - u.createdAt;
      u._emit("started", { ttfaMs: u.ttfaMs });
    }
    const segment = u._segBase + frame.header.segment;
    u._received.set(segment, (u._received.get(segment) ?? 0) + frame.pcm.length);
    this.player?.write(u.track, segment, frame.pcm, u.sampleRate);
    u._emit("audio", { segment, sequence: frame.header.sequence,
                       pcm: frame.pcm, sampleRate: u.sampleRate });
  }

  _onEvent(msg) {
    const save = msg.context_id ? this._saves?.get(msg.context_id) : undefined;
    if (save && (msg.type === "voice_saved" || (msg.type === "error"
        && msg.segment === undefined && (!this.utterances.get(msg.context_id)
          || this.utterances.get(msg.context_id)?.state !== "open")))) {
      this._saves?.delete(msg.context_id);
      if (msg.type === "voice_saved") save.resolve(msg.voice);
      else save.reject(Object.assign(new Error(msg.message), { code: msg.code }));
      return;
    }
    const u = msg.context_id ? this.utterances.get(msg.context_id) : undefined;
    switch (msg.type) {
      case "segment_started":
        if (!u || u.state !== "open") return;
        this._toUtterance(u, msg);
        u.stream = msg.stream;
        this.byStream.set(msg.stream, u);
        u.segments.push({ segment: msg.segment, text: msg.text,
                          spoken: msg.spoken ?? msg.text, textStart: msg.text_start,
                          textEnd: msg.text_end, audioStartMs: msg.audio_start_ms,
                          durationMs: null, heardMs: 0, cached: Boolean(msg.cached) });
        u._emit("segment_started", msg);
        break;
      case "segment_done": {
        if (!u) return;
        this._toUtterance(u, msg);
        const s = u.segments.find((x) => x.segment === msg.segment);
        if (s) s.durationMs = msg.duration_ms;
        u._emit("segment", msg);
        break;
      }
      case "flushed":
        u?._emit("flushed", msg);
        break;
      case "done":
        if (!u || u.state !== "open") return;
        u.state = "done";
        msg.segments += u._segBase;
        msg.audio_ms += u._audioBaseMs;
        u.audioMs = msg.audio_ms;
        this.player?.end(u.track);
        u._resolve({ segments: msg.segments, audioMs: msg.audio_ms });
        u._emit("done", msg);
        if (!this.player) {
          u._ended({ played: 0, segments: {} });
          this._forget(u);
        }
        break;
      case "cancelled":
        u?._onServerCancelled?.(msg);
        break;
      case "error":
        if (u && msg.segment === undefined) this._fail(u, msg);
        else if (u) u._emit("error", msg); // one segment failed; the utterance goes on
        else this.dispatchEvent(new CustomEvent("error", { detail: msg }));
        break;
      default:
        break;
    }
  }

  /** End an utterance with an error: reject `done`, emit `error`, release its track. */
  _fail(u, err) {
    if (u.state !== "open" && u.state !== "queued") return;
    const queued = u.state === "queued";
    if (queued) this._unqueue(u);
    u.state = "error";
    if (!this.player) {
      u._ended({ played: 0, segments: {} });
      this._forget(u);
    } else if (u.ttfaMs === null) {
      // nothing of it was played: free its place in the play order at once
      this.player.interrupt(u.track).then((h) => u._ended(h), () => u._ended({
        played: 0, segments: {} })).finally(() => this._forget(u));
    } else {
      this.player.end(u.track); // play out what arrived, then the next utterance
    }
    u._reject(Object.assign(new Error(err.message), err));
    u._emit("error", err);
  }

  /** A server event's segment numbers, text offsets and times -> the utterance's (they
   * differ from the server context's after a resume). */
  _toUtterance(u, msg) {
    if (typeof msg.segment === "number") msg.segment += u._segBase;
    if (typeof msg.text_start === "number") msg.text_start += u._base;
    if (typeof msg.text_end === "number") msg.text_end += u._base;
    if (typeof msg.audio_start_ms === "number") msg.audio_start_ms += u._audioBaseMs;
    if (Array.isArray(msg.char_start_ms) && u._audioBaseMs) {
      msg.char_start_ms = msg.char_start_ms.map((t) => t + u._audioBaseMs);
    }
  }

  /**
   * Where a dropped utterance resumes: the end of the last segment whose audio arrived
   * whole (`segment_done`), in code points of its text, and the segments after it (whose
   * audio arrived in part, or not at all). Their audio not yet played is dropped from the
   * player, and the text is said again from the segment's start: what was heard of a
   * segment cut off mid-way (at most one: the one playing) is the only audio said twice.
   * @returns {{from: number, partial: number[], keptMs: number}}
   */
  _resumePoint(u) {
    let from = u._base;
    let keptMs = u._audioBaseMs;
    const partial = [];
    for (const s of u.segments) {
      if (s.segment < u._segBase) continue; // of an earlier server context: kept whole
      if (s.durationMs !== null) {
        from = Math.max(from, s.textEnd);
        keptMs = Math.max(keptMs, s.audioStartMs + s.durationMs);
      } else {
        partial.push(s.segment);
      }
    }
    return { from, partial, keptMs };
  }

  /** The connection dropped under an open utterance: wait for the next one, then resume. */
  _awaitResume(u, code) {
    const { from, partial, keptMs } = this._resumePoint(u);
    let heardOfPartialMs = 0;
    const rate = this.player?.sampleRate ?? u.sampleRate;
    const segs = this.player?.stats?.positions?.[u.track]?.segments ?? {};
    for (const seg of partial) {
      heardOfPartialMs += ((segs[seg] ?? 0) * 1000) / rate;
      this.player?.dropSegment?.(u.track, seg);
    }
    // segments of the new server context come after every segment of this one
    u._segBase = Math.max(u._segBase, ...u.segments.map((s) => s.segment + 1));
    u.segments = u.segments.filter((s) => !partial.includes(s.segment));
    u._base = from;
    u._audioBaseMs = keptMs + heardOfPartialMs;
    u._resumeFrom = from;
    u._resumeFlush = false;
    u.state = "queued";
    u.resumes += 1;
    this._pending.push(u);
    const deadlineMs = this.options.queue?.deadlineMs ?? 10000;
    clearTimeout(u._deadline);
    u._deadline = setTimeout(() => this._fail(u, {
      code: "disconnected",
      message: `connection closed (${code}) and not back within ${deadlineMs} ms` }),
    deadlineMs);
    u._emit("resuming", { code, from, textRemaining: codePoints(u._text).slice(from).join("") });
  }

  /** Open the dropped utterance's context again and send the rest of its text. */
  _sendResume(u) {
    const from = /** @type {number} */ (u._resumeFrom);
    u._resumeFrom = null;
    const rest = codePoints(u._text).slice(from).join("");
    this._send(u._start);
    if (rest) this._send({ type: "text", context_id: u.contextId, text: rest });
    if (u._inputEnded) this._send({ type: "end", context_id: u.contextId });
    else if (u._resumeFlush) this._send({ type: "flush", context_id: u.contextId });
    u._emit("resumed", { from, text: rest, attempt: u.resumes });
  }

  _forget(u) {
    this.byTrack.delete(u.track);
    if (u.stream !== null && this.byStream.get(u.stream) === u) this.byStream.delete(u.stream);
    if (this.utterances.get(u.contextId) === u) this.utterances.delete(u.contextId);
  }

  _onFinished(info) {
    const u = this.byTrack.get(info.stream);
    if (!u) return;
    u._heardTotal = info.played;
    u._heardSegments = info.segments;
    this._forget(u);
    if (info.reason === "ended" && u.state === "done") u._emit("ended", u.heard());
    u._ended(info);
  }
}

/**
 * Connect to an rtts server and get a ready client (waits out an outage, see `open()`).
 * @param {string} url e.g. "ws://localhost:8765/v1/stream"
 * @param {ConnectOptions} [options]
 * @returns {Promise<RttsClient>}
 */
export async function connect(url, options = {}) {
  const client = new RttsClient(url, options);
  await client.open();
  return client;
}
