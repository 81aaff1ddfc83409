"""rtts's own autoregressive loop over ChatTTS's GPT, with continuous batching.

``ChatTTS.model.GPT.generate`` is replaced, for serving, by :class:`BatchedGpt`. It keeps
ChatTTS's sampling recipe (temperature, ChatTTS's repetition penalty over the last 16
codes, top-P then top-K with at least 3 kept, one multinomial draw per codebook,
``manual_seed`` re-seeding every step) but runs it as a **slot batch** that rows join
and leave between any two steps:

- :meth:`BatchedGpt.add` prefills new rows (a left-padded batch of just the newcomers;
  the running rows wait for that one forward) and draws their first code; from the next
  :meth:`BatchedGpt.step` they decode alongside the rows already running;
- a row that finished (EOS or its own token limit) or whose request was cancelled is
  **evicted** at the next step, keys/values included: its slot is free at once;
- sampling params are **per row** (temperature, top-P, top-K, seed): rows with different
  settings share one forward; a seeded row draws as from its own generator re-seeded every
  step (the draw's noise is the same at every step, so it is drawn once), so its codes are
  the ones it would draw running alone;
- keys/values live in one preallocated buffer per layer, ``(slots, heads, columns, dim)``.
  Every live row writes its new token at the same column ``t``; each row's valid columns
  are tracked in a mask, so a row that joined later simply has fewer. Attention reads only
  columns ``[0, t]``. When ``t`` reaches the end, the columns are compacted to the oldest
  live row's first one (and the buffer grows only if a single row needs more);
- each row's hidden states go into its own preallocated buffer, so handing the decoder a
  row's hiddens is a view.

The loop runs the Llama decoder layers itself, so transformers' ``LlamaModel.forward`` and
its mask building are not on the path. For the Llama that ChatTTS builds (as many key/value
heads as query heads, SiLU MLP) it runs its own lean layer loop over the layers' weights:
one ``rms_norm`` op per norm instead of five, rotary embedding applied to queries and keys
together, keys/values written straight into the slot buffers, ``scaled_dot_product_attention``
called directly. A decode step is ~80 small ops per layer instead of ~130 (on a 2-core CPU,
a op costs 5-20 us, so this is a visible part of a step once the linear layers are int8 or
int4). Other configurations go through the layers' own ``forward`` with a small cache
object that writes into the buffers. The layers' modules (their linear layers carry the
kernels installed by :mod:`rtts.engines.kernels`), rotary embedding, norm and heads are
ChatTTS's own.

One difference from ChatTTS: an EOS drawn at the very first step is masked instead of
regenerating the whole batch (ChatTTS's ``ensure_non_empty``), so an utterance is never
empty and no other row pays for a retry.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtts.engines.fp16layers import LayerPlan
from rtts.engines.kernels import (
    KernelTable,
    decode_attention,
    decode_attention_int8,
    inductor_options,
    quantize_kv,
)
from rtts.engines.kernels import install_heads as _heads_kernel

__all__ = ["BatchedGpt", "CompiledDecode", "GptRow", "RowSpec", "ThreadTuner",
           "fuse_projections", "layer_plan"]

MIN_TOKENS_TO_KEEP = 3  # ChatTTS's gen_logits: top-P and top-K keep at least 3 codes
PENALTY_WINDOW = 16  # ChatTTS's repetition penalty looks at the last 16 codes
FORWARDS_KEPT = 4096  # BatchedGpt.forward_rows keeps at least this many recent entries


class _Part:
    """Stands in for one of the projections :func:`fuse_projections` merged: its slice of
    the fused layer's output (for code that still calls the projection on its own, such
    as the layers' own ``forward``)."""

    def __init__(self, fused: Any, start: int, end: int) -> None:
        self._fused, self.start, self.end = (fused,), start, end  # tuple: not a submodule
        self.in_features, self.out_features = fused.in_features, end - start

    def __call__(self, x: Any) -> Any:
        return self._fused[0](x)[..., self.start:self.end]


def _fuse(owner: Any, names: Sequence[str], fused_name: str) -> bool:
    import torch

    parts = [getattr(owner, n) for n in names]
    if not all(type(m) is torch.nn.Linear for m in parts):
        return False
    if len({m.in_features for m in parts}) != 1 or len({m.bias is None for m in parts}) != 1:
        return False
    weight = torch.cat([m.weight.detach() for m in parts], 0)
    has_bias = parts[0].bias is not None
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias,
                            device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if has_bias:
            fused.bias.copy_(torch.cat([m.bias.detach() for m in parts]))
    fused.requires_grad_(False)
    setattr(owner, fused_name, fused)
    start = 0
    for name, m in zip(names, parts, strict=True):
        delattr(owner, name)  # a registered submodule: replaced by a plain attribute
        object.__setattr__(owner, name, _Part(fused, start, start + m.out_features))
        start += m.out_features
    return True


def fuse_projections(model: Any) -> int:
    """Merge each Llama layer's query/key/value projections into one linear layer
    (``self_attn.rtts_qkv``) and its gate/up projections into another
    (``mlp.rtts_gate_up``), before the kernels are installed: the lean loop then runs 4
    weight matrices per layer instead of 7, one call (and one activation conversion) each.
    The old names stay callable (slices of the fused output). Returns the layers fused."""
    done = 0
    for layer in model.layers:
        if type(layer).__name__ != "LlamaDecoderLayer":
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "rtts_qkv") or not _fuse(attn, ("q_proj", "k_proj", "v_proj"),
                                                  "rtts_qkv"):
            continue
        _fuse(mlp, ("gate_proj", "up_proj"), "rtts_gate_up")
        done += 1
    return done


@dataclass
class RowSpec:
    """What a row needs to join: its prompt and its own sampling settings."""

    emb: Any  # (T, H) prompt embeddings, speaker applied, no padding
    limit: int  # max new tokens
    min_tokens: int = 0  # EOS masked before this many
    temperature: float = 0.3
    top_p: float = 0.7
    top_k: int = 20
    seed: int | None = None
    penalty: float | None = None  # repetition penalty (None: the batch's)
    tag: Any = None  # the caller's handle (e.g. its request)


@dataclass(eq=False)
class GptRow:
    """One row's progress. ``hiddens[:length]`` are final once written."""

    spec: RowSpec
    hiddens: Any  # (limit, H) float32
    codes: Any  # (limit, num_vq) long
    length: int = 0  # codes generated (EOS excluded)
    finished: bool = False  # EOS drawn, or limit reached
    evicted: bool = False  # no longer computed (finished or cancelled)
    next_pos: int = 0  # position id of the next input token
    generator: Any = None  # per-row torch.Generator when seeded
    noise: Any = None  # seeded: its draws' exponential noise, (num_vq, V) (BatchedGpt._sample)
    last: Any = field(default=None, repr=False)  # (num_vq,) codes to feed next


def _fused_heads(gpt: Any, num_vq: int) -> tuple[Any, Any]:
    """ChatTTS's per-codebook output heads as one (num_vq * V, H) matrix, and its
    per-codebook code embeddings as one table with each codebook's offset, built once per
    GPT (None where the modules are not plain bias-free linear / embedding layers)."""
    import torch

    cached = getattr(gpt, "_rtts_fused", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    heads = [getattr(hc, "__self__", hc) for hc in gpt.head_code][:num_vq]
    embs = [getattr(ec, "__self__", ec) for ec in gpt.emb_code][:num_vq]
    fused_heads = fused_embs = None
    if len(heads) == num_vq and all(type(m) is torch.nn.Linear and m.bias is None
                                    for m in heads):
        fused_heads = torch.cat([m.weight.detach() for m in heads], 0).contiguous()
    if len(embs) == num_vq and all(type(m) is torch.nn.Embedding for m in embs):
        sizes = [int(m.weight.shape[0]) for m in embs]
        starts = [sum(sizes[:v]) for v in range(num_vq)]
        fused_embs = (torch.cat([m.weight.detach() for m in embs], 0).contiguous(),
                      torch.tensor(starts, device=embs[0].weight.device))
    object.__setattr__(gpt, "_rtts_fused", (fused_heads, fused_embs))
    return fused_heads, fused_embs


def layer_plan(gpt: Any) -> LayerPlan | None:
    """``gpt``'s layers as a :class:`fp16layers.LayerPlan` (the fp16 weights' addresses),
    gathered once per GPT; None where its layers do not qualify (see ``LayerPlan.of``)."""
    cached = getattr(gpt, "_rtts_plan", None)
    if cached is not None:
        return cached[0]  # type: ignore[no-any-return]
    cfg = gpt.gpt.config
    plan = LayerPlan.of(list(gpt.gpt.layers[: cfg.num_hidden_layers]))
    object.__setattr__(gpt, "_rtts_plan", (plan,))
    return plan


def install_heads(gpt: Any, num_vq: int, table: KernelTable) -> None:
    """Put ``gpt``'s fused code heads (:func:`_fused_heads`) on the kernel path
    :func:`kernels.install_heads` chooses per row count (every batch over ``gpt`` then
    computes its logits through it); fp32 ``F.linear`` where it chooses nothing."""
    heads, _ = _fused_heads(gpt, num_vq)
    fn = None if heads is None else _heads_kernel(heads, table)
    object.__setattr__(gpt, "_rtts_heads_fn", fn)


class _SlotCache:
    """The object handed to transformers' attention as its cache: writes the new
    keys/values into the shared buffers at the current window, returns what to attend."""

    def __init__(self, keys: list[Any], values: list[Any]) -> None:
        self.keys, self.values = keys, values
        self.rows = slice(0, 0)
        self.write = 0  # first column written by this forward
        self.read = 0  # first column attended

    def update(self, key: Any, value: Any, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[Any, Any]:
        end = self.write + key.shape[2]
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[self.rows, :, self.write:end] = key
        v[self.rows, :, self.write:end] = value
        return k[self.rows, :, self.read:end], v[self.rows, :, self.read:end]


class BatchedGpt:
    """A continuous batch of up to ``slots`` rows over ChatTTS's GPT modules.

    Not thread-safe: one thread drives ``add``/``step``/``cancel`` at a time.
    """

    def __init__(self, gpt: Any, num_vq: int, eos_token: int, slots: int,
                 penalty: float = 1.05, columns: int = 256, kv_dtype: Any = None,
                 decode: CompiledDecode | None = None, sdpa_dtype: Any = None,
                 solo_attention: bool = True, native_rows: Collection[int] = ()) -> None:
        import torch

        self.gpt = gpt  # ChatTTS.model.GPT (loaded)
        self.model = gpt.gpt  # transformers LlamaModel (embed_tokens removed)
        self.num_vq = num_vq
        self.eos = eos_token
        self.slots = slots
        self.penalty = penalty
        self.device = gpt.device_gpt
        self.dtype = self.model.dtype
        cfg = self.model.config
        self.layers = list(self.model.layers[: cfg.num_hidden_layers])
        heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv_shape = (slots, heads, head_dim)
        self.hidden = cfg.hidden_size
        # an eager decode step's attention on one thread (see _lean_layers), where that
        # measured faster (kernels.solo_attention)
        self.solo_attention = solo_attention
        self.lean = (heads == cfg.num_attention_heads and heads * head_dim == self.hidden
                     and cfg.hidden_act == "silu"
                     and all(type(layer).__name__ == "LlamaDecoderLayer"
                             for layer in self.layers))
        # keys/values (and the queries that read them) in ``kv_dtype``: bf16 halves the
        # bytes attention streams per step (see choose_kv_dtype); lean loop only
        self.kv_dtype = kv_dtype if kv_dtype is not None and self.lean else self.dtype
        # the precision SDPA reads them in (prefill, eager decode): kv_dtype, or fp32 where
        # bf16 SDPA is slower (kernels.sdpa_dtype); a compiled CPU step reads kv_dtype
        self.sdpa_dtype = sdpa_dtype if sdpa_dtype is not None and self.lean else self.kv_dtype
        # int8 keys/values (kernels.quantize_kv): their scales in buffers beside them,
        # (slots, heads, columns) each (in one buffer as [..., 2], a compiled step's write
        # through the last index was not done in place: the graph's own loops went from
        # 5.6 to 13 ms at 4 rows)
        self.kv_int8 = self.kv_dtype == torch.int8
        if self.kv_int8 and self.sdpa_dtype == torch.int8:
            self.sdpa_dtype = torch.float32
        # fused projections (fuse_projections): one matmul for q/k/v, one for gate/up
        self.fused = self.lean and all(hasattr(layer.self_attn, "rtts_qkv")
                                       and hasattr(layer.mlp, "rtts_gate_up")
                                       for layer in self.layers)
        self._heads, self._embs = _fused_heads(gpt, num_vq)
        # the heads' kernel per row count (install_heads), or None: fp32 F.linear
        self._heads_fn: Callable[[Any], Any] | None = getattr(gpt, "_rtts_heads_fn", None)
        # the decode step's layer loop through torch.compile (CompiledDecode), lean only
        self.decode = decode if self.lean else None
        # eager decode steps of ``native_rows`` rows (where every linear layer runs the
        # fp16 kernel) through one C++ call for all the layers (fp16layers), where its
        # preconditions hold: the lean loop, fused projections, fp32 keys/values, a CPU
        self._plan: LayerPlan | None = None
        if (native_rows and self.decode is None and self.fused
                and self.kv_dtype == torch.float32 and self.sdpa_dtype == torch.float32
                and torch.device(self.device).type == "cpu"):
            self._plan = layer_plan(gpt)
        self.native_rows = frozenset(native_rows) if self._plan is not None else frozenset()
        self.native_steps = 0  # decode steps run through it (tests, debugging)
        self._table: Any = None  # its address table (the buffers' too: reset by _alloc)
        self._row_params: tuple[tuple[GptRow, ...], Any] = ((), None)
        self.rows: list[GptRow] = []  # live rows, in slot order (row k is in slot k)
        self.t = 0  # next column every live row writes
        self.steps = 0
        # rows computed by each forward (tests, debugging): the last FORWARDS_KEPT or more
        self.forward_rows: list[int] = []
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.key_scales: list[Any] = []  # int8 keys/values only
        self.value_scales: list[Any] = []
        self.valid = torch.zeros(slots, 0, dtype=torch.bool, device=self.device)
        self._alloc(columns)
        self.cache = _SlotCache(self.keys, self.values)

    # -- buffers -------------------------------------------------------------------------

    @property
    def columns(self) -> int:
        return int(self.valid.shape[1])

    def _alloc(self, columns: int) -> None:
        """(Re)allocate the buffers with ``columns`` columns, keeping ``[0, t)``."""
        import torch

        slots, heads, head_dim = self._kv_shape
        old_k, old_v, old_valid = self.keys, self.values, self.valid
        keep = min(self.t, columns, self.columns) if self.rows else 0
        shape = (slots, heads, columns, head_dim)
        kv = self.kv_dtype
        new_k = [torch.zeros(shape, dtype=kv, device=self.device) for _ in self.layers]
        new_v = [torch.zeros(shape, dtype=kv, device=self.device) for _ in self.layers]
        old_ks, old_vs = self.key_scales, self.value_scales
        new_ks: list[Any] = []
        new_vs: list[Any] = []
        if self.kv_int8:
            new_ks = [torch.zeros(slots, heads, columns, device=self.device)
                      for _ in self.layers]
            new_vs = [torch.zeros(slots, heads, columns, device=self.device)
                      for _ in self.layers]
        valid = torch.zeros(slots, columns, dtype=torch.bool, device=self.device)
        if keep:
            for dst, src in ((new_k, old_k), (new_v, old_v), (new_ks, old_ks),
                             (new_vs, old_vs)):
                for d, s in zip(dst, src, strict=True):
                    d[:, :, :keep] = s[:, :, :keep]
            valid[:, :keep] = old_valid[:, :keep]
        self.keys[:] = new_k
        self.values[:] = new_v
        self._table = None  # the layer loop's addresses of the old buffers
        self.key_scales[:] = new_ks
        self.value_scales[:] = new_vs
        self.valid = valid

    def _move_columns(self, src: int, dst: int, n: int) -> None:
        """Copy columns ``[src, src+n)`` to ``[dst, dst+n)`` for the live rows."""
        if n <= 0 or src == dst:
            return
        b = len(self.rows)
        for buf in (*self.keys, *self.values, *self.key_scales, *self.value_scales):
            buf[:b, :, dst:dst + n] = buf[:b, :, src:src + n].clone()
        block = self.valid[:b, src:src + n].clone()
        self.valid[:b, min(src, dst):max(src, dst) + n] = False
        self.valid[:b, dst:dst + n] = block

    def _make_room(self, left: int) -> None:
        """Ensure ``left`` columns before ``t`` and one at ``t``: shift, compact, or grow."""
        b = len(self.rows)
        if b == 0:
            self.t = left
        elif self.t < left:  # a newcomer's prompt is longer than the history: shift right
            shift = left - self.t
            if self.t + shift + 1 > self.columns:
                self._alloc(max(self.t + shift + 1, self.columns * 3 // 2 + 16))
            self._move_columns(0, shift, self.t)
            self.t += shift
        if self.t + 1 > self.columns:
            used = self.valid[:b, : self.t].any(0).nonzero() if b else None
            first = int(used[0]) if used is not None and used.numel() else self.t
            first = min(first, self.t - left)
            if first > 0:  # drop columns no live row uses
                self._move_columns(first, 0, self.t - first)
                self.t -= first
            if self.t + 1 > self.columns:
                self._alloc(max(self.t + 1, self.columns * 3 // 2 + 16))

    # -- the model -----------------------------------------------------------------------

    def _forward(self, x: Any, pos: Any, mask: Any, rows: slice, write: int, read: int) -> Any:
        """Run the decoder layers on ``x`` (n, q, H) for buffer rows ``rows``."""
        self.cache.rows, self.cache.write, self.cache.read = rows, write, read
        self.forward_rows.append(int(x.shape[0]))
        if len(self.forward_rows) >= 2 * FORWARDS_KEPT:  # a batch can run for days
            del self.forward_rows[:FORWARDS_KEPT]
        h = x.to(self.device, self.dtype)
        if self.lean and self.decode is not None and h.shape[1] == 1:
            return self.decode(self, h, pos, mask, rows, write, read)
        n = int(h.shape[0])
        if (self._plan is not None and h.shape[1] == 1 and n in self.native_rows
                and rows.start == 0 and read == 0):
            return self._native_decode(h, pos, write)
        cos_sin = self.model.rotary_emb(h, position_ids=pos)
        if self.lean:
            return self.model.norm(self._lean_layers(h, cos_sin, mask, rows, write, read))
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, cache=self.cache,
                      position_embeddings=cos_sin)
        return self.model.norm(h)

    def _native_decode(self, h: Any, pos: Any, write: int) -> Any:
        """A decode step's layers through :class:`fp16layers.LayerPlan` (rows ``[0, n)``,
        their new keys/values at column ``write``, each attending its valid columns up to
        it), then the final norm."""
        import torch

        plan = self._plan
        assert plan is not None
        n = int(h.shape[0])
        if self._table is None:
            self._table = plan.table(self.keys, self.values)
        cos, sin = self.model.rotary_emb(h, position_ids=pos)
        threads = torch.get_num_threads()
        out = plan.run(h.reshape(n, self.hidden), self._table, cos.reshape(n, -1),
                       sin.reshape(n, -1), self.valid, write, threads,
                       1 if self.solo_attention else threads)
        self.native_steps += 1
        return self.model.norm(out.view(n, 1, self.hidden))

    def _lean_decode(self, h: Any, pos: Any, mask: Any, rows: slice, write: int,
                     read: int) -> Any:
        """A decode step from the summed code embeddings ``h`` (n, 1, H) to the final
        norm: what :class:`CompiledDecode` compiles (the rotary embedding and the norm
        inside the graph: as eager ops around it they were ~15 small ops a step)."""
        cos_sin = self.model.rotary_emb(h, position_ids=pos)
        return self.model.norm(self._lean_layers(h, cos_sin, mask, rows, write, read))

    def _lean_layers(self, h: Any, cos_sin: tuple[Any, Any], mask: Any, rows: slice,
                     write: int, read: int) -> Any:
        """The Llama decoder layers on ``h`` (n, q, H), the math of transformers'
        ``LlamaDecoderLayer`` (sdpa attention) in fewer ops; keys/values of the ``q`` new
        positions go to buffer columns ``[write, write+q)``, attention reads ``[read, ..)``."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        n, q, hidden = h.shape
        heads, d = self._kv_shape[1], self._kv_shape[2]
        half, end = d // 2, write + q
        compiling = torch.compiler.is_compiling()
        threads = 1 if compiling else torch.get_num_threads()
        # A decode step's attention is small ((rows x heads) dot products over the
        # columns): measured on a 2-core Xeon, SDPA with the slot mask took 18-890 us on one
        # thread and 70-2900 us on two (1-4 rows, 60-300 columns); prefill keeps them all.
        # (not inside torch.compile: a thread switch is not an op it can trace)
        solo = q == 1 and threads > 1 and self.solo_attention
        kv = self.kv_dtype
        int8 = self.kv_int8
        cast = kv != h.dtype
        fused = self.fused
        cos, sin = cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)  # (n, 1, q, d)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            x = F.rms_norm(h, (hidden,), norm.weight, norm.variance_epsilon)
            if fused:
                qkv = attn.rtts_qkv(x).view(n, q, 3 * heads, d).transpose(1, 2)
                qk, v = qkv[:, :2 * heads], qkv[:, 2 * heads:]  # (n, 2 heads | heads, q, d)
            else:
                qk = torch.cat((attn.q_proj(x), attn.k_proj(x)), -1).view(n, q, 2 * heads, d)
                qk = qk.transpose(1, 2)  # (n, 2 heads, q, d)
                v = attn.v_proj(x).view(n, q, heads, d).transpose(1, 2)
            if solo:
                torch.set_num_threads(1)
            rot = torch.cat((qk[..., half:].neg(), qk[..., :half]), -1)
            qk = qk * cos + rot * sin
            kb, vb = self.keys[i], self.values[i]
            if int8:
                ksb, vsb = self.key_scales[i], self.value_scales[i]
                kb[rows, :, write:end], ksb[rows, :, write:end] = quantize_kv(qk[:, heads:])
                vb[rows, :, write:end], vsb[rows, :, write:end] = quantize_kv(v)
            else:
                kb[rows, :, write:end] = qk[:, heads:]
                vb[rows, :, write:end] = v
            k_read, v_read = kb[rows, :, read:end], vb[rows, :, read:end]
            if compiling and q == 1 and h.device.type == "cpu":
                # CompiledDecode on a CPU: reductions that read the kv buffer as it is
                # (kernels.decode_attention); a GPU keeps SDPA's fused kernels
                if int8:
                    o = decode_attention_int8(qk[:, :heads], k_read, ksb[rows, :, read:end],
                                              v_read, vsb[rows, :, read:end], mask,
                                              attn.scaling)
                else:
                    o = decode_attention(qk[:, :heads], k_read, v_read, mask, attn.scaling)
            else:
                sd = self.sdpa_dtype
                if int8:  # dequantized (prefill reads its own columns; eager decode all)
                    k_read = k_read.float() * ksb[rows, :, read:end].unsqueeze(-1)
                    v_read = v_read.float() * vsb[rows, :, read:end].unsqueeze(-1)
                if sd != kv:  # (a copy of these rows' columns, in the precision SDPA is fast in)
                    k_read, v_read = k_read.to(sd), v_read.to(sd)
                o = F.scaled_dot_product_attention(qk[:, :heads].to(sd), k_read, v_read,
                                                   attn_mask=mask, scale=attn.scaling)
            if solo:
                torch.set_num_threads(threads)
            # The kernels' own output dtype where they have one (kernels.rtts_native: bf16
            # for the bf16 and int paths): attention's output goes to o_proj as it is, and
            # the MLP's gate/up stay bf16 into down_proj; the residual stream stays fp32
            # (a bf16 add promotes). Measured on the 2-core Xeon (dtype auto, A/B
            # interleaved): an anchored prefill of 242 tokens 119-127 -> 110-113 ms at 1
            # row, 463-485 -> 389-397 ms at 4; decode steps unchanged.
            o_proj = getattr(attn.o_proj, "rtts_native", None)
            if o_proj is None:
                o_proj = attn.o_proj
                if cast:
                    o = o.to(h.dtype)
            h = h + o_proj(o.transpose(1, 2).reshape(n, q, hidden))
            norm = layer.post_attention_layernorm
            x = F.rms_norm(h, (hidden,), norm.weight, norm.variance_epsilon)
            if fused:
                gate_up = getattr(mlp.rtts_gate_up, "rtts_native", mlp.rtts_gate_up)
                down = getattr(mlp.down_proj, "rtts_native", mlp.down_proj)
                gate, up = gate_up(x).chunk(2, -1)
                h = h + down(F.silu(gate) * up)
            else:
                h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return h

    def _sample(self, rows: Sequence[GptRow], h: Any) -> Any:
        """Draw one code per codebook for each row from last hidden states ``h`` (n, H)."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        vq, n = self.num_vq, len(rows)
        if self._heads is not None:  # the 4 code heads as one matrix: (n, vq * V)
            fn = self._heads_fn
            logits = (F.linear(h, self._heads) if fn is None else fn(h)
                      ).reshape(n * vq, -1).float()
        else:
            logits = torch.stack([head(h) for head in self.gpt.head_code], 2)  # (n, V, vq)
            logits = logits.permute(0, 2, 1).reshape(n * vq, -1).float()
        dev = logits.device
        temperature, top_p, kth_idx, max_k, free_idx, seeded = self._params(
            rows, logits.size(-1))
        logits = logits / temperature
        logits = self._penalize(rows, logits)
        logits = top_p_filter(logits, top_p)
        # top-K (TopKLogitsWarper, per row)
        top = torch.topk(logits, max_k).values
        kth = top.gather(1, kth_idx)
        logits = logits.masked_fill(logits < kth, -torch.inf)
        early = [r.length < max(1, r.spec.min_tokens) for r in rows]
        if any(early):
            mask = torch.tensor(early, device=dev).repeat_interleave(vq)
            logits[mask, self.eos] = -torch.inf
        scores = F.softmax(logits, dim=-1)
        if free_idx is None:  # no seeded row: one draw for all
            return _draw(scores).view(n, vq)
        # Seeded rows: ChatTTS re-seeds at every step, and a one-sample multinomial is
        # argmax(p / q) with q ~ Exp(1) drawn from the generator (ATen's fast path), so a
        # row's q is the same at every step: drawn once (_params), the draws of all seeded
        # rows are one division and one argmax, the same codes as multinomial's.
        seeded_idx, noise = seeded
        if free_idx.numel() == 0:
            return (scores / noise).argmax(-1).view(n, vq)
        drawn = torch.empty(n * vq, dtype=torch.long, device=dev)
        drawn[free_idx] = _draw(scores.index_select(0, free_idx))
        drawn[seeded_idx] = (scores.index_select(0, seeded_idx) / noise).argmax(-1)
        return drawn.view(n, vq)

    def _params(self, rows: Sequence[GptRow], vocab: int
                ) -> tuple[Any, Any, Any, int, Any, tuple[Any, Any]]:
        """Per-row sampling tensors, one entry per (row, codebook): built once per set of
        rows, not every step. (temperature, top_p, top-K index, largest K, the indices of
        unseeded rows' entries or None when no row is seeded, and the seeded rows' entries
        with their draws' noise, :meth:`_sample`)."""
        import torch

        key = tuple(rows)  # GptRow compares by identity; the tuple keeps them alive
        if self._row_params[0] == key:
            return self._row_params[1]  # type: ignore[no-any-return]
        vq, dev, specs = self.num_vq, self.device, [r.spec for r in rows]

        def per_row(values: list[float]) -> Any:
            return torch.tensor(values, device=dev).repeat_interleave(vq).unsqueeze(1)

        ks = [min(max(s.top_k, MIN_TOKENS_TO_KEEP), vocab) for s in specs]
        free = [k for k, r in enumerate(rows) if r.generator is None]
        free_idx = (None if len(free) == len(rows) else
                    torch.tensor([k * vq + v for k in free for v in range(vq)], device=dev,
                                 dtype=torch.long))
        seeded_idx = noise = None
        if free_idx is not None:
            for r in rows:
                if r.generator is not None and r.noise is None:
                    r.generator.manual_seed(r.spec.seed)
                    r.noise = torch.empty(vq, vocab, dtype=torch.float32,
                                          device=dev).exponential_(1, generator=r.generator)
            seeded_idx = torch.tensor([k * vq + v for k, r in enumerate(rows)
                                       if r.generator is not None for v in range(vq)],
                                      device=dev, dtype=torch.long)
            noise = torch.cat([r.noise for r in rows if r.generator is not None])
        params = (per_row([s.temperature for s in specs]), per_row([s.top_p for s in specs]),
                  per_row([k - 1 for k in ks]).long(), max(ks), free_idx, (seeded_idx, noise))
        self._row_params = (key, params)
        return params

    def _penalize(self, rows: Sequence[GptRow], logits: Any) -> Any:
        """ChatTTS's repetition penalty over each row's last 16 codes (per codebook)."""
        import torch

        penalties = [self.penalty if r.spec.penalty is None else r.spec.penalty for r in rows]
        if all(p == 1.0 for p in penalties):
            return logits
        vq = self.num_vq
        width = min(PENALTY_WINDOW, max(r.length for r in rows))
        if width == 0:
            return logits
        hist = torch.zeros(len(rows), width, vq, dtype=torch.long, device=logits.device)
        weight = torch.zeros(len(rows), width, vq, device=logits.device)
        for k, r in enumerate(rows):
            m = min(width, r.length)
            if m:
                hist[k, width - m:] = r.codes[r.length - m:r.length]
                weight[k, width - m:] = 1.0
        hist = hist.permute(0, 2, 1).reshape(len(rows) * vq, width)
        weight = weight.permute(0, 2, 1).reshape(len(rows) * vq, width)
        freq = torch.zeros_like(logits).scatter_add_(1, hist, weight)
        if all(p == penalties[0] for p in penalties):
            alpha = torch.pow(penalties[0], freq)
        else:  # per row (each row's vq codebooks share its penalty)
            base = torch.tensor(penalties, device=logits.device).repeat_interleave(vq)
            alpha = torch.pow(base.unsqueeze(1), freq)
        return torch.where(logits < 0, logits * alpha, logits / alpha)

    def _after_draw(self, rows: Sequence[GptRow], h: Any, drawn: Any) -> None:
        eos = drawn.eq(self.eos).any(1).tolist()
        for k, r in enumerate(rows):
            r.hiddens[r.length] = h[k]
            if eos[k]:
                r.finished = True
                continue
            r.codes[r.length] = drawn[k]
            r.last = drawn[k]
            r.length += 1
            if r.length >= r.spec.limit:
                r.finished = True

    # -- public API ----------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.rows)

    def add(self, specs: Sequence[RowSpec]) -> list[GptRow]:
        """Prefill ``specs`` (at most ``free_slots``) and draw their first codes."""
        import torch

        if not specs:
            return []
        if len(specs) > self.free_slots:
            raise ValueError(f"{len(specs)} rows do not fit in {self.free_slots} free slots")
        self.evict_done()
        lens = [int(s.emb.shape[0]) for s in specs]
        width = max(lens)
        self._make_room(width)
        b, n, dev = len(self.rows), len(specs), self.device
        x = torch.zeros(n, width, self.hidden, dtype=self.dtype, device=dev)
        pad = torch.zeros(n, width, dtype=torch.bool, device=dev)
        for k, (s, m) in enumerate(zip(specs, lens, strict=True)):
            x[k, width - m:] = s.emb.to(dev, self.dtype)
            pad[k, : width - m] = True
        offset = width - torch.tensor(lens, device=dev).unsqueeze(1)
        pos = (torch.arange(width, device=dev).unsqueeze(0) - offset).clamp_(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()
        mask = causal.unsqueeze(0) & ~pad.unsqueeze(1)
        mask |= torch.eye(width, dtype=torch.bool, device=dev)  # pad queries see themselves
        start = self.t - width
        h = self._forward(x, pos, mask.unsqueeze(1), slice(b, b + n), start, start)
        self.valid[b:b + n] = False
        self.valid[b:b + n, start:self.t] = ~pad
        new: list[GptRow] = []
        for s, m in zip(specs, lens, strict=True):
            gen = None
            if s.seed is not None:
                gen = torch.Generator(device=dev)
            new.append(GptRow(spec=s, next_pos=m, generator=gen,
                              hiddens=torch.empty(s.limit, self.hidden, device=dev),
                              codes=torch.empty(s.limit, self.num_vq, dtype=torch.long,
                                                device=dev)))
        last = h[:, -1].float()
        self._after_draw(new, last, self._sample(new, last))
        self.rows.extend(new)
        return new

    def cancel(self, rows: Callable[[GptRow], bool]) -> None:
        """Mark rows for which ``rows(row)`` is true as evicted (freed at the next step)."""
        for r in self.rows:
            if not r.evicted and rows(r):
                r.evicted = True

    def evict_done(self) -> list[GptRow]:
        """Drop finished and cancelled rows from the slots now; return them."""
        import torch

        gone = [r for r in self.rows if r.finished or r.evicted]
        if not gone:
            return []
        keep = [k for k, r in enumerate(self.rows) if not (r.finished or r.evicted)]
        for r in gone:
            r.evicted = True
        if keep and keep != list(range(len(keep))):
            idx = torch.tensor(keep, device=self.device)
            cols = self.t
            for buf in (*self.keys, *self.values, *self.key_scales, *self.value_scales):
                buf[: len(keep), :, :cols] = buf[idx, :, :cols]
            self.valid[: len(keep)] = self.valid[idx]
        self.rows = [self.rows[k] for k in keep]
        if not self.rows:
            self.t = 0
            self._row_params = ((), None)  # let the ended rows go
        return gone

    def step(self) -> None:
        """One decode step for every live row (after evicting the ended ones)."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        self.evict_done()
        if not self.rows:
            return
        self._make_room(0)
        b, t, dev = len(self.rows), self.t, self.device
        codes = torch.stack([r.last for r in self.rows])  # (b, vq)
        if self._embs is not None:  # one lookup in the codebooks' tables stacked
            table, offsets = self._embs
            x = F.embedding(codes + offsets, table).sum(1, keepdim=True)  # (b, 1, H)
        else:
            x = torch.stack([self.gpt.emb_code[v](codes[:, v:v + 1])
                             for v in range(self.num_vq)], 3).sum(3)  # (b, 1, H): summed
        pos = torch.tensor([[r.next_pos] for r in self.rows], device=dev)
        self.valid[:b, t] = True
        mask = self.valid[:b, : t + 1].view(b, 1, 1, t + 1)
        h = self._forward(x, pos, mask, slice(0, b), t, 0)[:, -1].float()
        self.t += 1
        self.steps += 1
        for r in self.rows:
            r.next_pos += 1
        self._after_draw(self.rows, h, self._sample(self.rows, h))


def _draw(scores: Any) -> Any:
    """One code per row of ``scores`` (rows, V) with those probabilities, from torch's
    global generator (the rows of no seed): ``torch.multinomial``'s one-sample recipe,
    ``argmax(p / q)`` with ``q ~ Exp(1)``, its noise drawn as ``-log(U)`` from
    ``torch.rand``. ATen's ``exponential_`` is 4x slower on a CPU: 16 x 626 values (4 rows
    x 4 codebooks) took 213 us against 55 us, and ``torch.multinomial`` 258 (AMD EPYC,
    best of 200). ``U`` = 0 gives ``q`` = inf, so that code is not drawn (a 2^-24 event)."""
    import torch

    noise = torch.rand_like(scores).log_().neg_()
    return (scores / noise).argmax(-1)


def top_p_filter_sorted(logits: Any, top_p: Any) -> Any:
    """transformers' ``TopPLogitsWarper`` (min_tokens_to_keep 3) with a per-row ``top_p``
    (rows, 1), as written there: a sort with indices and a scatter back."""
    import torch

    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p)
    drop[..., -MIN_TOKENS_TO_KEEP:] = False
    return logits.masked_fill(drop.scatter(1, sorted_idx, drop), -torch.inf)


def top_p_filter(logits: Any, top_p: Any) -> Any:
    """:func:`top_p_filter_sorted`'s result, cheaper on a CPU. ``torch.sort`` of 16 rows x
    626 random logits (4 rows x 4 codebooks) took 550 us on the 2-core Xeon, ``np.sort`` of
    the values 80 (inside served steps the whole sampling gained 0.1-0.2 ms). The warper
    drops a prefix of the ascending order (its cumulative probability is non-decreasing),
    so its result is "drop every logit below the first kept value", computed from the
    sorted values alone (the same values, so the same softmax and cumulative sum), unless
    equal values straddle the cut in some row: which of them torch's sort put first then
    decides, and the whole call takes the sorted path."""
    import torch

    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return top_p_filter_sorted(logits, top_p)
    import numpy as np

    values = torch.from_numpy(np.sort(logits.detach().numpy(), axis=-1))
    cum = values.softmax(dim=-1).cumsum(dim=-1)
    cut = (cum <= (1 - top_p)).sum(-1, keepdim=True).clamp_(
        max=logits.size(-1) - MIN_TOKENS_TO_KEEP)  # codes dropped per row
    first = values.gather(1, cut)  # the lowest kept value
    if bool(((cut > 0) & (values.gather(1, (cut - 1).clamp_(min=0)) == first)).any()):
        return top_p_filter_sorted(logits, top_p)
    return logits.masked_fill(logits < first, -torch.inf)


class CompiledDecode:
    """The decode step (:meth:`BatchedGpt._lean_decode`: the rotary embedding, the layer
    loop and the final norm at one new token per row) through ``torch.compile``
    (inductor): the norms, rotary embedding, residual adds,
    SiLU gating and casts of 20 layers become a few generated C++ loops instead of ~1,000
    eager ops, each of which costs 5-20 us of dispatch on a small CPU (the linear kernels
    stay the ones :mod:`rtts.engines.kernels` installed, called from the compiled code).

    One instance per loaded model, shared by its batches. Shapes are dynamic (rows and
    columns vary every step), so it compiles twice: once for 1 row (torch specializes
    size-1 dimensions) and once for 2 or more. :meth:`compile` does both at warm-up (about
    a minute each on 2 cores; inductor's on-disk cache makes a restart faster). After
    that, a step that would need another compile (an unforeseen shape or guard) runs eager
    instead of stalling every stream for a minute (``torch.compiler.set_stance``'s
    ``eager_on_recompile``).
    """

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        import torch

        # No guards on the modules: the layers, norms and linear kernels a batch
        # reads never change after load, and checking them all costs ~1 ms a step here.
        # Without those guards, graphs must not be shared between models: dynamo keeps
        # its graphs on the function's code object, so each instance compiles a copy of
        # its own (two compiled models in one process, as in `rtts bench realtime`, ran
        # the first model's graph, and kernels, for the second).
        fn = BatchedGpt._lean_decode
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                 fn.__defaults__, fn.__closure__)
        self._fn = torch.compile(own, dynamic=True, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        # more of inductor's config while it compiles (kernels.TEMPLATE_OPTIONS, patched
        # around the compiling calls: kernels.inductor_options)
        self.options = dict(options or {})
        self.ready = False
        self.compile_s = 0.0

    def __call__(self, gpt: BatchedGpt, h: Any, pos: Any, mask: Any, rows: slice, write: int,
                 read: int) -> Any:
        import torch

        if not self.ready:
            with inductor_options(self.options):
                return self._fn(gpt, h, pos, mask, rows, write, read)
        with torch.compiler.set_stance("eager_on_recompile"):
            return self._fn(gpt, h, pos, mask, rows, write, read)

    def compile(self, make: Callable[[int], BatchedGpt], prompt: Callable[[int], list[RowSpec]],
                slots: int, steps: int = 3) -> float:
        """Compile for 1 row, 2 rows and ``slots`` rows: ``make(slots)`` gives an empty
        batch using this instance (``slots`` as the batches that will serve: a batch of
        another size whose size is 1 would not match), ``prompt(n)`` n row specs. Returns
        the seconds it took."""
        import time

        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            # and at every slot full: a graph from inductor's on-disk cache carries the
            # row range it was first compiled for (2 <= rows <= 4 from a 4-slot batch), so
            # an 8-slot batch at 5+ rows would have run eager; this compiles that range here
            for n in sorted({1, 2, max(1, slots)}):
                gpt = make(max(n, slots))
                gpt.add(prompt(n))
                for _ in range(steps):
                    gpt.step()
                gpt.cancel(lambda r: True)
                gpt.evict_done()
        self.ready = True
        self.compile_s = time.perf_counter() - t0
        return self.compile_s


class ThreadTuner:
    """Chooses torch's intra-op thread count from the decode steps as they run.

    On a CPU shared with other processes (or with the server's own event loop and
    encoders), every parallel region of a step waits for its slowest thread; when one of
    them is descheduled the step stalls. Measured on a 2-core Xeon with one competing
    CPU-bound process: a 4-row int4 step took 50-800 ms with 2 threads and 64-128 ms
    with 1, while on the quiet machine 2 threads were ~20% faster. So the count is not
    fixed: :meth:`observe` keeps a moving average of the step time per (threads, rows),
    runs at the best count for the current rows, and now and then probes the others for
    a few steps. A probe step slower than ``give_up`` times the best ends the probe at
    once, and each lost probe doubles the wait before the next (up to ``max_period``), so
    probing a collapsing thread count costs little.
    """

    def __init__(self, choices: Sequence[int], set_threads: Callable[[int], None],
                 period: int = 48, probe: int = 3, give_up: float = 1.5,
                 max_period: int = 512, alpha: float = 0.3) -> None:
        self.choices = sorted(set(choices), reverse=True)
        self._set = set_threads
        self.base_period = self.period = period
        self.probe, self.give_up, self.max_period, self.alpha = probe, give_up, max_period, alpha
        self.ms: dict[tuple[int, int], float] = {}  # (threads, rows) -> moving average
        self.current = self.choices[0]
        self.switches = 0
        self._until_probe = period
        self._probe_left = 0
        self._probe_won = False
        set_threads(self.current)

    def apply(self) -> None:
        """Set the current count again (e.g. from another thread: OpenMP's is per thread)."""
        self._set(self.current)

    def step_ms(self) -> dict[int, float]:
        """rows -> the moving-average step time at the best count for those rows."""
        rows = sorted({r for _, r in self.ms})
        return {r: self.ms[(self.best(r), r)] for r in rows}

    def best(self, rows: int) -> int:
        return min(self.choices, key=lambda c: self.ms.get((c, rows), float("inf")))

    def observe(self, rows: int, seconds: float) -> None:
        """Record one step of ``rows`` rows at the current count; maybe switch."""
        ms = 1000 * seconds
        key = (self.current, rows)
        old = self.ms.get(key)
        self.ms[key] = ms if old is None else old + self.alpha * (ms - old)
        best = self.best(rows)
        if self._probe_left:  # probing another count
            best_ms = self.ms.get((best, rows), float("inf"))
            self._probe_left -= 1
            if self.current == best:
                self._probe_won = True
            elif ms > self.give_up * best_ms:
                self._probe_left = 0  # clearly worse: stop paying for it
            if not self._probe_left:
                self.period = (self.base_period if self._probe_won
                               else min(self.max_period, 2 * self.period))
                self._until_probe = self.period
                self._go(self.best(rows))
            return
        self._until_probe -= 1
        untried = [c for c in self.choices if (c, rows) not in self.ms]
        if len(self.choices) > 1 and (self._until_probe <= 0 or untried):
            others = untried or [c for c in self.choices if c != best]
            self._probe_left, self._probe_won = self.probe, False
            self._go(others[0])
        elif best != self.current:
            self._go(best)

    def _go(self, threads: int) -> None:
        if threads != self.current:
            self.current = threads
            self.switches += 1
            self._set(threads)
