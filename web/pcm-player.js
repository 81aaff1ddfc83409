// Gapless, interruptible PCM playback through an AudioWorklet (see pcm-player.worklet.js).
import { pcm16ToFloat32 } from "./protocol.js";

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
export const DEFAULT_CONTEXT_RATE = 24000;

/**
 * An AudioContext at `sampleRate` where the browser allows it, else at the device's rate.
 * @param {number} sampleRate
 * @returns {AudioContext}
 */
export function createAudioContext(sampleRate) {
  try {
    return new AudioContext({ latencyHint: "interactive", sampleRate });
  } catch {
    return new AudioContext({ latencyHint: "interactive" });
  }
}

export class PcmPlayer extends EventTarget {
  /** @param {PlayerOptions} [options] */
  constructor(options = {}) {
    super();
    this.options = options;
    /** @type {AudioContext | null} */
    this.context = options.audioContext ?? null;
    /** @type {AudioWorkletNode | null} */
    this.node = null;
    /** @type {AnalyserNode | null} */
    this.analyser = null;
    /** @type {PlayerStats | null} */
    this.stats = null;
    this._pending = new Map();
    this._nextId = 1;
  }

  /** Create the context (if needed), load the worklet, start output. */
  async connect() {
    if (this.node) return;
    this.context ??= createAudioContext(this.options.sampleRate ?? DEFAULT_CONTEXT_RATE);
    await this.context.audioWorklet.addModule(new URL("./pcm-player.worklet.js", import.meta.url));
    this.node = new AudioWorkletNode(this.context, "rtts-pcm-player", {
      numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
      processorOptions: { targetMs: this.options.targetMs, maxMs: this.options.maxMs,
                          fadeMs: this.options.fadeMs },
    });
    this.node.onprocessorerror = () =>
      this.dispatchEvent(new CustomEvent("error", { detail: new Error("audio worklet crashed") }));
    this.node.port.onmessage = (e) => this._onMessage(e.data);
    this.analyser = this.context.createAnalyser();
    this.analyser.fftSize = 1024;
    this.node.connect(this.analyser);
    this.node.connect(this.context.destination);
    if (this.context.state !== "running") await this.context.resume();
  }

  /** @returns {number} */
  get sampleRate() {
    return this.context ? this.context.sampleRate : 48000;
  }

  _onMessage(msg) {
    if (msg.type === "stats") {
      this.stats = msg;
      this.dispatchEvent(new CustomEvent("stats", { detail: msg }));
    } else if (msg.type === "finished") {
      this.dispatchEvent(new CustomEvent("finished", { detail: msg }));
    } else if (msg.type === "interrupted") {
      const resolve = this._pending.get(msg.id);
      this._pending.delete(msg.id);
      if (resolve) resolve(msg.heard);
    }
  }

  /** Reserve a track's place in the play order before its audio arrives. */
  announce(track) {
    this.node?.port.postMessage({ type: "announce", stream: track });
  }

  /**
   * Queue PCM16 samples for a track's segment.
   * @param {number} track @param {number} segment @param {Int16Array} pcm
   * @param {number} rate sample rate of `pcm`
   */
  write(track, segment, pcm, rate) {
    if (!this.node) return;
    const samples = pcm16ToFloat32(pcm);
    this.node.port.postMessage({ type: "write", stream: track, segment, samples, rate },
                               [samples.buffer]);
  }

  /** No more audio for this track. */
  end(track) {
    this.node?.port.postMessage({ type: "end", stream: track });
  }

  /**
   * Drop the audio of one segment of a track not yet played (the track goes on): the
   * client does it to a segment cut off by a dropped connection, which it says again.
   * @param {number} track @param {number} segment
   */
  dropSegment(track, segment) {
    this.node?.port.postMessage({ type: "drop", stream: track, segment });
  }

  /**
   * Stop a track now (5 ms fade) and drop its queued and late audio.
   * @param {number} track
   * @returns {Promise<{played: number, segments: Object<string, number>}>} samples heard
   */
  interrupt(track) {
    if (!this.node) return Promise.resolve({ played: 0, segments: {} });
    const id = this._nextId++;
    return new Promise((resolve) => {
      this._pending.set(id, resolve);
      this.node.port.postMessage({ type: "interrupt", stream: track, id });
      // A suspended or crashed worklet never answers: do not leave the caller waiting.
      setTimeout(() => {
        if (!this._pending.delete(id)) return;
        const pos = this.stats?.positions?.[track];
        resolve({ played: pos?.played ?? 0, segments: pos?.segments ?? {} });
      }, this.options.interruptTimeoutMs ?? 500);
    });
  }

  /** Current output level in [0, 1] (for meters). */
  level() {
    if (!this.analyser) return 0;
    const data = new Float32Array(this.analyser.fftSize);
    this.analyser.getFloatTimeDomainData(data);
    let peak = 0;
    for (const v of data) peak = Math.max(peak, Math.abs(v));
    return peak;
  }

  async close() {
    this.node?.disconnect();
    this.node = null;
    if (this.context && !this.options.audioContext) await this.context.close();
  }
}
