// rtts JavaScript client: stream text in, play audio as it arrives.
//
//   import { connect } from "./rtts-client.js";
//   const client = await connect("ws://localhost:8765/v1/stream");
//   const u = client.speak(llmTokens(), { voice: "seed:3" });   // string or (async) iterable
//   u.addEventListener("segment", (e) => console.log(e.detail.text));
//   await u.done;            // server finished sending
//   client.cancel(u.contextId);   // barge-in: stops playback within a few ms
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
 */

/**
 * @typedef {object} ConnectOptions
 * @property {boolean} [play=true]          play audio through a PcmPlayer
 * @property {PcmPlayer} [player]           bring your own player
 * @property {AudioContext} [audioContext]  used when the client creates the player
 * @property {number} [sampleRate]          rate to request, and the rate of the AudioContext
 *   the client's player creates (default: 24000, the server's native rate, so neither side
 *   resamples; with `audioContext`, the default is that context's rate)
 * @property {{retries?: number, baseDelayMs?: number, maxDelayMs?: number}} [reconnect]
 * @property {typeof WebSocket} [WebSocket] WebSocket implementation (Node, tests)
 * @property {SpeakOptions} [defaults]      params applied to every speak()
 * @property {string | (() => Promise<string>)} [token] short-lived browser token from your
 *   backend (GET /v1/token with the API key); a function is called before each (re)connect
 */

let contextCounter = 0;
let trackCounter = 0;

/** One utterance (a server "context"): events `started`, `segment`, `done`, `ended`,
 * `cancelled`, `error`. */
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
    /** @type {Array<{segment: number, text: string, textStart: number, textEnd: number,
     *   audioStartMs: number, durationMs: number | null, heardMs: number, cached: boolean}>} */
    this.segments = [];
    this.state = "open"; // open | done | cancelled | error
    this.audioMs = 0;
    /** @type {Promise<{segments: number, audioMs: number}>} resolves on server `done` */
    this.done = new Promise((resolve, reject) => {
      this._resolve = resolve;
      this._reject = reject;
    });
    this.done.catch(() => {}); // handled through the `error` event too
    /** @type {Promise<{played: number, segments: Object<string, number>}>} playback over */
    this.ended = new Promise((resolve) => { this._ended = resolve; });
  }

  _emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** Stop this utterance now (server generation and local playback). */
  cancel() {
    return this.client.cancel(this.contextId);
  }

  /** Append text (for utterances opened with `speak()` and no input). @param {string} text */
  write(text) {
    if (this.state === "open" && text) {
      this.client._send({ type: "text", context_id: this.contextId, text });
    }
  }

  /** Synthesize what is buffered now, without waiting for punctuation. */
  flush() {
    if (this.state === "open") this.client.flush(this.contextId);
  }

  /** No more text: the server finishes the audio and `done` follows. */
  end() {
    if (this.state === "open") this.client._send({ type: "end", context_id: this.contextId });
  }

  /** How much of each segment was actually heard, in ms. */
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
    this.state = "closed"; // connecting | open | reconnecting | closed
    this._closedByUser = false;
    this._attempt = 0;
    if (this.player) {
      this.player.addEventListener("finished", (e) => this._onFinished(e.detail));
    }
  }

  /** Open the socket (and the audio player); resolves on the server's `ready`. */
  async open() {
    if (this.player) await this.player.connect();
    this._closedByUser = false;
    await this._connectOnce();
  }

  async _connectOnce() {
    this.state = this._attempt ? "reconnecting" : "connecting";
    let url = this.url;
    const token = typeof this.options.token === "function"
      ? await this.options.token() : this.options.token;
    if (token) url += (url.includes("?") ? "&" : "?") + `token=${encodeURIComponent(token)}`;
    return new Promise((resolve, reject) => {
      const ws = new this.WebSocketImpl(url);
      ws.binaryType = "arraybuffer";
      this.ws = ws;
      let ready = false;
      ws.onmessage = (e) => {
        if (typeof e.data === "string") {
          const msg = JSON.parse(e.data);
          if (msg.type === "ready" && !ready) {
            ready = true;
            this.server = msg;
            this.state = "open";
            this._attempt = 0;
            this.dispatchEvent(new CustomEvent("open", { detail: msg }));
            resolve(this);
          }
          this._onEvent(msg);
        } else {
          this._onFrame(e.data);
        }
      };
      ws.onclose = (e) => {
        this._onClose(e.code, e.reason);
        if (!ready) reject(new Error(`connection closed (${e.code}) ${e.reason ?? ""}`));
      };
      ws.onerror = () => {}; // onclose follows with the code
    });
  }

  _onClose(code, reason) {
    const wasOpen = this.state === "open";
    this.ws = null;
    for (const u of this.utterances.values()) {
      if (u.state === "open") this._fail(u, { code: "disconnected",
                                              message: `connection closed (${code})` });
    }
    this.dispatchEvent(new CustomEvent("close", { detail: { code, reason } }));
    const retry = this.options.reconnect ?? {};
    const retries = retry.retries ?? 5;
    const permanent = code === 1000 || code === 1008 || code === 1009 || code === 1007;
    if (this._closedByUser || permanent || this._attempt >= retries) {
      this.state = "closed";
      return;
    }
    if (!wasOpen && this._attempt === 0) { this.state = "closed"; return; }
    this._attempt += 1;
    this.state = "reconnecting";
    const base = retry.baseDelayMs ?? 250;
    const delay = Math.min(retry.maxDelayMs ?? 5000, base * 2 ** (this._attempt - 1))
      * (0.5 + Math.random() / 2);
    this.dispatchEvent(new CustomEvent("reconnecting", { detail: { attempt: this._attempt,
                                                                   delayMs: delay } }));
    setTimeout(() => {
      if (this._closedByUser) return;
      this._connectOnce().catch(() => {});
    }, delay);
  }

  _send(obj) {
    if (!this.ws || this.ws.readyState !== 1) throw new Error("not connected");
    this.ws.send(JSON.stringify(obj));
  }

  /**
   * Speak text: a string, or an (async) iterable of text pieces such as LLM tokens.
   * With no input the utterance stays open: feed it with `write()`, then `end()`.
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
    this.player?.announce(u.track);
    const start = { type: "start", context_id: contextId, sample_rate: u.sampleRate };
    for (const [k, key] of [["voice", "voice"], ["seed", "seed"], ["temperature", "temperature"],
      ["top_P", "top_P"], ["top_K", "top_K"], ["speed", "speed"], ["refine", "refine"],
      ["chunkSchedule", "chunk_schedule"], ["idleFlushMs", "idle_flush_ms"], ["cache", "cache"]]) {
      if (o[k] !== undefined) start[key] = o[k];
    }
    this._send(start);
    if (input === undefined) return u;
    this._feed(u, input).catch((err) => this._fail(u, { code: "input_error",
                                                         message: String(err) }));
    return u;
  }

  async _feed(u, input) {
    if (typeof input === "string") {
      this._send({ type: "text", context_id: u.contextId, text: input });
    } else {
      for await (const piece of input) {
        if (u.state !== "open") return;
        if (piece) this._send({ type: "text", context_id: u.contextId, text: piece });
      }
    }
    if (u.state === "open") this._send({ type: "end", context_id: u.contextId });
  }

  /** Synthesize what is buffered for a context now. @param {string} contextId */
  flush(contextId) {
    this._send({ type: "flush", context_id: contextId });
  }

  /**
   * Barge-in: stop a context now. Playback fades out within 5 ms, late frames are dropped.
   * @param {string} contextId
   * @returns {Promise<{playedMs: number, segments: Array}>} what was heard
   */
  async cancel(contextId) {
    const u = this.utterances.get(contextId);
    if (!u || u.state === "cancelled") return { playedMs: 0, segments: [] };
    const wasOpen = u.state === "open";
    u.state = "cancelled";
    if (wasOpen && this.ws && this.ws.readyState === 1) {
      this._send({ type: "cancel", context_id: contextId });
    }
    const heard = this.player ? await this.player.interrupt(u.track) : { played: 0, segments: {} };
    u._heardTotal = heard.played;
    u._heardSegments = heard.segments;
    u._emit("cancelled", u.heard());
    u._ended(heard);
    return u.heard();
  }

  /** Close the connection for good (no reconnect). */
  async close() {
    this._closedByUser = true;
    this.ws?.close(1000, "client closing");
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
    if (!u || u.state === "cancelled") return; // late frame of a cancelled context
    if (u.ttfaMs === null) {
      u.ttfaMs = performance.now() - u.createdAt;
      u._emit("started", { ttfaMs: u.ttfaMs });
    }
    this.player?.write(u.track, frame.header.segment, frame.pcm, u.sampleRate);
    u._emit("audio", { segment: frame.header.segment, sequence: frame.header.sequence,
                       pcm: frame.pcm, sampleRate: u.sampleRate });
  }

  _onEvent(msg) {
    const u = msg.context_id ? this.utterances.get(msg.context_id) : undefined;
    switch (msg.type) {
      case "segment_started":
        if (!u) return;
        u.stream = msg.stream;
        this.byStream.set(msg.stream, u);
        u.segments.push({ segment: msg.segment, text: msg.text, textStart: msg.text_start,
                          textEnd: msg.text_end, audioStartMs: msg.audio_start_ms,
                          durationMs: null, heardMs: 0, cached: Boolean(msg.cached) });
        u._emit("segment_started", msg);
        break;
      case "segment_done": {
        if (!u) return;
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
        u.audioMs = msg.audio_ms;
        this.player?.end(u.track);
        if (!this.player) u._ended({ played: 0, segments: {} });
        u._resolve({ segments: msg.segments, audioMs: msg.audio_ms });
        u._emit("done", msg);
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

  _fail(u, err) {
    if (u.state !== "open") return;
    u.state = "error";
    this.player?.end(u.track);
    u._reject(Object.assign(new Error(err.message), err));
    u._emit("error", err);
  }

  _onFinished(info) {
    const u = this.byTrack.get(info.stream);
    if (!u) return;
    u._heardTotal = info.played;
    u._heardSegments = info.segments;
    this.byTrack.delete(info.stream);
    if (u.stream !== null) this.byStream.delete(u.stream);
    this.utterances.delete(u.contextId);
    if (info.reason === "ended") {
      u._emit("ended", u.heard());
      u._ended(info);
    }
  }
}

/**
 * Connect to an rtts server and get a ready client.
 * @param {string} url e.g. "ws://localhost:8765/v1/stream"
 * @param {ConnectOptions} [options]
 * @returns {Promise<RttsClient>}
 */
export async function connect(url, options = {}) {
  const client = new RttsClient(url, options);
  await client.open();
  return client;
}
