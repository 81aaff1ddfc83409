// AudioWorkletProcessor: a thin wrapper around JitterBuffer (see jitter-buffer.js).
// Messages in (port): {type:'write', stream, segment, samples: Float32Array, rate}
//   {type:'announce', stream} {type:'end', stream} {type:'interrupt', stream, id}
//   {type:'drop', stream, segment} (a segment's queued audio, for a resumed utterance)
// Samples arrive at the context's rate (the client asks the server for it). Only when the
// server cannot send that rate does a LinearResampler convert here (counted in `resampled`).
// Messages out: {type:'stats', ...} every ~50 ms, {type:'finished', stream, played,
//   segments, reason} when a stream leaves the queue, {type:'interrupted', id, heard}.
import { JitterBuffer } from "./jitter-buffer.js";
import { LinearResampler } from "./resampler.js";

class PcmPlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions ?? {};
    this.jb = new JitterBuffer({ sampleRate, targetMs: opts.targetMs, growMs: opts.growMs,
                                 maxMs: opts.maxMs, fadeMs: opts.fadeMs });
    /** @type {Map<string, LinearResampler>} */
    this.resamplers = new Map();
    this.calls = 0;
    this.nonSilent = 0; // render quanta with audible output (for tests and meters)
    this.samplesOut = 0;
    this.resampled = 0; // input samples through the linear fallback resampler
    this.afterInterrupt = new Map(); // stream -> audible samples output after interrupt
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    switch (msg.type) {
      case "announce":
        this.jb.announce(msg.stream);
        break;
      case "write": {
        let samples = msg.samples;
        if (msg.rate && msg.rate !== sampleRate) {
          const key = `${msg.stream}/${msg.rate}`;
          let r = this.resamplers.get(key);
          if (!r) this.resamplers.set(key, (r = new LinearResampler(msg.rate, sampleRate)));
          this.resampled += samples.length;
          samples = r.process(samples);
        }
        this.jb.push(msg.stream, msg.segment, samples);
        break;
      }
      case "end":
        this.jb.end(msg.stream);
        break;
      case "drop":
        this.jb.dropSegment(msg.stream, msg.segment);
        break;
      case "interrupt": {
        const heard = this.jb.interrupt(msg.stream);
        this.afterInterrupt.set(msg.stream, 0);
        this.port.postMessage({ type: "interrupted", id: msg.id, stream: msg.stream, heard });
        break;
      }
      default:
        break;
    }
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    const playing = this.jb.order[0];
    const fading = this.jb.fade ? this.jb.fade.stream : null;
    const written = this.jb.pull(out);
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.calls += 1;
    let peak = 0;
    for (let i = 0; i < out.length; i++) peak = Math.max(peak, Math.abs(out[i]));
    if (peak > 1e-3) {
      this.nonSilent += 1;
      this.samplesOut += written;
      if (fading !== null && this.afterInterrupt.has(fading)) {
        this.afterInterrupt.set(fading, this.afterInterrupt.get(fading) + written);
      } else if (playing !== undefined && this.afterInterrupt.has(playing)) {
        this.afterInterrupt.set(playing, this.afterInterrupt.get(playing) + written);
      }
    }
    for (const f of this.jb.finished.splice(0)) this.port.postMessage({ type: "finished", ...f });
    if (this.calls % 16 === 0) {
      this.port.postMessage({
        type: "stats", calls: this.calls, nonSilent: this.nonSilent,
        samplesOut: this.samplesOut, underruns: this.jb.underruns,
        bufferedMs: this.jb.bufferedMs, targetMs: this.jb.targetMs, level: peak,
        positions: this.jb.positions(), playing: this.jb.order[0] ?? null,
        afterInterrupt: Object.fromEntries(this.afterInterrupt), resampled: this.resampled,
        sampleRate,
      });
    }
    return true;
  }
}

registerProcessor("rtts-pcm-player", PcmPlayerProcessor);
