// Jitter buffer and playback queue (pure logic; the AudioWorklet wraps it).
//
// Audio arrives as chunks tagged (stream, segment). Streams play one after another in
// the order they were first announced (an utterance queue), segments in order inside a
// stream, gaplessly. Playback of a stream starts once `targetMs` of audio is buffered,
// or as soon as the stream is marked ended (short utterances do not wait). When the
// buffer runs dry mid-stream (an underrun) the output is silence, the underrun is
// counted, the target grows by `growMs` (up to `maxMs`) and playback waits to refill.
// `interrupt(stream)` fades the playing stream out over `fadeMs` and drops the rest.

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
  constructor(options) {
    this.rate = options.sampleRate;
    this.targetMs = options.targetMs ?? 60;
    this.growMs = options.growMs ?? 40;
    this.maxMs = options.maxMs ?? 400;
    this.fadeSamples = Math.max(1, Math.round(((options.fadeMs ?? 5) * this.rate) / 1000));
    /** @type {Map<number, {chunks: Float32Array[], segs: number[], offset: number,
     *   buffered: number, ended: boolean, started: boolean, played: number,
     *   segments: Map<number, number>}>} */
    this.streams = new Map();
    /** @type {number[]} play order */
    this.order = [];
    this.underruns = 0;
    this.playedTotal = 0;
    this.fade = null; // {stream, left}
    this.dropped = new Set();
    /** @type {{stream: number, played: number, segments: Object<number, number>,
     *   reason: string}[]} streams that left the queue since the last drain */
    this.finished = [];
  }

  /** @param {number} stream */
  _stream(stream) {
    let s = this.streams.get(stream);
    if (!s) {
      s = { chunks: [], segs: [], offset: 0, buffered: 0, ended: false, started: false,
            played: 0, segments: new Map() };
      this.streams.set(stream, s);
      this.order.push(stream);
    }
    return s;
  }

  /**
   * Queue samples for (stream, segment). Late chunks of an interrupted stream are ignored.
   * @param {number} stream @param {number} segment @param {Float32Array} samples
   */
  push(stream, segment, samples) {
    if (this.dropped.has(stream) || samples.length === 0) return;
    const s = this._stream(stream);
    s.chunks.push(samples);
    s.segs.push(segment);
    s.buffered += samples.length;
  }

  /** No more audio will come for this stream. @param {number} stream */
  end(stream) {
    if (this.dropped.has(stream)) return;
    this._stream(stream).ended = true;
  }

  /** Announce a stream so it takes its place in the play order before audio arrives. */
  announce(stream) {
    if (!this.dropped.has(stream)) this._stream(stream);
  }

  /**
   * Stop a stream now: a short fade if it is playing, then drop everything it has.
   * @param {number} stream
   * @returns {{played: number, segments: Object<number, number>}} samples heard
   */
  interrupt(stream) {
    const s = this.streams.get(stream);
    this.dropped.add(stream);
    if (!s) return { played: 0, segments: {} };
    const heard = { played: s.played, segments: Object.fromEntries(s.segments) };
    if (this.order[0] === stream && s.started && s.buffered > 0) {
      this.fade = { stream, left: Math.min(this.fadeSamples, s.buffered) };
    } else {
      this._remove(stream, "interrupted");
    }
    return heard;
  }

  /**
   * Drop the queued audio of one segment of a stream (a chunk already playing finishes);
   * the stream goes on. Returns the samples dropped.
   * @param {number} stream @param {number} segment
   * @returns {number}
   */
  dropSegment(stream, segment) {
    const s = this.streams.get(stream);
    if (!s) return 0;
    let dropped = 0;
    for (let i = s.chunks.length - 1; i >= 0; i--) {
      if (s.segs[i] !== segment || (i === 0 && s.offset > 0)) continue;
      dropped += s.chunks[i].length;
      s.chunks.splice(i, 1);
      s.segs.splice(i, 1);
    }
    s.buffered -= dropped;
    return dropped;
  }

  _remove(stream, reason) {
    const s = this.streams.get(stream);
    if (!s) return;
    this.finished.push({ stream, played: s.played, segments: Object.fromEntries(s.segments),
                         reason });
    this.streams.delete(stream);
    this.order = this.order.filter((x) => x !== stream);
  }

  get bufferedMs() {
    let n = 0;
    for (const s of this.streams.values()) n += s.buffered;
    return (n * 1000) / this.rate;
  }

  /**
   * Fill `out` (one render quantum) and return how many samples were audio.
   * @param {Float32Array} out
   * @returns {number}
   */
  pull(out) {
    out.fill(0);
    let written = 0;
    while (written < out.length && this.order.length) {
      const id = this.order[0];
      const s = this.streams.get(id);
      if (this.fade && this.fade.stream === id) {
        written = this._fadeOut(s, out, written);
        continue;
      }
      if (!s.started) {
        const need = (this.targetMs * this.rate) / 1000;
        if (s.buffered >= need || (s.ended && s.buffered > 0)) s.started = true;
        else if (s.ended && s.buffered === 0) { this._remove(id, "ended"); continue; }
        else break; // prebuffering
      }
      if (s.buffered === 0) {
        if (s.ended) { this._remove(id, "ended"); continue; } // next stream, gapless
        this.underruns += 1;
        s.started = false;
        this.targetMs = Math.min(this.maxMs, this.targetMs + this.growMs);
        break;
      }
      written += this._copy(s, out, written, out.length - written, 1, 0);
    }
    this.playedTotal += written;
    return written;
  }

  _copy(s, out, at, want, gainStart, gainStep) {
    let copied = 0;
    let gain = gainStart;
    while (copied < want && s.chunks.length) {
      const chunk = s.chunks[0];
      const seg = s.segs[0];
      const n = Math.min(want - copied, chunk.length - s.offset);
      for (let i = 0; i < n; i++) {
        out[at + copied + i] = chunk[s.offset + i] * gain;
        gain = Math.max(0, gain - gainStep);
      }
      s.offset += n;
      copied += n;
      s.buffered -= n;
      s.played += n;
      s.segments.set(seg, (s.segments.get(seg) ?? 0) + n);
      if (s.offset >= chunk.length) {
        s.chunks.shift();
        s.segs.shift();
        s.offset = 0;
      }
    }
    return copied;
  }

  _fadeOut(s, out, at) {
    const left = this.fade.left;
    const n = Math.min(left, out.length - at);
    const step = 1 / this.fadeSamples;
    const gain0 = left / this.fadeSamples;
    this._copy(s, out, at, n, gain0, step);
    this.fade.left -= n;
    if (this.fade.left <= 0 || s.buffered === 0) {
      const id = this.fade.stream;
      this.fade = null;
      this._remove(id, "interrupted");
    }
    return at + n;
  }

  /** Samples heard per stream and segment (for playback position reporting). */
  positions() {
    const out = {};
    for (const [id, s] of this.streams) out[id] = { played: s.played,
      segments: Object.fromEntries(s.segments) };
    return out;
  }
}
