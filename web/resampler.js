// Streaming linear-interpolation resampler (pure; runs inside the AudioWorklet).
// A fallback only: the player's own AudioContext runs at the stream's rate, and the client
// asks the server (which resamples with soxr) for the context's rate. This runs only when the
// context's rate is one the server cannot send (an AudioContext passed in at, say, 32 or
// 96 kHz, or a browser that refused the requested rate). Linear interpolation aliases.

export class LinearResampler {
  /**
   * @param {number} fromRate
   * @param {number} toRate
   */
  constructor(fromRate, toRate) {
    this.step = fromRate / toRate; // input samples per output sample
    // Positions count from the previous chunk's last sample (index -1): pos 1 = input[0].
    this.pos = 1;
    this.prev = 0;
    this.passthrough = fromRate === toRate;
  }

  /**
   * @param {Float32Array} input
   * @returns {Float32Array}
   */
  process(input) {
    if (this.passthrough) return input;
    const n = input.length;
    if (n === 0) return new Float32Array(0);
    const out = new Float32Array(Math.ceil((n + 1 - this.pos) / this.step) + 1);
    let k = 0;
    let pos = this.pos;
    while (pos < n + 1) {
      const i = Math.floor(pos); // between x[i-1] and x[i], where x[-1] = prev
      const frac = pos - i;
      const a = i === 0 ? this.prev : input[i - 1];
      const b = i < n ? input[i] : a;
      if (i >= n) break;
      out[k++] = a + (b - a) * frac;
      pos += this.step;
    }
    this.pos = pos - n;
    this.prev = input[n - 1];
    return out.subarray(0, k);
  }
}
