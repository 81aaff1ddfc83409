"""The ChatTTS engine: real ChatTTS weights layout and modules, rtts's own streaming loop.

Loading goes through ``ChatTTS.Chat.load`` (hub or local directory, or a random-weight
checkpoint from :mod:`rtts.engines.checkpoint`). Generation drives the loaded modules
directly instead of ``Chat.infer(stream=True)``, because that API

* conditions every row of a batch on one speaker, one speed and one params object
  (and mutates that object), while a server batches *different* streams;
* yields nothing before 72 GPT tokens and re-decodes the whole prefix at every yield,
  so decode work grows quadratically with utterance length;
* hides where each row ends (finished rows keep producing audio);
* can only be interrupted for the whole ``Chat`` at once.

Here each row gets its own speaker embedding and speed prompt, the GPT yields every
``stream_tokens`` steps; the first audio is decoded at the first yield, later decodes
grow geometrically up to ``decode_tokens`` tokens, and each covers only the new tokens plus
``decode_context`` tokens of left context (linear total decode work), holding back the
last ``decode_lookahead`` tokens until their right context exists. A row is finished
when its token count stops growing. Cancelling a request skips its decode; closing this
generator (the scheduler does when every row is cancelled) closes the GPT generator,
which stops at its next step.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rtts.config import EngineConfig
from rtts.core.params import (
    FRAMES_PER_SECOND,
    MAX_SAMPLE_SECONDS,
    NO_SPEAKER,
    SpeakerSample,
    SynthParams,
)
from rtts.core.speaker import decode_speaker
from rtts.engines import kernels
from rtts.engines.base import EngineInfo, EngineOutput, SynthRequest, fixed_batch
from rtts.engines.gpt_loop import (
    BatchedGpt,
    CompiledDecode,
    GptRow,
    RowSpec,
    ThreadTuner,
    fuse_projections,
    install_heads,
    layer_plan,
)

__all__ = ["ChatTTSEngine", "StockChatTTSEngine", "check_torchaudio", "configure_threads_env",
           "realtime_capacity"]

logger = logging.getLogger("rtts.chattts")

# weight precision -> the decoder precisions timed at load, the fastest kept (fp32 and
# forced fp32 kernels: none, the decoder stays fp32 and exact). The near-lossless ones may
# decode in bf16 (41 dB from the fp32 decode on random weights), the lossy ones in int8 too
DECODE_CANDIDATES: dict[str, tuple[str, ...]] = {
    "auto": ("fp32", "bf16"), "bf16": ("fp32", "bf16"),
    "int8": ("fp32", "bf16", "int8"), "int4": ("fp32", "bf16", "int8")}
# weight precision -> how many times faster than the faster of fp32 and bf16 an int8
# decoder (int8_decoder) must be to be chosen: its audio is further from the fp32 decode
# (33 against 41 dB). int4's GPT is 23 dB from fp32's decoded audio already, so there the
# decoder's 33 dB adds little (about 0.4 dB) and the fastest decoder is taken.
INT8_DECODE_MARGIN: dict[str, float] = {"int8": 1.25, "int4": 1.0}
SAMPLES_PER_TOKEN = 512  # 1 GPT step = 2 mel frames x hop 256 at 24 kHz
TOKENS_PER_SECOND = 24000 / SAMPLES_PER_TOKEN  # 46.875 GPT steps per second of audio
PREFILL_WINDOW_S = 4.0  # audio seconds per window of the prefill average


def realtime_capacity(step_ms: dict[int, float], per_audio_s: float, slots: int) -> int:
    """The most rows that stay real time: ``rows`` streams need, per second, 46.875 steps
    of ``rows`` rows plus ``rows`` times ``per_audio_s``, the engine's other seconds per
    second of audio (decoding, and the prefill of the segments that join). Only measured
    row counts count; 0 when none is real time (or none was measured yet)."""
    best = 0
    for rows, ms in sorted(step_ms.items()):
        need = TOKENS_PER_SECOND * ms / 1000 + rows * per_audio_s
        if rows <= slots and need <= 1.0:
            best = rows
    return best


def configure_threads_env() -> None:
    """Before torch loads: OpenMP's wait policy for idle workers.

    rtts leaves OpenMP's default (spin briefly, then sleep) unless ``RTTS_OMP_WAIT_POLICY``
    names one; an explicit ``OMP_WAIT_POLICY`` always wins. Forcing PASSIVE (workers sleep
    at once, so the event loop's thread gets the cores) used to be the default, but with the
    continuous-batching loop it made 4-row steps 30% slower on the 2-core AMD EPYC
    (``engine.generate`` of 4 x 128 tokens: 150 ms a step PASSIVE, 115 ACTIVE, 105-122
    default), many short parallel regions each paying a wake-up.
    """
    policy = os.environ.get("RTTS_OMP_WAIT_POLICY")
    if policy and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", policy)


def check_torchaudio() -> None:
    """Import torchaudio, turning its CUDA-only binary failure into an actionable error."""
    try:
        import torchaudio  # noqa: F401
    except OSError as exc:
        raise RuntimeError(
            "torchaudio ships CUDA-linked extension libraries that cannot load with a CPU "
            "build of torch. Run `rtts doctor --fix` once (it moves them aside; ChatTTS only "
            f"needs torchaudio's pure-Python parts). Original error: {exc}"
        ) from exc


class ChatTTSEngine:
    name = "chattts"
    sample_rate = 24000
    continuous = True  # serve(): requests join the running batch
    bake_weight_norm = True
    select_kernels = True  # measure and install the GPT's linear kernels (kernels.py)
    samples = True  # conditions rows on samples, reports each request's codes (anchoring)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = "cpu"
        self.chat: Any = None
        self.random_weights = False
        self.model_path: str | None = None
        self.identity = "chattts:unloaded"
        # what /v1/info, the ready event and /metrics report: kind real|random, source, id
        self.weights: dict[str, str] = {"kind": "unloaded", "source": "", "identity": ""}
        self._voices: OrderedDict[str, Any] = OrderedDict()
        self._voice_lock = threading.Lock()
        self._encode_lock = threading.Lock()  # one DVAE encode at a time
        self._default_voice: Any = None
        self.kernel_table: kernels.KernelTable | None = None
        # torch's thread count, chosen from the steps as they run (gpt_loop.ThreadTuner)
        self.thread_tuner: ThreadTuner | None = None
        self.compiled: CompiledDecode | None = None  # --compile: the decode step compiled
        self.decode_s_per_audio_s = 0.0  # moving average over the decodes as they run
        # Prefill (segments joining the batch) per second of audio decoded, a moving
        # average over windows of PREFILL_WINDOW_S: every running row waits while a joiner
        # prefills (a 242-token anchored prompt: ~110 ms a row on the 2-core Xeon, int4),
        # so it is time the real-time capacity must cover, as decoding is.
        self.prefill_s_per_audio_s = 0.0
        self._prefill_window = [0.0, 0.0]  # prefill seconds, audio seconds, this window
        self.decode_dtype = "fp32"  # the decoder's precision (_choose_decode_dtype)
        # decode row counts whose eager steps run the fp16 layer loop (fp16layers)
        self.layer_loop_rows: list[int] = []
        self.decode_ms: dict[str, float] = {}  # decode dtype -> ms of the load-time probe
        # decode dtype -> twins of the DVAE decoder and vocos in it (DECODER_TWINS), made
        # when first needed; only the chosen one is kept after the load-time probe
        self._decoders: dict[str, tuple[Any, Any]] = {}

    @property
    def info(self) -> EngineInfo:
        table, tuner = self.kernel_table, self.thread_tuner
        kern: dict[str, Any] | None = (None if table is None else
                                       {"dtype": table.dtype, "chosen": table.chosen,
                                        "kv_dtype": table.kv_dtype,
                                        "template": table.template,
                                        "decode_dtype": self.decode_dtype,
                                        "layer_loop_rows": self.layer_loop_rows,
                                        # the linears' ms per row count, timed at load (the
                                        # scheduler's estimate for a count not run yet)
                                        "linear_ms": {r: round(ms, 2) for r, ms
                                                      in table.linear_ms().items()}})
        if kern is not None and tuner is not None:
            kern["threads"] = tuner.current  # torch threads the decode steps run on now
            steps = tuner.step_ms()
            kern["step_ms"] = {r: round(ms, 2) for r, ms in steps.items()}
            kern["decode_s_per_audio_s"] = round(self.decode_s_per_audio_s, 4)
            kern["prefill_s_per_audio_s"] = round(self.prefill_s_per_audio_s, 4)
            # measured from the steps as they run: what an autoscaler or balancer reads
            kern["realtime_streams"] = realtime_capacity(
                steps, self.decode_s_per_audio_s + self.prefill_s_per_audio_s,
                self.config.batch_rows)
        return EngineInfo(self.name, self.sample_rate, device=self.device,
                          continuous=self.continuous, weights=dict(self.weights),
                          kernels=kern, samples=self.samples, **self._scheduling())

    def _scheduling(self) -> dict[str, Any]:
        """The scheduler shape this engine needs (none: the server's settings)."""
        return {}

    # -- loading ---------------------------------------------------------------------

    def load(self) -> None:
        configure_threads_env()
        check_torchaudio()
        import torch
        import transformers
        from ChatTTS import Chat

        transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        warnings.filterwarnings("ignore", message=".*past_key_values.*")

        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            self.device = cfg.device
        chat, found = self._load_first(Chat, torch)
        path = found.path
        # fp32 weights (asked for, or forced fp32 kernels): fp32 keys/values and decoder too
        exact = cfg.dtype == "fp32" or cfg.kernels in ("linear", "transposed")
        if self.bake_weight_norm:
            _bake_weight_norm(chat)
        if self.select_kernels:
            # q/k/v and gate/up as one matrix each, before their kernels are chosen
            fuse_projections(chat.gpt.gpt)
            self.kernel_table = kernels.install(
                chat.gpt.gpt, cfg.dtype, max_rows=cfg.batch_rows,
                device="cpu" if self.device == "cpu" else "cuda",
                force=None if cfg.kernels == "auto" else cfg.kernels, uniform=cfg.compile,
                template=cfg.compile)
            install_heads(chat.gpt, chat.config.gpt.num_vq, self.kernel_table)
            g = chat.gpt.gpt.config
            head_dim = getattr(g, "head_dim", None) or g.hidden_size // g.num_attention_heads
            kv, kv_us = kernels.choose_kv_dtype(
                "fp32" if exact else cfg.dtype, g.num_hidden_layers, g.num_key_value_heads,
                head_dim, rows=min(4, max(1, cfg.batch_rows)),
                device="cpu" if self.device == "cpu" else "cuda", compiled=cfg.compile,
                force=cfg.kv_dtype)
            self.kernel_table.kv_dtype, self.kernel_table.kv_us = kv, kv_us
            if kv_us:
                logger.info("GPT keys/values in %s (%s us per layer: %s)", kv,
                            "compiled attention" if cfg.compile else "SDPA",
                            ", ".join(f"{k} {v:.0f}" for k, v in kv_us.items()))
            fp16_rows = sorted(r for r, p in self.kernel_table.chosen.items()
                               if p == "fp16" and r != kernels.PREFILL_ROWS)
            if fp16_rows and not cfg.compile and kv == "fp32":
                # built now (a few seconds the first time), not at the first request
                plan = layer_plan(chat.gpt)
                self.layer_loop_rows = fp16_rows if plan is not None else []
                logger.info("eager decode steps of %s rows: %s", fp16_rows,
                            "the fp16 layer loop (one C++ call for the GPT's layers)"
                            if plan is not None else "torch's ops (no fp16 layer loop here)")
        self.chat = chat
        self.model_path = str(path)
        self.random_weights = found.kind == "random"
        digest = _identity(cfg, path, "custom")
        self.identity = f"{self.name}:{digest}"
        self.weights = {
            "kind": found.kind, "source": found.source,
            "identity": (f"{found.repo}@{found.revision}" if found.repo and found.revision
                         else f"sha256:{digest}"),
        }
        if found.kind == "random":
            from rtts.engines.weights import REAL_SPEECH_HINT

            logger.warning("serving RANDOM weights from %s: real ChatTTS code, noise for a "
                           "voice; for tests and benchmarks only. %s", path, REAL_SPEECH_HINT)
        else:
            logger.info("serving real ChatTTS weights %s (%s, %s)", self.weights["identity"],
                        found.source, path)
        self._default_voice = self._voice_tensor(f"seed:{cfg.default_voice_seed}")
        if self.select_kernels and self.device == "cpu" and not exact:
            self._choose_decode_dtype(DECODE_CANDIDATES[cfg.dtype])
        threads = torch.get_num_threads()
        if cfg.compile and self.select_kernels:
            self.compiled = CompiledDecode(kernels.compile_options(self.kernel_table))
        if self.device == "cpu":
            # With a compiled step, one count only: its generated loops keep the thread
            # count they were compiled with, so switches would reach only the linears. The
            # tuner still times the steps (the measured capacity in /v1/info and /metrics).
            choices = [threads] if self.compiled is not None or threads <= 1 else [threads, 1]
            self.thread_tuner = ThreadTuner(choices, torch.set_num_threads)

    def _choose_decode_dtype(self, candidates: tuple[str, ...]) -> None:
        """The decoder's precision (DVAE decoder and vocos), measured at load among
        ``candidates`` (DECODE_CANDIDATES: fp32, bf16 (:func:`bf16_decoder`), and for the
        lossy weight precisions int8 (:func:`int8_decoder`)). One 4-row decode of 40-token
        windows each, interleaved, best of 3; the faster of fp32 and bf16, and int8 only
        where it is ``INT8_DECODE_MARGIN`` times faster than that (its audio is further
        from fp32's; for int4, whose GPT is further still, the fastest of the three).

        Measured on a Sapphire Rapids Xeon (2 threads, shared): bf16 0.055 -> 0.029 s per
        second of audio at 4 rows, 0.084 -> 0.069 at 1; decoded audio 41 dB from the fp32
        decode (random weights), above int8's 32 dB and int4's 23 dB from the fp32 GPT. On
        a Xeon without AMX/AVX512-BF16 (model 207, quiet), bf16 is 2.3-4x slower than
        fp32 and int8 2x faster (ms: 1 x 24 tokens fp32 36, int8 18, bf16 84; 4 x 24: 76,
        39, 275; 4 x 48: 128, 62, 522), int8's audio 33 dB from fp32's. On an AMD EPYC
        with AVX512-BF16 (2 threads, quiet), bf16 is 2.1-2.7x faster than fp32 (1 x 24:
        63 -> 23 ms; 4 x 40: 187 -> 88), which `auto` and `bf16` now take too."""
        import torch

        hidden = int(self.chat.gpt.gpt.config.hidden_size)
        gen = torch.Generator().manual_seed(0)
        windows = [torch.randn(40, hidden, generator=gen) for _ in range(4)]
        best = {name: float("inf") for name in candidates}
        for _ in range(4):  # the first pass warms them up
            for name in best:
                t0 = time.perf_counter()
                self._decode([w.clone() for w in windows], name)
                best[name] = min(best[name], 1000 * (time.perf_counter() - t0))
        self.decode_ms = best
        near = min((k for k in best if k != "int8"), key=lambda k: best[k])
        lossy = best.get("int8", float("inf"))
        margin = INT8_DECODE_MARGIN.get(self.config.dtype, INT8_DECODE_MARGIN["int8"])
        self.decode_dtype = "int8" if lossy * margin < best[near] else near
        self._decoders = {k: v for k, v in self._decoders.items() if k == self.decode_dtype}
        logger.info("decoder in %s (4 x 40 tokens: %s)", self.decode_dtype,
                    ", ".join(f"{k} {v:.0f} ms" for k, v in best.items()))

    def _decode(self, windows: list[Any], dtype: str | None = None) -> Any:
        """Hidden-state windows (tokens, hidden) -> waveforms (rows, samples), as ChatTTS's
        ``_decode_to_wavs``, in ``dtype`` (default: the chosen ``decode_dtype``)."""
        import torch

        dtype = dtype or self.decode_dtype
        make = DECODER_TWINS.get(dtype)
        if make is None:
            return self.chat._decode_to_wavs(windows, True)
        twins = self._decoders.get(dtype)
        if twins is None:  # the probe, or decode_dtype set by hand (tests, bench kernels)
            twins = self._decoders[dtype] = make(self.chat)
        decoder, vocos = twins
        width = max(int(w.shape[0]) for w in windows)
        batch = torch.zeros(len(windows), int(windows[0].shape[1]), width,
                            dtype=windows[0].dtype, device=windows[0].device)
        for i, w in enumerate(windows):
            batch[i, :, : w.shape[0]] = w.T
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16,
                                                    enabled=dtype == "bf16"):
            return vocos.decode(decoder(batch)).float().cpu().numpy()

    def _load_first(self, chat_class: Any, torch: Any) -> tuple[Any, Any]:
        """The first weights of :func:`rtts.engines.weights.candidates` that load (sha256
        checked by ChatTTS); a candidate that fails is logged and the next one tried."""
        from rtts.engines.checkpoint import apply_overrides
        from rtts.engines.weights import candidates, snapshot_sha256_map

        cfg = self.config
        reasons = []
        for found in candidates(cfg.source, cfg.model_dir):
            path = found.path
            if not path.is_dir():
                reasons.append(f"{path}: no such directory")
                logger.warning("model directory %s does not exist", path)
                continue
            chat = chat_class(logger=logging.getLogger("rtts.chattts.core"))
            if found.kind == "random":
                apply_overrides(chat, path)
            if found.source in ("hf-cache", "download"):
                try:  # check against what the hub published, not the package's table
                    chat.sha256_map = snapshot_sha256_map(path)
                except (OSError, ValueError) as exc:
                    reasons.append(f"{path}: {exc}")
                    logger.warning("skipping %s: %s", path, exc)
                    continue
            t0 = time.monotonic()
            logger.info("loading %s ChatTTS weights from %s (%s) on %s ...", found.kind,
                        path, found.source, self.device)
            if chat.load(source="custom", custom_path=str(path),
                         device=torch.device(self.device), compile=False):
                logger.info("weights loaded in %.1fs", time.monotonic() - t0)
                return chat, found
            reasons.append(f"{path}: assets missing or sha256 check failed")
            logger.warning("could not load the weights in %s: assets missing or sha256 "
                           "check failed (see the log above)%s", path,
                           "" if cfg.source in ("custom", "random") else "; trying the next "
                           "source")
        raise RuntimeError("ChatTTS could not load a model: " + "; ".join(reasons or
                           ["no source left"]))

    def warmup(self) -> None:
        """One short generation: numba JIT, allocator and kernel warm-up; with
        ``compile``, the decode step compiled first (gpt_loop.CompiledDecode)."""
        if self.compiled is not None and not self.compiled.ready:
            logger.info("compiling the GPT decode step (torch.compile, 1 and 2+ rows; "
                        "about a minute each on 2 cores) ...")
            took = self.compiled.compile(
                self.batch, lambda n: self._specs([SynthRequest(
                    f"warm up {i}.", SynthParams(seed=i), max_new_token=16)
                    for i in range(n)]), slots=self.config.batch_rows)
            logger.info("decode step compiled in %.0f s", took)
        logger.info("warming up (one short generation: JIT, allocator, kernels) ...")
        for _ in self.generate([SynthRequest("warm up, 你好。", SynthParams(),
                                             max_new_token=2 * self.config.stream_tokens)]):
            pass

    def close(self) -> None:
        if self.chat is not None:
            self.chat.unload()
            self.chat = None

    # -- voices ------------------------------------------------------------------------

    def _voice_tensor(self, voice: str | None) -> Any:
        """Speaker embedding tensor for ``voice`` (``seed:N``, a ChatTTS string, or None)."""
        import torch

        if voice is None:
            return self._default_voice
        if voice == NO_SPEAKER:
            return None  # [empty_spk]: the sample alone
        with self._voice_lock:
            cached = self._voices.get(voice)
            if cached is not None:
                self._voices.move_to_end(voice)
                return cached
        speaker = self.chat.speaker
        if voice.startswith("seed:"):
            gen = torch.Generator().manual_seed(int(voice[5:]))
            std, mean = speaker.std.float().cpu(), speaker.mean.float().cpu()
            tensor = torch.randn(speaker.dim, generator=gen) * std + mean
        else:
            # bounded (ChatTTS's Speaker._decode inflates whatever it is given, in full):
            # SpeakerError is a ValueError with the reason
            arr = decode_speaker(voice, dim=int(speaker.dim))
            tensor = torch.from_numpy(arr)
        with self._voice_lock:
            self._voices[voice] = tensor
            while len(self._voices) > 256:
                self._voices.popitem(last=False)
        return tensor

    def validate(self, params: SynthParams) -> None:
        """Raise ``ValueError`` if the params cannot be used with this model."""
        self._voice_tensor(params.voice)
        if params.voice == NO_SPEAKER and params.sample is None:
            raise ValueError(f"voice {NO_SPEAKER} needs a speaker sample")
        if params.sample is not None:
            self._sample_codes(params.sample)

    def _sample_codes(self, sample: SpeakerSample) -> Any:
        """The ``(num_vq, frames)`` code tensor of ``sample``, checked against the model."""
        import torch

        cfg = self.chat.config.gpt
        frames = sample.frames
        if sample.num_vq != cfg.num_vq or frames < 1 or \
                len(sample.codes) != 2 * sample.num_vq * frames:
            raise ValueError(f"speaker sample must have {cfg.num_vq} codebooks")
        if frames > MAX_SAMPLE_SECONDS * FRAMES_PER_SECOND + 1:
            raise ValueError(f"speaker sample is longer than {MAX_SAMPLE_SECONDS:g} s")
        arr = np.frombuffer(sample.codes, dtype="<u2").reshape(sample.num_vq, frames)
        if int(arr.max()) >= cfg.num_audio_tokens - 1:
            raise ValueError("speaker sample has codes this model does not have")
        return torch.from_numpy(arr.astype(np.int64))

    def encode_sample(self, audio: npt.NDArray[np.float32], text: str) -> SpeakerSample:
        """ChatTTS's ``sample_audio_speaker``: the DVAE encoder's codes of ``audio`` (24 kHz
        mono float32), with ``text`` normalized as a segment's text is."""
        import torch

        chat = self.chat
        if chat is None:
            raise RuntimeError("engine not loaded")
        if audio.ndim != 1 or audio.size < 2 * SAMPLES_PER_TOKEN:
            raise ValueError("the clip is too short")
        if not np.isfinite(audio).all():
            raise ValueError("the clip has non-finite samples")
        with torch.no_grad(), self._encode_lock:
            codes = chat.dvae.sample_audio(torch.from_numpy(
                np.ascontiguousarray(audio, dtype=np.float32)).to(chat.device))
        arr = codes.to("cpu", torch.int64).numpy()
        if arr.ndim != 2:
            raise ValueError("the DVAE gave no codes for this clip")
        spoken = chat.normalizer(text, True, True, None) or text
        return SpeakerSample(np.ascontiguousarray(arr.astype("<u2")).tobytes(), spoken,
                             int(arr.shape[0]))

    def batch_key(self, params: SynthParams) -> Hashable:
        return None  # voice, speed and every sampling setting are per row

    def random_speaker(self) -> str:
        return str(self.chat.sample_random_speaker())

    # -- generation --------------------------------------------------------------------

    @property
    def _fixed_length(self) -> bool:
        """Benchmarks: every segment runs exactly its ``_max_tokens`` steps (EOS masked)."""
        return bool(self.config.fixed_tokens or self.config.fixed_tokens_per_char)

    def _max_tokens(self, request: SynthRequest) -> int:
        if request.max_new_token is not None:
            return request.max_new_token
        if self.config.fixed_tokens:
            return self.config.fixed_tokens
        if self.config.fixed_tokens_per_char:
            return max(8, math.ceil(self.config.fixed_tokens_per_char * len(request.text)))
        cap = self.config.max_new_token
        if request.degraded:
            cap = cap * 3 // 4
        return min(cap, 48 + 10 * len(request.text))

    def _texts(self, batch: Sequence[SynthRequest]) -> list[str]:
        chat = self.chat
        texts = [chat.normalizer(r.text, True, True, None) or r.text for r in batch]
        for k, r in enumerate(batch):
            # Refine is an extra GPT pass over the text (the running rows wait for it):
            # per request, and skipped under load.
            if r.params.refines and not r.degraded:
                refined = chat._refine_text([texts[k]], chat.device,
                                            _refine_params(chat, r.params))
                ids = [i[i.less(chat.tokenizer.break_0_ids)] for i in refined.ids]
                out = chat.tokenizer.decode(ids)
                refined.destroy()
                texts[k] = out[0] or texts[k]
        return texts

    def _specs(self, batch: Sequence[SynthRequest]) -> list[RowSpec]:
        """Prompt embeddings (speaker, speed and sample applied) and sampling settings per
        row. A row with a sample (``params.sample``: a voice's reference clip, or its
        context's first segment) is ChatTTS's ``spk_smp``/``txt_smp`` prompt,
        ``[Stts][spk_emb]{sample text}[speed_N]{text}[Ptts]`` (``[empty_spk]`` for a
        sample-only voice) followed by the sample's codes; it is encoded alone (ChatTTS's
        tokenizer takes one code prompt per batch), the plain rows together."""
        chat = self.chat
        texts = self._texts(batch)
        num_vq = chat.config.gpt.num_vq
        embs: list[Any] = [None] * len(batch)
        plain = [k for k, r in enumerate(batch) if r.params.sample is None]
        groups: list[tuple[list[int], Any]] = []
        if plain:
            groups.append((plain, None))
        groups += [([k], r.params.sample) for k, r in enumerate(batch)
                   if r.params.sample is not None]
        for rows, sample in groups:
            input_ids, attention_mask, text_mask = self._encode(
                [batch[k] for k in rows], [texts[k] for k in rows], sample)
            emb = chat.embed(input_ids, text_mask)
            for j, k in enumerate(rows):
                voice = self._voice_tensor(batch[k].params.voice)
                if voice is not None:
                    chat.speaker.apply(emb[j:j + 1], voice, input_ids[j:j + 1],
                                       chat.tokenizer.spk_emb_ids, chat.gpt.device_gpt)
                embs[k] = emb[j][attention_mask[j].bool()].detach()
        fixed = self._fixed_length
        specs = []
        for k, r in enumerate(batch):
            limit = self._max_tokens(r)
            p = r.params
            r.produced = SpeakerSample(b"", texts[k], num_vq)  # codes filled at its end
            specs.append(RowSpec(
                emb=embs[k], limit=limit,
                min_tokens=limit if fixed else 0, temperature=p.temperature, top_p=p.top_P,
                top_k=p.top_K, seed=p.seed, penalty=p.repetition_penalty, tag=r))
        return specs

    def _encode(self, rows: Sequence[SynthRequest], texts: Sequence[str],
                sample: SpeakerSample | None) -> tuple[Any, Any, Any]:
        """ChatTTS's tokenizer over the decorated prompts of ``rows`` (all with ``sample``
        or all without): ``(input_ids (B, T, num_vq), attention_mask, text_mask)``."""
        chat = self.chat
        prompts: list[str] = []
        for r, text in zip(rows, texts, strict=True):
            spk = None if r.params.voice == NO_SPEAKER else "spk"
            prompts += chat.speaker.decorate_code_prompts(
                [text], f"[speed_{r.params.speed}]", None if sample is None else sample.text,
                spk)
        return chat.tokenizer.encode(  # type: ignore[no-any-return]
            prompts, chat.config.gpt.num_vq,
            prompt=None if sample is None else self._sample_codes(sample),
            device=chat.device_gpt)

    def prompt_tokens(self, request: SynthRequest) -> Any:
        """The ``(T, num_vq)`` prompt token ids of ``request`` as it would join a batch
        (tests and debugging: what a row is conditioned on)."""
        ids, mask, _ = self._encode([request], self._texts([request]), request.params.sample)
        return ids[0][mask[0].bool()]

    def batch(self, slots: int) -> BatchedGpt:
        """An empty continuous batch of ``slots`` rows over the loaded GPT."""
        chat = self.chat
        if chat is None:
            raise RuntimeError("engine not loaded")
        import torch

        table = self.kernel_table
        kv = sdpa = None
        solo = True
        if table is not None:
            kv = getattr(torch, kernels.KV_TORCH[table.kv_dtype])
            sdpa = getattr(torch, kernels.KV_TORCH[kernels.sdpa_dtype(table.kv_dtype,
                                                                      table.kv_us)])
            solo = kernels.solo_attention(table.kv_dtype, table.kv_us)
        return BatchedGpt(chat.gpt, chat.config.gpt.num_vq,
                          eos_token=chat.config.gpt.num_audio_tokens - 1, slots=slots,
                          kv_dtype=kv, decode=self.compiled, sdpa_dtype=sdpa,
                          solo_attention=solo, native_rows=self.layer_loop_rows)

    def generate(self, batch: Sequence[SynthRequest]) -> Iterator[EngineOutput]:
        """A fixed batch: every row starts together, nobody joins (static batching)."""
        return fixed_batch(self.serve, batch)

    def serve(self, admit: Callable[[int], Sequence[SynthRequest]], slots: int
              ) -> Generator[tuple[SynthRequest, npt.NDArray[np.float32] | None], None, None]:
        """Continuous batching: before every GPT step, ``admit(free)`` may hand over up to
        ``free`` new requests, which join the running batch. Yields ``(request, samples)``
        in order per request, then ``(request, None)`` once (also for a cancelled one).
        Returns when no row is left and ``admit`` gives nothing."""
        import torch

        gpt = self.batch(slots)
        live: list[_Live] = []
        if self.thread_tuner is not None:
            self.thread_tuner.apply()
        with torch.no_grad():
            while True:
                gpt.cancel(lambda row: row.spec.tag.cancelled.is_set())
                gpt.evict_done()
                new = list(admit(gpt.free_slots)) if gpt.free_slots else []
                if new:
                    t0 = time.perf_counter()
                    specs = self._specs(new)
                    t1 = time.perf_counter()
                    rows = gpt.add(specs)
                    self._prefill_window[0] += time.perf_counter() - t1
                    live += [_Live(r, row) for r, row in zip(new, rows, strict=True)]
                    logger.debug("joined %d (prefill %.0f ms): %d rows live at step %d",
                                 len(new), 1000 * (time.perf_counter() - t0),
                                 len(gpt.rows), gpt.steps)
                if not live:
                    return
                if gpt.rows:
                    t0 = time.perf_counter()
                    gpt.step()
                    if self.thread_tuner is not None:
                        self.thread_tuner.observe(gpt.forward_rows[-1],
                                                  time.perf_counter() - t0)
                yield from self._decode_live(live)
                live = [x for x in live if not x.done]

    def _decode_live(self, live: list[_Live]) -> Iterator[tuple[SynthRequest,
                                                             npt.NDArray[np.float32] | None]]:
        """Decode each row's new tokens once enough exist (its last ones when it ends).
        A decode that runs anyway also takes every row with half its window ready: a
        decode call has a fixed cost (1 row x 40 tokens 17 ms, 4 rows 38 ms on the 2-core
        Xeon), and rows decoded together stay in step, so later decodes batch too."""
        cfg = self.config
        due, windows, spans = [], [], []
        ready: list[tuple[_Live, int, bool, bool]] = []  # row, target, final, full window
        for x in live:
            row = x.row
            if x.request.cancelled.is_set():
                x.done = True
                yield x.request, None
                continue
            final = row.finished or row.evicted
            target = row.length if final else row.length - cfg.decode_lookahead
            if target <= x.emitted:
                if final:
                    x.done = True
                    yield x.request, None
                continue
            # Decode sizes grow geometrically (first audio early, then the buffer the
            # client holds doubles) up to decode_tokens: fewer, larger decodes.
            step = max(1, min(cfg.decode_tokens, max(cfg.stream_tokens - cfg.decode_lookahead,
                                                     x.emitted)))
            if final or 2 * (target - x.emitted) >= step:
                ready.append((x, target, final, final or target - x.emitted >= step))
        if not any(full for *_, full in ready):
            return
        for x, target, final, _ in ready:
            w0 = max(0, x.emitted - cfg.decode_context)
            due.append(x)
            windows.append(x.row.hiddens[w0:x.row.length].clone())
            spans.append((w0, x.emitted, target, final))
        t0 = time.perf_counter()
        wavs = self._decode(windows)
        audio_s = sum(end - start for _, start, end, _ in spans) / TOKENS_PER_SECOND
        if audio_s > 0:
            per = (time.perf_counter() - t0) / audio_s
            old = self.decode_s_per_audio_s
            self.decode_s_per_audio_s = per if old == 0 else old + 0.2 * (per - old)
            _prefill_update(self, audio_s)
        for k, x in enumerate(due):
            w0, start, target, final = spans[k]
            valid = max(0, (2 * (target - w0) - 1) * 256) if final else None
            a = (start - w0) * SAMPLES_PER_TOKEN
            b = valid if final else (target - w0) * SAMPLES_PER_TOKEN
            x.emitted = target
            chunk = np.ascontiguousarray(wavs[k, a:b], dtype=np.float32)
            if chunk.size:
                yield x.request, chunk
            if final:
                x.done = True
                _record_codes(x)
                yield x.request, None


def _prefill_update(engine: ChatTTSEngine, audio_s: float) -> None:
    """Close a prefill window once it holds PREFILL_WINDOW_S of audio (engine thread)."""
    w = engine._prefill_window
    w[1] += audio_s
    if w[1] >= PREFILL_WINDOW_S:
        per, old = w[0] / w[1], engine.prefill_s_per_audio_s
        engine.prefill_s_per_audio_s = per if old == 0 else old + 0.3 * (per - old)
        w[0] = w[1] = 0.0


def _record_codes(x: _Live) -> None:
    """The row's generated codes, as the ``(num_vq, frames)`` sample of its text."""
    r, row = x.request, x.row
    if r.produced is None or row.length == 0:
        r.produced = None
        return
    codes = row.codes[:row.length].t().to("cpu").numpy().astype("<u2")
    r.produced = SpeakerSample(np.ascontiguousarray(codes).tobytes(), r.produced.text,
                               int(codes.shape[0]))


@dataclass(eq=False)
class _Live:
    """A request in the running batch and how much of its audio is out."""

    request: SynthRequest
    row: GptRow
    emitted: int = 0  # tokens already turned into audio
    done: bool = False


def bf16_decoder(chat: Any) -> tuple[Any, Any]:
    """Copies of ChatTTS's DVAE decoder and vocos whose Linear and Conv1d weights and
    biases are bf16 already, for decoding under bf16 autocast: the same arithmetic (autocast
    rounds those to bf16 anyway) without casting them again at every decode, which took
    12 of a 1-row 40-token decode's 32 ms (2-core Sapphire Rapids Xeon). Norms, the
    spectrogram and ISTFT buffers stay fp32 (autocast runs those in fp32)."""
    import copy

    import torch

    out = []
    for module in (chat.decoder, chat.vocos):
        twin = copy.deepcopy(module).requires_grad_(False)
        for m in twin.modules():
            if isinstance(m, torch.nn.Linear) and kernels.bf16p_available():
                kernels.prepack_linear(m)
            elif isinstance(m, torch.nn.Linear | torch.nn.Conv1d):
                m.weight.data = m.weight.data.to(torch.bfloat16)
                if m.bias is not None:
                    m.bias.data = m.bias.data.to(torch.bfloat16)
        out.append(twin)
    return out[0], out[1]


def int8_decoder(chat: Any) -> tuple[Any, Any]:
    """Copies of ChatTTS's DVAE decoder and vocos whose Linear layers (the ConvNeXt
    blocks' pointwise layers and vocos's head: most of a decode's arithmetic) are fbgemm's
    dynamic quantized int8 linears (:func:`kernels.dynamic_int8`; activations quantized
    per call: a decode's rows share one scale). Convolutions, norms and the ISTFT stay
    fp32."""
    import copy

    twins = [kernels.dynamic_int8(copy.deepcopy(m).requires_grad_(False))
             for m in (chat.decoder, chat.vocos)]
    return twins[0], twins[1]


# decode dtypes other than fp32 -> the function that makes their decoder twins
DECODER_TWINS: dict[str, Callable[[Any], tuple[Any, Any]]] = {"bf16": bf16_decoder,
                                                              "int8": int8_decoder}


def _bake_weight_norm(chat: Any) -> None:
    """Compute the weight-normed output heads once instead of at every GPT step.

    ChatTTS's ``head_code``/``head_text`` are ``weight_norm`` parametrizations, which
    torch recomputes on every forward: 5 norms of a (626 or 21178) x hidden matrix per
    step, ~7% of a batch-4 step on CPU. Inference never changes them, so bake them into
    plain weights (same module objects: the GPT's bound ``__call__`` references stay valid).
    """
    from torch.nn.utils import parametrize

    for module in [*chat.embed.head_code, chat.embed.head_text]:
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def _refine_params(chat: Any, params: SynthParams) -> Any:
    return chat.RefineTextParams(prompt=params.refine_prompt, top_P=params.top_P,
                                 top_K=params.top_K, temperature=params.temperature,
                                 max_new_token=384, show_tqdm=False, manual_seed=params.seed)


class StockChatTTSEngine(ChatTTSEngine):
    """Baseline for benchmarks: stock ``Chat.infer(stream=True)``, one request at a time.

    This is how the ChatTTS example API serves: no cross-request batching, the first
    chunk after 72 GPT tokens, the whole prefix re-decoded at every yield. The scheduler
    must run it with ``max_batch_size=1`` and ``concurrency=1`` (a lock, in effect). It
    loads its own, unmodified ``Chat``.
    """

    name = "chattts-stock"
    continuous = False
    bake_weight_norm = False  # the Chat exactly as ChatTTS builds it
    select_kernels = False
    # a sample voice's sample is passed on (spk_smp/txt_smp), but no request's codes come
    # back, so contexts do not anchor on it (the baseline keeps its lookahead)
    samples = False

    def batch_key(self, params: SynthParams) -> Hashable:
        return object()  # never batch

    def _scheduling(self) -> dict[str, Any]:
        return {"batching": "static", "max_batch_size": 1, "concurrency": 1}

    def generate(self, batch: Sequence[SynthRequest]) -> Iterator[EngineOutput]:
        chat = self.chat
        for row, r in enumerate(batch):
            p = r.params
            tokens = self._max_tokens(r)
            voice = self._voice_tensor(p.voice)
            sample = p.sample
            code = chat.InferCodeParams(
                prompt=f"[speed_{p.speed}]",
                spk_emb=None if voice is None else chat.speaker._encode(voice),
                spk_smp=None if sample is None else chat.speaker.encode_prompt(
                    self._sample_codes(sample)),
                txt_smp=None if sample is None else sample.text,
                repetition_penalty=p.repetition_penalty,
                temperature=p.temperature, top_P=p.top_P, top_K=p.top_K,
                max_new_token=tokens,
                min_new_token=tokens if self._fixed_length else 0,
                manual_seed=p.seed, show_tqdm=False)
            refine = chat.RefineTextParams(prompt=p.refine_prompt, show_tqdm=False,
                                           manual_seed=p.seed)
            stream = chat.infer([r.text], stream=True, skip_refine_text=not p.refines,
                                split_text=False, params_refine_text=refine,
                                params_infer_code=code)
            try:
                for wavs in stream:
                    if r.cancelled.is_set():
                        break
                    chunk = np.ascontiguousarray(wavs[0], dtype=np.float32)
                    if chunk.size:
                        yield row, chunk
            finally:
                stream.close()
            yield row, None


def _identity(cfg: EngineConfig, path: Path | None, source: str) -> str:
    """A stable name for "these weights, decoded this way" (phrase-cache namespace).

    For a local directory: each asset file's name, size and a hash of its first and last
    MiB -- cheap, and equal for copies of the same weights on different machines.
    """
    h = hashlib.sha256()
    h.update(repr((source, cfg.stream_tokens, cfg.decode_tokens, cfg.decode_context,
                   cfg.decode_lookahead, cfg.max_new_token)).encode())
    if path is not None:
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            size = file.stat().st_size
            h.update(f"{file.relative_to(path)}:{size}".encode())
            with file.open("rb") as f:
                h.update(f.read(2**20))
                if size > 2**20:
                    f.seek(max(2**20, size - 2**20))
                    h.update(f.read(2**20))
    return h.hexdigest()[:24]
