"""Linear-layer kernels for the GPT, chosen by measuring on the machine that serves.

A decode step multiplies every weight matrix of the GPT by one row per batch row, so
its speed is how fast the weights stream through the cores. Which way of doing that is
fastest depends on the CPU (and its BLAS): on one AMD EPYC, MKL's ``F.linear`` was up to
2.9x slower at 2-4 rows than at 1 while ``(W @ x.T).T`` was not; on an Intel Xeon with
AVX-512 the opposite held. So nothing is hard-coded: at load, :func:`install` times each
candidate path over the GPT's own linear layers at every row count the batch can have
(1..slots) and keeps the fastest one per row count. Candidates are those the weight
precision (``dtype``) allows, plus plain fp32 ``F.linear``, so the chosen path is never
slower than ``F.linear`` on the machine it runs on.

Paths:

``linear``      fp32 ``F.linear`` (the reference)
``transposed``  fp32 ``(W @ x.T).T``: streams W once like a matrix-vector product
``bf16``        bf16 weights and activations (``F.linear``), output back in fp32
``bf16p``       the same bf16 weights reordered once, at load, into oneDNN's blocked
                layout (``mkldnn._reorder_linear_weight``) and multiplied by
                ``mkldnn._linear_pointwise``. ``F.linear`` in bf16 reorders the weight on
                every call; on a Sapphire Rapids Xeon (AMX) the prepacked pass over the
                GPT's linears took 18.7 ms at 1 row against 29.2 (1.3x its bf16
                weight-read limit), flat to 8 rows, and 28 ms at 64 rows (prefill)
                against 114 in fp32. Offered only where oneDNN has bf16 kernels
``int8``        weight-only int8 (per-output-channel scales), fp32 activations:
                ``aten._weight_int8pack_mm``; a quarter of the fp32 bytes per step
``int8bf``      the same int8 weights with bf16 activations and scales: on a Sapphire
                Rapids Xeon 6-9x faster than ``int8`` at 1 row (torch's int8pack kernel
                has a fast path for bf16 inputs only), near the weight-read limit
``int4``        weight-only int4, asymmetric per group of ``INT4_GROUP`` input channels,
                bf16 activations: ``aten._weight_int4pack_mm_for_cpu``; an eighth of the
                fp32 bytes
``int8dyn``     int8 weights (per channel) and int8 activations quantized per call
                (fbgemm's dynamic quantized linear, ``torch.ao``): the fastest on AVX2
                CPUs, where torch's int8pack kernel is slow; its activation scale is
                shared by the rows of one call, so batch neighbours nudge each other
``fp16``        fp16 weights, fp32 activations and sums: inductor's generated dot product
                in a compiled 1-row step, rtts's own kernel (:mod:`rtts.engines.fp16mm`)
                elsewhere; ``auto`` offers it where oneDNN has no bf16 (``COMPILED_ONLY``)

``int4``'s prefill is also offered ``int8dyn`` (``_PREFILL_ONLY``).

``--dtype auto`` (the default) offers the fp32 paths, ``bf16`` and ``bf16p``: bf16 weights
where they measure faster (on CPUs with AVX-512 BF16 / AMX), fp32 elsewhere. ``int8`` and
``int4`` offer ``bf16p`` too, which prefill (64 rows, compute-bound) usually picks.

Prefill (more rows than slots) is timed too, at ``PREFILL_ROWS`` rows. Only the GPT's
transformer layers are converted; embeddings, the output heads, norms and attention
stay fp32.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtts.engines import fp16layers, fp16mm

__all__ = ["DTYPES", "FP16_OPTIONS", "KERNEL_CHOICES", "KV_CHOICES", "TEMPLATE_OPTIONS",
           "KernelTable", "compile_options",
           "inductor_options", "choose_kv_dtype", "decode_attention",
           "decode_attention_int8", "dynamic_int8", "install", "install_heads", "linears",
           "quantize_kv", "sdpa_dtype", "solo_attention"]

logger = logging.getLogger("rtts.kernels")

DTYPES = ("auto", "fp32", "bf16", "int8", "int4")
# --kernels: auto (timed at load), or one path forced for every row count
KERNEL_CHOICES = ("auto", "linear", "transposed", "bf16", "bf16p", "fp16", "int8", "int8bf",
                  "int4", "int8dyn")
# auto: the near-lossless paths (fp32 and bf16), the fastest measured per row count
_CANDIDATES = {"auto": ("linear", "transposed", "bf16", "bf16p"),
               "fp32": ("linear", "transposed"), "bf16": ("bf16", "bf16p", "linear"),
               "int8": ("int8bf", "int8", "int8dyn", "bf16p", "linear"),
               "int4": ("int4", "int8bf", "bf16p", "linear")}
# Paths offered to prefill only (PREFILL_ROWS), beside the dtype's own candidates. int4's
# prefill on a CPU without native bf16 had only fp32 F.linear and the int kernels, which
# are slow at many rows; fbgemm's dynamic int8 (VNNI) is compute-bound there and fast.
# Measured on a 2-core Xeon without AMX/AVX512-BF16 (model 207), the GPT's 80 linears
# (ms, 3 rounds): 64 rows linear 120-153, int8dyn 36-69, int4 178-226; 242 rows (an
# anchored prompt) linear 340-412, int8dyn 110-154, int4 681-762. Not offered to decode
# row counts: in eager timing of the layers alone it is (4 rows: 2.8 ms against int4's 3.4),
# but in a compiled decode step (through ``rtts::int8dyn_linear``, which quantizes the
# activations and cannot fuse with its neighbours) the 4-row step measured 21-27 ms at 78
# columns against int4's 18.0-18.1, and 27-31 against 23-24 at 338 columns.
_PREFILL_ONLY = {"int4": ("int8dyn",)}
# ``fp16``: fp16 weights, fp32 sums: half fp32's bytes, ten mantissa bits to bf16's
# seven. At 1 row in a compiled step (gpt_loop.CompiledDecode) the linear is a dot product
# that inductor generates and fuses with the upcast (:func:`fp16_linear`); at 2+ rows, and
# eager, it is rtts's own kernel (:mod:`rtts.engines.fp16mm`, ``rtts::fp16_linear`` in a
# compiled graph) where that builds. Offered to ``auto`` where oneDNN has no bf16 kernels:
# for a compiled CPU step (install's ``template``) timed compiled, at 1 row, and at 2+
# where the kernel builds; eager, as a plain candidate where the kernel builds. Measured
# on a 2-core AMD EPYC with AVX2 only (Zen 3; ``lscpu`` family 25 model 1), the GPT's 80
# linears at 1 row, ms, best of 8: generated 17.9, inductor's GEMM template over fp32
# 31-36, torch's bf16 GEMV (``bf16``) 29-38, MKL fp32 (``linear``) 87. Inductor's own
# product at 2+ rows inside the step is not used: there it stored the product of the
# widened weights and the rows as a buffer and summed it afterwards (3-4 rows: 1.1-1.3 s).
COMPILED_ONLY = ("fp16",)
FP16_MAX = 6.0e4  # weights beyond fp16's range (65504) keep fp16 out of the candidates
# An eager decode step whose linears are all ``fp16`` runs its layers in one C++ call
# (:mod:`rtts.engines.fp16layers`), without the ~3,500 aten calls around them. So
# where that loop builds, ``auto`` takes ``fp16`` at a decode row count unless another
# path's linears alone are more than this much faster. Measured on an AVX2 AMD EPYC (2
# threads, full-size GPT, A/B interleaved): 1 row 34-37 ms through the loop against 51-59
# with torch's ops around the same kernel and 45-52 with torch's bf16 GEMV, whose linears
# alone timed 0.84-1.2x the fp16 kernel's at load; 4 rows 38-43 against 54-65 ms.
FP16_LOOP_MARGIN = 1.5

# Inductor's config for a compiled step whose 1-row linears are ``fp16``: realize every
# pointwise result of more than 4 ops. By default (50 ops on a CPU) the RMS norm before
# the qkv and gate/up projections was inlined into their dot products, so each 16 weights
# of the inner loop recomputed the residual sum, a division and a square root: the 1-row
# step took 38-41 ms with 17-18 ms of linears. With this: 23.5-23.9 ms (same machine).
FP16_OPTIONS = {"realize_opcount_threshold": 4}
# int4 group size: 32 input channels per (scale, zero). Measured on full-size random
# weights (Sapphire Rapids, 2 threads): group 32 is as fast as 64 or 128 at 1-4 rows and
# the most accurate (weight cosine 0.997 vs 0.995 at 128), so nothing is gained by larger.
INT4_GROUP = 32
# inductor's options for a compiled CPU step whose linears are bf16 (install's
# ``template``): the bf16 weights become graph constants (freezing), and each linear
# is timed at compile time between inductor's generated GEMM (its AVX-512/AMX
# micro-kernels) and oneDNN's (max_autotune), the faster kept per shape. On the 2-core
# AMD EPYC (AVX512-BF16), 80 bf16 linears of the GPT compiled alone took 12.5-13 ms at
# 1 row against oneDNN's 17.5-18.5 (bf16p), 16.6 against 18.7 at 2 rows, 15.3 against
# 14.4 at 4 (best of 8; /tmp experiments, see docs/benchmarks/cpu-realtime.md).
TEMPLATE_OPTIONS = {"freezing": True, "max_autotune": True,
                    "max_autotune_gemm_backends": "CPP,ATEN"}


@contextlib.contextmanager
def inductor_options(options: dict[str, Any]) -> Iterator[None]:
    """Inductor's config patched with ``options`` (:data:`TEMPLATE_OPTIONS`) while a
    compile runs: torch.compile's own ``options`` did not reach ``freezing`` (the linears
    stayed plain ``aten.mm`` over bf16 weights, 1.5x slower). Freezing reads storages the
    deprecated way, one ``UserWarning`` each: not shown."""
    from torch._inductor import config

    with warnings.catch_warnings(), config.patch(options):
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def compile_options(table: KernelTable | None) -> dict[str, Any] | None:
    """Inductor's config for a compiled decode step over ``table``'s linears:
    :data:`TEMPLATE_OPTIONS` for inductor's GEMM template, :data:`FP16_OPTIONS` where a
    decode row count runs ``fp16``, else none."""
    if table is None:
        return None
    if table.template:
        return TEMPLATE_OPTIONS
    return FP16_OPTIONS if "fp16" in table.chosen.values() else None


PREFILL_ROWS = 64  # a typical prompt: the row count prefill is timed at
TIMED_BYTES = 192 * 2**20  # weights timed per path and row count (see install)


@dataclass
class KernelTable:
    """What :func:`install` measured and chose (logged, and shown in ``/v1/info``)."""

    dtype: str
    chosen: dict[int, str]  # rows -> path
    ms: dict[str, dict[int, float]] = field(default_factory=dict)  # path -> rows -> ms/step
    # path -> bytes of all the linear layers' weights in that path's form (one full pass)
    bytes: dict[str, int] = field(default_factory=dict)
    kv_dtype: str = "fp32"  # the keys/values' precision (choose_kv_dtype)
    kv_us: dict[str, float] = field(default_factory=dict)  # kv dtype -> us per layer (timed)
    timed_share: float = 1.0  # the share of the linears' fp32 weight bytes the ms cover
    # the code heads (install_heads): rows -> path, and path -> rows -> ms of one call
    heads: dict[int, str] = field(default_factory=dict)
    heads_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    # a compiled step's bf16p linears go through inductor's GEMM template (install)
    template: bool = False

    def linear_ms(self) -> dict[int, float]:
        """rows -> ms of one pass through all the linear layers on the chosen path, the
        timed prefix's ms scaled up (prefill's row count left out): how a step's cost grows
        with its rows before steps at that count have run (an int4 step of 5 rows costs
        what 8 do, its kernel working in blocks of 4 rows)."""
        return {r: self.ms[p][r] / self.timed_share for r, p in self.chosen.items()
                if r != PREFILL_ROWS and r in self.ms.get(p, {}) and self.timed_share > 0}

    def summary(self) -> str:
        rows = sorted(self.chosen)
        lines = [f"dtype {self.dtype}; ms per pass over the first {TIMED_BYTES >> 20} MB of the "
                 "GPT's linear layers:",
                 "rows  " + "  ".join(f"{p:>10}" for p in self.ms) + "  chosen"]
        for r in rows:
            cells = "  ".join(f"{self.ms[p].get(r, float('nan')):10.2f}" for p in self.ms)
            lines.append(f"{r:4d}  {cells}  {self.chosen[r]}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "chosen": self.chosen, "ms": self.ms, "bytes": self.bytes,
                "kv_dtype": self.kv_dtype, "kv_us": self.kv_us, "heads": self.heads,
                "heads_ms": self.heads_ms, "template": self.template}


def _quantize_int8(weight: Any) -> tuple[Any, Any]:
    """Symmetric per-output-channel int8: ``W ~= q * scale[:, None]``."""
    import torch

    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.float().contiguous()


def _quantize_int4(weight: Any, group: int) -> tuple[Any, Any]:
    """Asymmetric int4 per group of ``group`` input channels, packed for
    ``aten._weight_int4pack_mm_for_cpu``: ``W ~= (q - 8) * scale + zero`` per group.
    Returns (packed weight, bf16 scales-and-zeros (K/group, N, 2))."""
    import torch

    n, k = weight.shape
    if k % group or n % 8:
        raise ValueError(f"int4 needs in_features % {group} == 0 and out_features % 8 == 0, "
                         f"not {tuple(weight.shape)}")
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    zero = lo + scale * 8
    q = torch.round((w - lo) / scale).clamp_(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([scale, zero], -1).transpose(0, 1).contiguous()  # (K/group, N, 2)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    return packed, sz.to(torch.bfloat16)


def _path_bytes(path: str, module: Any) -> int:
    """Bytes one pass reads of ``module``'s weight in ``path``'s form."""
    n, k = module.weight.shape
    per = {"linear": 4 * n * k, "transposed": 4 * n * k, "bf16": 2 * n * k, "bf16p": 2 * n * k,
           "fp16": 2 * n * k, "int8": n * k + 4 * n, "int8bf": n * k + 2 * n,
           "int8dyn": n * k + 4 * n,
           "int4": n * k // 2 + 4 * n * (k // INT4_GROUP)}
    return int(per[path])


class _Weights:
    """The forms of one layer's weight that the installed paths need."""

    def __init__(self, module: Any, paths: set[str]) -> None:
        import torch

        w = module.weight.detach()
        self.out_features = int(w.shape[0])
        self.bias = None if module.bias is None else module.bias.detach().float()
        self.fp32: Any = w.float().contiguous() if paths & {"linear", "transposed"} else None
        self.bf16: Any = w.to(torch.bfloat16).contiguous() if "bf16" in paths else None
        self.fp16: Any = w.to(torch.float16).contiguous() if "fp16" in paths else None
        self.bf16p: Any = _prepack_bf16(w) if "bf16p" in paths else None
        # the bf16 weight as a parameter, for a compiled CPU step (install's template)
        self.bf16c: Any = None
        self.q: Any = None
        self.scales: Any = None
        self.qdyn: Any = None
        self.scales_bf: Any = None
        self.q4: Any = None
        self.sz4: Any = None
        if paths & {"int8", "int8bf"}:
            self.q, self.scales = _quantize_int8(w.float())
            self.scales_bf = self.scales.to(torch.bfloat16)
        if "int4" in paths:
            self.q4, self.sz4 = _quantize_int4(w, INT4_GROUP)
        self.qdyn_index = -1
        if "int8dyn" in paths:
            self.qdyn = _dynamic_int8(module)
            self.qdyn_index = len(_INT8DYN)
            _INT8DYN.append(weakref.ref(self.qdyn))

    def drop_int8dyn(self) -> None:
        self.qdyn, self.qdyn_index = None, -1  # (its registry entry dies with it)


def bf16p_available() -> bool:
    """Whether this torch build and CPU have oneDNN's bf16 linear kernels (``bf16p``)."""
    import torch

    try:
        mkldnn: Any = torch.backends.mkldnn  # (untyped)
        return bool(mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without the ops
        return False


def _prepack_bf16(weight: Any) -> Any:
    """``weight`` in bf16, reordered once into oneDNN's blocked layout for
    ``mkldnn._linear_pointwise`` (an opaque ``torch._mkldnn`` tensor)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(
        weight.detach().to(torch.bfloat16).contiguous(), 1)


def _bf16p_mm(x: Any, w: Any) -> Any:
    """``x`` (bf16) times a weight prepacked by :func:`_prepack_bf16`."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def prepack_linear(module: Any) -> None:
    """Make an ``nn.Linear`` compute in bf16 through a weight prepacked once
    (:func:`_prepack_bf16`), its output bf16 (as under bf16 autocast, without reordering
    the weight at every call); eager only."""
    import torch

    packed = _prepack_bf16(module.weight)
    bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)
    del module.weight
    module.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(x: Any) -> Any:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, bias,
                                                  "none", [], "")

    module.forward = forward


@functools.cache
def _library() -> Any:
    """Defines rtts's opaque ops for a compiled step. Cached: the registrations live as
    long as the library.

    - ``rtts::bf16p_linear(x, w)`` (:func:`_bf16p_mm`): inductor lowers the mkldnn op
      only for weights it packed itself (graph constants under freezing), so the compiled
      graph calls this one instead, and fuses the conversions around it;
    - ``rtts::int8dyn_linear(x, index, n)``: the ``index``-th fbgemm dynamic int8 linear
      (``n`` outputs, :data:`_INT8DYN`), whose packed weights are a TorchScript object a
      compiled step cannot trace: one node instead of a graph break at every layer;
    - ``rtts::fp16_linear(x, w)`` (:func:`fp16mm.mm`): the ``fp16`` path's multi-row
      kernel, for a compiled step's 2+ rows (see :data:`COMPILED_ONLY`)."""
    import torch

    def linear_fake(x: Any, w: Any) -> Any:  # (rows, out features) in x's dtype
        return x.new_empty((x.shape[0], w.shape[0]))

    def int8dyn_fake(x: Any, index: int, n: int) -> Any:
        return x.new_empty((x.shape[0], n))

    # torch.library.Library rather than custom_op: its dispatch costs ~1 us a call
    # against ~7 (80 calls a step)
    library: Any = torch.library  # (untyped)
    lib = library.Library("rtts", "DEF")
    for schema, impl, fake in (
            ("bf16p_linear(Tensor x, Tensor w) -> Tensor", _bf16p_mm, linear_fake),
            ("int8dyn_linear(Tensor x, int index, int n) -> Tensor", _int8dyn_mm,
             int8dyn_fake),
            ("fp16_linear(Tensor x, Tensor w) -> Tensor", fp16mm.mm, linear_fake)):
        name = schema.split("(", 1)[0]
        lib.define(schema)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"rtts::{name}", fake, lib=lib)
    return lib


def dynamic_int8(module: Any) -> Any:
    """``module`` with its ``nn.Linear`` layers swapped for fbgemm's dynamic quantized int8
    linears, per output channel (``torch.ao``'s ``quantize_dynamic``, in place)."""
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        return quantize_dynamic(  # type: ignore[no-untyped-call]
            module, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


# fbgemm's dynamic int8 linears by index, for ``rtts::int8dyn_linear`` (see _library):
# weak references, so the packed weights go with the model that holds them (its
# ``_Weights``), not with the process (many installs in one process: tests, benches)
_INT8DYN: list[weakref.ref[Any]] = []


def _int8dyn_mm(x: Any, index: int, n: int) -> Any:
    linear = _INT8DYN[index]()
    if linear is None:
        raise RuntimeError(f"int8dyn linear {index} was released with its model")
    return linear(x)


def _dynamic_int8(module: Any) -> Any:
    """fbgemm's dynamic quantized linear for ``module`` (per-channel int8 weights)."""
    import torch

    copy = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    copy.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    return dynamic_int8(torch.nn.Sequential(copy))[0]


def _path_fn(path: str, native: bool = False) -> Callable[[_Weights, Any], Any]:
    """The function of ``path``: ``(weights, x) -> x @ W.T (+ bias)``, the result in fp32,
    or (``native``) in the dtype the kernel gives: bf16 for the bf16 and int paths with
    bf16 activations, so a caller that feeds it to the next bf16 kernel (the MLP's
    gate/up -> down) skips a round trip through fp32. ``x`` may be fp32 or bf16."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    def out(w: _Weights, y: Any) -> Any:
        if not native or w.bias is not None:
            y = y.float()
        return y if w.bias is None else y + w.bias

    def linear(w: _Weights, x: Any) -> Any:
        return F.linear(x.float(), w.fp32, w.bias)

    def transposed(w: _Weights, x: Any) -> Any:
        y = torch.mm(w.fp32, x.float().t()).t()
        return y if w.bias is None else y + w.bias

    def bf16(w: _Weights, x: Any) -> Any:
        return out(w, F.linear(x.to(torch.bfloat16), w.bf16))

    op: Any = None
    if path == "bf16p":
        _library()
        op = torch.ops.rtts.bf16p_linear.default

    def bf16p(w: _Weights, x: Any) -> Any:
        if not torch.compiler.is_compiling():
            return out(w, _bf16p_mm(x.to(torch.bfloat16), w.bf16p))
        if w.bf16c is not None:  # inductor's GEMM template (TEMPLATE_OPTIONS)
            return out(w, F.linear(x.to(torch.bfloat16), w.bf16c))
        return out(w, op(x.to(torch.bfloat16), w.bf16p))

    mm: Any = None
    if path == "fp16" and fp16mm.available():
        _library()
        mm = torch.ops.rtts.fp16_linear.default

    def fp16(w: _Weights, x: Any) -> Any:
        if torch.compiler.is_compiling():  # 1 row: a generated dot product; 2+: the kernel
            y = (fp16_linear(x.float(), w.fp16) if x.shape[0] == 1 or mm is None
                 else mm(x.float(), w.fp16))
        elif mm is not None:
            y = fp16mm.mm(x.float(), w.fp16)
        elif x.shape[0] == 1 and float(x.abs().amax()) < FP16_MAX:
            y = F.linear(x.to(torch.float16), w.fp16).float()  # torch's fp16 GEMV
        else:  # 2+ rows (torch's fp16 GEMM is scalar code here), or activations beyond
            y = F.linear(x.float(), w.fp16.float())  # fp16's range: an fp32 product
        return y if w.bias is None else y + w.bias

    def int8(w: _Weights, x: Any) -> Any:
        y = torch.ops.aten._weight_int8pack_mm(x.float(), w.q, w.scales)
        return y if w.bias is None else y + w.bias

    def int8bf(w: _Weights, x: Any) -> Any:
        return out(w, torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w.q,
                                                         w.scales_bf))

    def int4(w: _Weights, x: Any) -> Any:
        return out(w, torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), w.q4, INT4_GROUP, w.sz4))

    dyn: Any = None
    if path == "int8dyn":
        _library()
        dyn = torch.ops.rtts.int8dyn_linear.default

    def int8dyn(w: _Weights, x: Any) -> Any:
        if torch.compiler.is_compiling():
            return dyn(x.float(), w.qdyn_index, w.out_features)
        return w.qdyn(x.float())

    paths = {"linear": linear, "transposed": transposed, "bf16": bf16, "bf16p": bf16p,
             "fp16": fp16, "int8": int8,
             "int8bf": int8bf, "int4": int4, "int8dyn": int8dyn}
    return paths[path]


def fp16_linear(x: Any, w: Any) -> Any:
    """``x @ w.T`` for fp32 ``x`` (rows, K) and fp16 ``w`` (N, K), written as a product
    and a sum over K so that a compiled graph reads each fp16 weight once, upcasts it in
    registers and sums in fp32 (no fp32 copy of ``w``, no rounding of ``x``)."""
    return (w[:, None, :].float() * x[None, :, :]).sum(-1).t()


def _time_compiled(weights: Sequence[_Weights], fn: Callable[[_Weights, Any], Any],
                   rows: Sequence[int], shapes: Sequence[int], repeat: int) -> dict[int, float]:
    """rows -> milliseconds for one pass through ``weights`` as one compiled graph (what a
    compiled decode step runs), best of ``repeat``; one graph for every row count."""
    import torch

    def run(xs: dict[int, Any]) -> list[Any]:
        return [fn(w, xs[n]) for w, n in zip(weights, shapes, strict=True)]

    graph = torch.compile(run, dynamic=True)
    out: dict[int, float] = {}
    with torch.no_grad():
        for r in rows:
            xs = {n: torch.randn(r, n) for n in set(shapes)}
            graph(xs)  # compiles (once for 1 row, once for more), warms up
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                graph(xs)
                best = min(best, time.perf_counter() - t0)
            out[r] = 1000 * best
    return out


def linears(model: Any) -> list[Any]:
    """``model``'s ``nn.Linear`` layers (those :func:`install` converts)."""
    import torch

    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _time_path(weights: Sequence[_Weights], fn: Callable[[_Weights, Any], Any], rows: int,
               shapes: Sequence[int], repeat: int) -> float:
    """Milliseconds for one pass of ``rows`` rows through ``weights`` (best of repeat)."""
    import torch

    xs = {n: torch.randn(rows, n) for n in set(shapes)}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeat + 1):  # the first pass warms caches and kernels up
            t0 = time.perf_counter()
            for w, n in zip(weights, shapes, strict=True):
                fn(w, xs[n])
            best = min(best, time.perf_counter() - t0)
    return 1000 * best


def install(model: Any, dtype: str = "fp32", max_rows: int = 4, device: str = "cpu",
            force: str | None = None, repeat: int = 2, uniform: bool = False,
            template: bool = False) -> KernelTable:
    """Measure the candidate paths on ``model``'s linear layers and install the fastest
    per row count (1..``max_rows``); ``force`` installs one path for every row count.

    ``uniform`` (a compiled step): one path for every row count from 2 up, the one whose
    worst slowdown against the fastest path at any of those counts is least, so one
    compiled graph serves them all (with int4 on a Sapphire Rapids Xeon, ``int4`` is
    fastest at 2-4 rows and ``bf16p`` at 5-8: per-count choices would send every step of
    one of the two ranges to eager).

    ``template`` (a compiled CPU step): where decode steps chose ``bf16p``, the layers
    also keep their bf16 weight as a parameter, so the compiled step can hand those
    linears to inductor's own GEMM template (:data:`TEMPLATE_OPTIONS`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    mods = linears(model)
    if not mods:
        return KernelTable(dtype, {})
    candidates: tuple[str, ...] = _CANDIDATES[dtype]
    if device != "cpu":  # GPU: plain F.linear in the precision (int8 kernels are CPU-only)
        candidates = ("linear",) if dtype in ("fp32", "auto") else ("bf16",)
    prefill_only: tuple[str, ...] = ()
    compiled_only: tuple[str, ...] = ()
    if force:
        candidates = (force,)
    elif device == "cpu":
        if not bf16p_available():
            candidates = tuple(p for p in candidates if p != "bf16p")
            if dtype == "auto" and all(
                    float(m.weight.detach().abs().amax()) < FP16_MAX for m in mods):
                if template:  # timed compiled, as the step runs it
                    compiled_only = COMPILED_ONLY
                elif fp16mm.available():  # eager: the kernel at every decode row count
                    candidates = (*candidates, "fp16")
        prefill_only = tuple(p for p in _PREFILL_ONLY.get(dtype, ()) if p not in candidates)
    every_path = (*candidates, *compiled_only, *prefill_only)
    weights = [_Weights(m, set(every_path)) for m in mods]
    wbytes = {p: sum(_path_bytes(p, m) for m in mods) for p in every_path}
    shapes = [int(m.in_features) for m in mods]
    # Time a prefix of the layers holding >= TIMED_BYTES of fp32 weights: still far
    # beyond the caches (so weights stream from memory as in a real step), a fraction of
    # the load-time cost on a full model.
    n, total = 0, 0
    while n < len(mods) and total < TIMED_BYTES:
        total += mods[n].weight.numel() * 4
        n += 1
    timed_w, timed_shapes = weights[:n], shapes[:n]
    every = sum(m.weight.numel() * 4 for m in mods)
    table = KernelTable(dtype, {}, bytes=wbytes, timed_share=total / every if every else 1.0)
    rows_range = [*range(1, max(1, max_rows) + 1), PREFILL_ROWS]
    if len(candidates) == 1:
        table.chosen = {r: candidates[0] for r in rows_range}
    else:
        for path in candidates:
            fn = _path_fn(path)
            table.ms[path] = {r: _time_path(timed_w, fn, r, timed_shapes, repeat)
                              for r in rows_range}
        for path in prefill_only:
            table.ms[path] = {PREFILL_ROWS: _time_path(timed_w, _path_fn(path), PREFILL_ROWS,
                                                       timed_shapes, repeat)}
        decode_rows = [r for r in rows_range if r != PREFILL_ROWS]
        multi = [r for r in rows_range if 2 <= r <= max_rows]
        for path in compiled_only:  # 2+ rows only with the kernel (see COMPILED_ONLY)
            timed_rows = [1, *multi] if fp16mm.available() else [1]
            table.ms[path] = _time_compiled(timed_w, _path_fn(path), timed_rows,
                                            timed_shapes, repeat + 2)

        def pool(rows: Sequence[int]) -> tuple[str, ...]:
            return (*candidates,
                    *(p for p in compiled_only if all(r in table.ms[p] for r in rows)))

        loop = "fp16" in candidates and fp16layers.available()
        for r in decode_rows:
            table.chosen[r] = min(pool([r]), key=lambda p: table.ms[p][r])
            if loop and table.ms["fp16"][r] <= FP16_LOOP_MARGIN * table.ms[table.chosen[r]][r]:
                table.chosen[r] = "fp16"  # and the step's layers in one call (fp16layers)
        table.chosen[PREFILL_ROWS] = min((*candidates, *prefill_only),
                                         key=lambda p: table.ms[p][PREFILL_ROWS])
        if uniform and multi:
            # the least worst slowdown against each count's fastest path: a sum let bf16p
            # (fastest at 5-8 rows by 1.3x) win over int4 (fastest at 2-4 by up to 2.3x),
            # and a compiled int4 step at 4 rows took 26.8 ms instead of 18.2
            paths = pool(multi)

            def regret(p: str) -> float:
                return max(table.ms[p][r] / min(table.ms[q][r] for q in paths)
                           for r in multi)

            best = min(paths, key=regret)
            table.chosen.update({r: best for r in multi})
    # Keep only the weight forms a chosen path uses.
    used = set(table.chosen.values())
    for w in weights:
        if not used & {"linear", "transposed"}:
            w.fp32 = None
        if "bf16" not in used:
            w.bf16 = None
        if "fp16" not in used:
            w.fp16 = None
        if "bf16p" not in used:
            w.bf16p = None
        if not used & {"int8", "int8bf"}:
            w.q = w.scales = w.scales_bf = None
        if "int4" not in used:
            w.q4 = w.sz4 = None
        if "int8dyn" not in used:
            w.drop_int8dyn()
    decode_paths = {p for r, p in table.chosen.items() if r != PREFILL_ROWS}
    if template and device == "cpu" and "bf16p" in decode_paths:
        import torch

        table.template = True
        for module, w in zip(mods, weights, strict=True):
            w.bf16c = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16).contiguous(),
                                         requires_grad=False)
    fns = {p: _path_fn(p) for p in used}
    natives = {p: _path_fn(p, native=True) for p in used}
    by_rows = {r: fns[p] for r, p in table.chosen.items() if r != PREFILL_ROWS}
    native_rows = {r: natives[p] for r, p in table.chosen.items() if r != PREFILL_ROWS}
    prefill = fns[table.chosen[PREFILL_ROWS]]
    native_prefill = natives[table.chosen[PREFILL_ROWS]]
    for module, w in zip(mods, weights, strict=True):
        _patch(module, w, by_rows, prefill, native_rows, native_prefill)
    if device == "cpu":
        logger.info("GPT linear kernels:\n%s", table.summary())
    return table


# decode paths that compute in fp32: a step on one keeps its code heads in fp32 as well
FP32_PATHS = ("linear", "transposed")
HEAD_PATHS = FP32_PATHS  # the code heads' candidates (install_heads): fp32 logits only


def install_heads(weight: Any, table: KernelTable, repeat: int = 8
                  ) -> Callable[[Any], Any] | None:
    """ChatTTS's code heads (``weight``: the 4 codebooks' heads as one (4 x 626, 768)
    matrix, read once per decode step) on the faster fp32 path per row count, ``x``
    (rows, H) -> fp32 logits; records the choice in ``table.heads``. Timed only at row
    counts whose decode step is not fp32 already (``table.chosen`` not in
    :data:`FP32_PATHS`): where the step is fp32 the heads stay ``F.linear``, as before.
    None where ``F.linear`` is kept everywhere.

    Measured on the AMD EPYC (2 threads, weights cold, best of 30, us at 1 / 4 / 8 rows):
    ``F.linear`` 730 / 919 / 938, ``transposed`` 731 / 352 / 813. (``bf16p``, 339 / 277 /
    313, is not offered: its bf16 logits tie so often that top-P's exact fallback, a
    ``torch.sort`` of 500 us, ran at every step.)"""
    rows = sorted(r for r, p in table.chosen.items()
                  if r != PREFILL_ROWS and p not in FP32_PATHS)
    if not rows or weight.device.type != "cpu":
        return None
    import torch

    lin = torch.nn.Linear(int(weight.shape[1]), int(weight.shape[0]), bias=False)
    lin.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    w = _Weights(lin, {"linear"})
    shapes = [int(weight.shape[1])]
    for path in HEAD_PATHS:
        fn = _path_fn(path)
        table.heads_ms[path] = {r: _time_path([w], fn, r, shapes, repeat) for r in rows}
    table.heads = {r: min(HEAD_PATHS, key=lambda p: table.heads_ms[p][r]) for r in rows}
    if set(table.heads.values()) == {"linear"}:
        return None
    by_rows = {r: _path_fn(p) for r, p in table.heads.items()}
    plain = _path_fn("linear")

    def heads(x: Any) -> Any:
        return by_rows.get(int(x.shape[0]), plain)(w, x)

    logger.info("GPT code heads: %s", ", ".join(f"{r} rows {p}"
                                                 for r, p in table.heads.items()))
    return heads


def _dispatch(w: _Weights, by_rows: dict[int, Callable[[_Weights, Any], Any]],
              prefill: Callable[[_Weights, Any], Any]) -> Callable[[Any], Any]:
    # Where every row count from 2 up chose one path (the usual case), the choice needs
    # no look-up by the exact count: a compiled decode step (gpt_loop.CompiledDecode)
    # then serves every row count with one graph instead of one per count.
    most = max(by_rows, default=0)
    multi = by_rows.get(2)
    if multi is None or any(by_rows[r] is not multi for r in by_rows if r >= 2):
        multi = None
    one = by_rows.get(1, prefill)

    def forward(x: Any) -> Any:
        rows = x.numel() // x.shape[-1]
        if multi is not None and rows <= most:
            fn = one if rows == 1 else multi
        else:
            fn = by_rows.get(rows, prefill)
        y = fn(w, x.reshape(rows, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


def _patch(module: Any, w: _Weights, by_rows: dict[int, Callable[[_Weights, Any], Any]],
           prefill: Callable[[_Weights, Any], Any],
           native_rows: dict[int, Callable[[_Weights, Any], Any]],
           native_prefill: Callable[[_Weights, Any], Any]) -> None:
    """``module.forward``: the chosen path per row count, fp32 out. ``module.rtts_native``
    (what gpt_loop's layer loop calls where it can): the same in the kernel's own output
    dtype (bf16 for the bf16 and int paths: in one profile of a 4-row anchored prefill
    of 242 tokens, casting the gate/up output to fp32 took 26 ms a layer, half of it)."""
    forward = _dispatch(w, by_rows, prefill)
    module.forward = types.MethodType(lambda self, x: forward(x), module)
    module.rtts_native = _dispatch(w, native_rows, native_prefill)
    module.rtts_weights = w  # keeps the converted weights alive with the module
    if w.fp32 is None or w.fp32.data_ptr() != module.weight.data_ptr():
        # The module's own fp32 parameter is no longer read: free it.
        import torch

        module.weight = torch.nn.Parameter(torch.empty(0, device=module.weight.device),
                                           requires_grad=False)


KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# int8 keys/values (quantize_kv): a compiled CPU decode step of a lossy dtype only
KV_INT8_DTYPES = ("int8", "int4")
KV_CHOICES = ("auto", "fp32", "bf16", "int8")  # --kv-dtype
KV_TORCH = {**KV_DTYPES, "int8": "int8"}


def decode_attention(q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    """One new token's attention, written as reductions for ``torch.compile``: ``q``
    (rows, heads, 1, d) fp32, keys/values (rows, heads, columns, d) in their buffer's
    dtype, ``mask`` (rows, 1, 1, columns) bool. Inductor fuses each reduction with the
    upcast of the keys or values it reads, so a bf16 buffer is read as bf16 (half the
    bytes) and summed in fp32, with no fp32 copy in between.

    A decode step's attention streams every layer's keys and values of every row: at 4
    rows and 200 columns, 99 MB in fp32, more than int4's weights. Measured on a 2-core
    Xeon without AVX512-BF16 (model 207), 20 layers at 4 rows (ms, best of 8): 201
    columns SDPA fp32 4.4 eager / 4.8 compiled, these reductions 3.5 in fp32 and 1.7 over
    bf16; 384 columns 11.3 / 9.3, 8.5 and 4.0. (SDPA over bf16 there is 2-3x slower than
    fp32: oneDNN emulates bf16 without native instructions.)"""
    scores = (q * k.float()).sum(-1).unsqueeze(-2) * scale  # (rows, heads, 1, columns)
    scores = scores.masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1).transpose(-1, -2)  # (rows, heads, columns, 1)
    return (p * v.float()).sum(-2, keepdim=True)  # (rows, heads, 1, d)


def quantize_kv(x: Any) -> tuple[Any, Any]:
    """Keys or values ``x`` (..., d) as int8 with one fp32 scale per vector of ``d``
    (symmetric, absmax / 127): returns (int8 (..., d), scale (...)). Written for
    ``torch.compile`` (it fuses into the step's loops)."""
    import torch

    x = x.float()
    scale = x.abs().amax(-1).clamp(min=1e-12) / 127.0
    return (x / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scale


def decode_attention_int8(q: Any, k: Any, k_scale: Any, v: Any, v_scale: Any, mask: Any,
                          scale: float) -> Any:
    """:func:`decode_attention` over int8 keys/values (:func:`quantize_kv`): ``k``/``v``
    (rows, heads, columns, d) int8, ``k_scale``/``v_scale`` (rows, heads, columns) fp32.
    Each column's scale comes out of its dot product, and each value's into its
    probability, so the reductions read one byte per value (half of bf16's).

    Measured on the AMD EPYC (family 25 model 17, 2 threads, 20 layers compiled, buffers
    cold, ms): 4 rows x 160 columns bf16 3.4-3.8, int8 2.5-2.8; 4 x 400 7.3-7.5 against
    4.3-4.7; 1 x 400 2.3 against 1.6. On Gaussian keys/values the attention output's
    relative error is 8.6e-3 (bf16's 2.5e-3)."""
    scores = ((q * k.float()).sum(-1) * k_scale).unsqueeze(-2) * scale  # (rows, heads, 1, c)
    scores = scores.masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1).transpose(-1, -2) * v_scale.unsqueeze(-1)  # (rows, heads, c, 1)
    return (p * v.float()).sum(-2, keepdim=True)  # (rows, heads, 1, d)


def _attention_probe(kv: Sequence[tuple[Any, Any]], q: Any, mask: Any) -> Any:
    out = q
    for k, v in kv:
        if isinstance(k, tuple):  # int8: (values, scales)
            out = out + decode_attention_int8(q, k[0], k[1], v[0], v[1], mask, 0.125)
        else:
            out = out + decode_attention(q, k, v, mask, 0.125)
    return out


def _best_us(bufs: dict[str, tuple[Any, Any]], run: Callable[[Any, Any], Any], rounds: int,
             layers: int) -> dict[str, float]:
    """``run(q, kv)`` over each dtype's buffers, interleaved (a busy moment hits all),
    ``rounds`` times: the best us per layer of each."""
    import torch

    us = {name: float("inf") for name in bufs}
    with torch.no_grad():
        for _ in range(rounds):
            for name, (q, kv) in bufs.items():
                t0 = time.perf_counter()
                run(q, kv)
                us[name] = min(us[name], 1e6 * (time.perf_counter() - t0) / layers)
    return us


def sdpa_dtype(kv: str, us: dict[str, float]) -> str:
    """The precision SDPA (prefill, and an eager decode step) reads ``kv`` keys/values
    in: ``kv``, or fp32 where :func:`choose_kv_dtype` timed bf16 SDPA slower (a compiled
    step chose bf16 on a CPU that emulates bf16: the columns are upcast first); int8's
    are dequantized to fp32."""
    if kv == "int8":
        return "fp32"
    if kv == "bf16" and us.get("sdpa_bf16", 0.0) > us.get("sdpa_fp32", float("inf")):
        return "fp32"
    return kv


def solo_attention(kv: str, us: dict[str, float]) -> bool:
    """Whether an eager decode step runs its attention (SDPA over ``kv`` keys/values) on
    one thread (``BatchedGpt.solo_attention``): where :func:`choose_kv_dtype` timed it no
    slower there than on the step's threads (``f"{kv}_threads"``). Untimed (fp32, a GPU, a
    compiled step): one thread, as before.

    One thread was measured faster on a 2-core Xeon without AVX512-BF16 (SDPA with the
    slot mask 18-890 us on one thread against 70-2900 on two, 1-4 rows, 60-300 columns),
    two on the AMD EPYC (20 layers, fp32, ms on 1 / 2 threads: 1 row 1.56 / 0.93 at 160
    columns, 4.09 / 2.41 at 400; 4 rows 9.34 / 5.36 at 160, 17.6 / 11.1 at 400)."""
    multi = us.get(f"{kv}_threads")
    return multi is None or us.get(kv, float("inf")) <= multi


def choose_kv_dtype(dtype: str, layers: int, heads: int, head_dim: int, rows: int,
                    columns: int = 256, device: str = "cpu", repeat: int = 4,
                    compiled: bool = False, force: str = "auto") -> tuple[str, dict[str, float]]:
    """The precision of the GPT's keys/values: ``fp32``, or ``bf16`` (or ``int8``, below)
    where it measures faster; returns (choice, us per layer of each candidate). ``force``
    (``--kv-dtype``) other than ``auto`` is returned as it is, untimed.

    A decode step's attention reads every layer's keys and values of every row: at 4
    rows and 300 columns that is 79 MB in fp32, as much as the int4 weights. Measured on
    a Sapphire Rapids Xeon with the buffers cold (as in a step, where the weights stream
    between two layers' attention), bf16 SDPA took 131-237 us per layer at 4 rows and
    160-300 columns against 244-791 us in fp32. So for every ``dtype`` but ``fp32``
    (which stays exact) both are timed here, at ``rows`` rows, cycling through
    ``layers`` buffers so each read comes from memory, and the faster is kept.

    ``compiled`` (a compiled decode step, which reads them through
    :func:`decode_attention`): that function is compiled and timed too, on the threads
    the step has, and decides; SDPA's times come back as ``sdpa_fp32`` and ``sdpa_bf16``
    (for :func:`sdpa_dtype`). On a 2-core Xeon without AVX512-BF16, bf16 there is 2x
    faster than fp32 where bf16 SDPA is 2.5x slower.

    int8 (:func:`quantize_kv`, one scale per head and column) is a candidate of the
    compiled CPU step of the lossy dtypes (``KV_INT8_DTYPES``: their weights are already
    further from fp32's than int8 keys/values take the attention), timed the same way:
    it reads half of bf16's bytes, which is what attention costs at many columns.
    """
    if force != "auto":
        if force not in KV_TORCH:
            raise ValueError(f"kv dtype {force!r}: one of {', '.join(KV_CHOICES)}")
        return force, {}
    if dtype == "fp32" or device != "cpu":
        return "fp32", {}
    import torch
    import torch.nn.functional as F  # noqa: N812

    mask = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    bufs: dict[str, tuple[Any, list[tuple[Any, Any]]]] = {}
    for name, tname in KV_DTYPES.items():
        dt = getattr(torch, tname)
        bufs[name] = (torch.randn(rows, heads, 1, head_dim).to(dt),
                      [(torch.randn(rows, heads, columns, head_dim).to(dt),
                        torch.randn(rows, heads, columns, head_dim).to(dt))
                       for _ in range(layers)])

    def sdpa_layers(q: tuple[Any, int], kv: Sequence[tuple[Any, Any]]) -> None:
        torch.set_num_threads(q[1])
        for k, v in kv:
            F.scaled_dot_product_attention(q[0], k, v, attn_mask=mask)

    threads = torch.get_num_threads()
    # on one thread, as an eager decode step's attention ran everywhere before (gpt_loop,
    # solo_attention), and on the step's own threads: which is faster depends on the CPU
    # (solo_attention below), so an eager step does what measured faster here
    timed = {name: ((q, 1), kv) for name, (q, kv) in bufs.items()}
    if not compiled and threads > 1:
        timed.update({f"{name}_threads": ((q, threads), kv) for name, (q, kv) in bufs.items()})
    try:
        us = _best_us(timed, sdpa_layers, repeat + 1, layers)
    finally:
        torch.set_num_threads(threads)
    if not compiled:
        best = min(us, key=lambda k: us[k])
        return best.removesuffix("_threads"), us
    sdpa = {f"sdpa_{name}": t for name, t in us.items()}
    if dtype in KV_INT8_DTYPES:
        bufs["int8"] = (bufs["fp32"][0], [(quantize_kv(k), quantize_kv(v))
                                          for k, v in bufs["fp32"][1]])
    probe = torch.compile(_attention_probe, dynamic=False)
    # the first round compiles, one graph per dtype
    us = _best_us(bufs, lambda q, kv: probe(kv, q.float(), mask), repeat + 2, layers)
    return min(us, key=lambda k: us[k]), {**us, **sdpa}
