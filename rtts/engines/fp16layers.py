"""An eager decode step's decoder layers in one C++ call, where every linear layer is the
``fp16`` kernel path (:mod:`rtts.engines.fp16mm`): fp16 weights, fp32 activations, sums
and keys/values.

Why: on a 2-core CPU without native bf16 (an AVX2 AMD EPYC, Zen 3), an eager decode step
at 1 row took 43-56 ms, of which the 80 fp16 linears were about 25. The rest was some
3,500 aten calls a step (RMS norms, rotary embedding, slices and copies into the
key/value buffers, attention, SiLU gating, residual adds), each 5-100 us of dispatch and
thread wake-ups: an RMS norm of 768 values took 18 us alone and about 105 us inside the
step. Here one call runs all the layers of a step: per layer the norm, the fused q/k/v
product, the rotary embedding, the new column's keys/values written into the slot
buffers, attention over each row's valid columns, the output projection, the norm, the
fused gate/up product, SiLU gating and the down projection, with torch's math
(``F.rms_norm``, transformers' rotate-half rotary embedding, softmax attention, SiLU as
``x / (1 + exp(-x))``); only the order of float sums differs, as between any two kernels.

Like :mod:`rtts.engines.fp16mm` it is written with ATen's vector types and built at first
use by inductor's C++ toolchain (a private torch API and a C++ compiler: where either is
missing, :func:`available` is false and the step keeps its torch ops)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from rtts.engines import fp16mm

__all__ = ["LayerPlan", "available"]

logger = logging.getLogger("rtts.fp16layers")

# per layer, in this order: input norm weight, q/k/v (fp16), output projection (fp16),
# post-attention norm weight, gate/up (fp16), down (fp16), key buffer, value buffer
_PTRS = 8

# the products are fp16mm's (fp16_matvec: its includes come with it)
_SOURCE = fp16mm.MATVEC + r"""
#include <cmath>
#include <limits>
#include <vector>
using Half = at::Half;

namespace {
constexpr int64_t V = Vectorized<float>::size();

float dot(const float* a, const float* b, int64_t k) {
    const int64_t body = k - k % V;
    Vectorized<float> acc(0);
    for (int64_t i = 0; i < body; i += V) {
        acc = at::vec::fmadd(Vectorized<float>::loadu(a + i), Vectorized<float>::loadu(b + i),
                             acc);
    }
    float sum = at::vec::vec_reduce_all<float>(
        [](Vectorized<float>& x, Vectorized<float>& y) { return x + y; }, acc);
    for (int64_t i = body; i < k; ++i) sum += a[i] * b[i];
    return sum;
}

// out = x * rsqrt(mean(x * x) + eps) * weight (F.rms_norm)
void rms_norm(const float* x, const float* weight, float* out, int64_t k, float eps) {
    const float mean = dot(x, x, k) / static_cast<float>(k);
    const float inv = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < k; ++i) out[i] = (x[i] * inv) * weight[i];
}

// transformers' rotate-half rotary embedding of one head, in place
void rotary(float* x, const float* cos, const float* sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + (-b) * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}
}  // namespace

// h (rows, hidden) fp32, updated in place by every layer; table (layers, 8) addresses;
// cos/sin (rows, d); valid (slots, columns) bool: row r attends its valid columns of
// [0, t]; its new keys/values go to column t of buffers (slots, heads, columns, d)
extern "C" void kernel(float* h, const int64_t* table, const float* cos, const float* sin,
                       const bool* valid, const int64_t rows, const int64_t n_layers,
                       const int64_t hidden, const int64_t heads, const int64_t d,
                       const int64_t inter, const int64_t columns, const int64_t t,
                       const float eps, const float scale, const int64_t threads,
                       const int64_t attn_threads) {
    const int64_t hd = heads * d, cols = t + 1;
    std::vector<float> x(rows * hidden), qkv(rows * 3 * hd), o(rows * hd), tmp(rows * hidden),
        gu(rows * 2 * inter), act(rows * inter), scores(rows * heads * cols);
    for (int64_t layer = 0; layer < n_layers; ++layer) {
        const int64_t* p = table + layer * 8;
        const float* w_in = reinterpret_cast<const float*>(p[0]);
        const Half* w_qkv = reinterpret_cast<const Half*>(p[1]);
        const Half* w_o = reinterpret_cast<const Half*>(p[2]);
        const float* w_post = reinterpret_cast<const float*>(p[3]);
        const Half* w_gu = reinterpret_cast<const Half*>(p[4]);
        const Half* w_down = reinterpret_cast<const Half*>(p[5]);
        float* kb = reinterpret_cast<float*>(p[6]);
        float* vb = reinterpret_cast<float*>(p[7]);
        for (int64_t r = 0; r < rows; ++r) {
            rms_norm(h + r * hidden, w_in, x.data() + r * hidden, hidden, eps);
        }
        fp16_matvec(x.data(), w_qkv, qkv.data(), rows, 3 * hd, hidden, threads);
        for (int64_t r = 0; r < rows; ++r) {
            float* q = qkv.data() + r * 3 * hd;
            for (int64_t a = 0; a < heads; ++a) {
                rotary(q + a * d, cos + r * d, sin + r * d, d);  // query
                rotary(q + hd + a * d, cos + r * d, sin + r * d, d);  // key
                const int64_t at = ((r * heads + a) * columns + t) * d;
                std::copy(q + hd + a * d, q + hd + (a + 1) * d, kb + at);
                std::copy(q + 2 * hd + a * d, q + 2 * hd + (a + 1) * d, vb + at);
            }
        }
        #pragma omp parallel for num_threads(attn_threads) schedule(static)
        for (int64_t ra = 0; ra < rows * heads; ++ra) {
            const int64_t r = ra / heads, a = ra % heads;
            const float* q = qkv.data() + r * 3 * hd + a * d;
            const bool* ok = valid + r * columns;
            float* s = scores.data() + ra * cols;
            const float* keys = kb + (r * heads + a) * columns * d;
            const float* values = vb + (r * heads + a) * columns * d;
            const float inf = std::numeric_limits<float>::infinity();
            float top = -inf;
            for (int64_t c = 0; c < cols; ++c) {
                s[c] = ok[c] ? dot(q, keys + c * d, d) * scale : -inf;
                top = std::max(top, s[c]);
            }
            const int64_t sbody = cols - cols % V;
            const Vectorized<float> topv(top);
            Vectorized<float> sum(0);
            for (int64_t c = 0; c < sbody; c += V) {
                auto e = (Vectorized<float>::loadu(s + c) - topv).exp();
                e.store(s + c);
                sum = sum + e;
            }
            float total = at::vec::vec_reduce_all<float>(
                [](Vectorized<float>& x, Vectorized<float>& y) { return x + y; }, sum);
            for (int64_t c = sbody; c < cols; ++c) {
                s[c] = std::exp(s[c] - top);
                total += s[c];
            }
            float* out = o.data() + r * hd + a * d;
            std::fill(out, out + d, 0.0f);
            const int64_t body = d - d % V;
            for (int64_t c = 0; c < cols; ++c) {
                if (s[c] == 0.0f) continue;
                const Vectorized<float> pv(s[c]);
                const float* vr = values + c * d;
                for (int64_t i = 0; i < body; i += V) {
                    at::vec::fmadd(pv, Vectorized<float>::loadu(vr + i),
                                   Vectorized<float>::loadu(out + i)).store(out + i);
                }
                for (int64_t i = body; i < d; ++i) out[i] += s[c] * vr[i];
            }
            const float inv = 1.0f / total;
            for (int64_t i = 0; i < d; ++i) out[i] *= inv;
        }
        fp16_matvec(o.data(), w_o, tmp.data(), rows, hidden, hd, threads);
        for (int64_t i = 0; i < rows * hidden; ++i) h[i] += tmp[i];
        for (int64_t r = 0; r < rows; ++r) {
            rms_norm(h + r * hidden, w_post, x.data() + r * hidden, hidden, eps);
        }
        fp16_matvec(x.data(), w_gu, gu.data(), rows, 2 * inter, hidden, threads);
        for (int64_t r = 0; r < rows; ++r) {
            const float* g = gu.data() + r * 2 * inter;
            float* y = act.data() + r * inter;
            const int64_t body = inter - inter % V;
            const Vectorized<float> one(1.0f);
            for (int64_t i = 0; i < body; i += V) {  // silu(gate) * up, as torch's silu
                auto gv = Vectorized<float>::loadu(g + i);
                (gv / (one + gv.neg().exp()) * Vectorized<float>::loadu(g + inter + i))
                    .store(y + i);
            }
            for (int64_t i = body; i < inter; ++i) {
                y[i] = g[i] / (1.0f + std::exp(-g[i])) * g[inter + i];
            }
        }
        fp16_matvec(act.data(), w_down, tmp.data(), rows, hidden, inter, threads);
        for (int64_t i = 0; i < rows * hidden; ++i) h[i] += tmp[i];
    }
}
"""
_ARGS = ["float*", "const int64_t*", "const float*", "const float*", "const bool*",
         "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
         "int64_t", "float", "float", "int64_t", "int64_t"]


@functools.cache
def _kernel() -> Any:
    """The built function, or None where it cannot be built here (logged once)."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(_ARGS, _SOURCE)
    except Exception as exc:  # noqa: BLE001 - no compiler, a torch without the API, ...
        logger.warning("the fp16 layer loop is not available here (%s: %s); eager decode "
                       "steps keep torch's ops", type(exc).__name__, exc)
        return None


def available() -> bool:
    """Whether the layer loop builds on this machine (built once, at the first call)."""
    return _kernel() is not None


class LayerPlan:
    """The weights' addresses for :func:`layers`, gathered once per model (they never
    change after load), and the shapes. Build with :meth:`of`."""

    def __init__(self, weights: Any, keep: list[Any], hidden: int, heads: int, d: int,
                 inter: int, eps: float, scale: float) -> None:
        self.weights = weights  # (layers, 6) int64 addresses
        self._keep = keep  # the tensors those addresses point into
        self.hidden, self.heads, self.d, self.inter = hidden, heads, d, inter
        self.eps, self.scale = eps, scale

    @classmethod
    def of(cls, layers: Sequence[Any]) -> LayerPlan | None:
        """The plan for transformers Llama decoder layers after
        :func:`gpt_loop.fuse_projections` and the kernels' install, or None where any
        linear layer lacks fp16 weights or has a bias, the norms' epsilons or attention
        scales differ, or the layer loop cannot be built."""
        import torch

        if not layers or not available():
            return None
        rows: list[list[int]] = []
        keep: list[Any] = []
        eps = {float(layer.input_layernorm.variance_epsilon) for layer in layers}
        eps |= {float(layer.post_attention_layernorm.variance_epsilon) for layer in layers}
        scales = {float(layer.self_attn.scaling) for layer in layers}
        if len(eps) != 1 or len(scales) != 1:
            return None
        shapes = set()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods = [getattr(attn, "rtts_qkv", None), attn.o_proj,
                    getattr(mlp, "rtts_gate_up", None), mlp.down_proj]
            ws: list[Any] = [getattr(m, "rtts_weights", None) for m in mods]
            if any(w is None or w.fp16 is None or w.bias is not None for w in ws):
                return None
            norms = [layer.input_layernorm.weight.detach().float().contiguous(),
                     layer.post_attention_layernorm.weight.detach().float().contiguous()]
            keep += norms + [w.fp16 for w in ws]
            rows.append([norms[0].data_ptr(), ws[0].fp16.data_ptr(), ws[1].fp16.data_ptr(),
                         norms[1].data_ptr(), ws[2].fp16.data_ptr(), ws[3].fp16.data_ptr()])
            shapes.add(tuple(tuple(w.fp16.shape) for w in ws))
        if len(shapes) != 1:
            return None
        (qkv, o, gu, down), = shapes
        hidden, hd, inter = qkv[1], o[1], gu[0] // 2
        heads = int(layers[0].self_attn.config.num_attention_heads)
        d = hd // heads
        if (qkv[0] != 3 * hd or o[0] != hidden or gu[1] != hidden or down != (hidden, inter)
                or d * heads != hd or d % 2):
            return None
        return cls(torch.tensor(rows, dtype=torch.int64), keep, hidden, heads, d, inter,
                   eps.pop(), scales.pop())

    def table(self, keys: Sequence[Any], values: Sequence[Any]) -> Any:
        """The full address table: the weights' and these key/value buffers' (fp32,
        contiguous, (slots, heads, columns, d) each, one per layer)."""
        import torch

        kv = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(keys, values,
                                                                          strict=True)],
                          dtype=torch.int64)
        return torch.cat([self.weights, kv], 1).contiguous()

    def run(self, h: Any, table: Any, cos: Any, sin: Any, valid: Any, t: int, threads: int,
            attn_threads: int) -> Any:
        """The layers on ``h`` (rows, hidden) fp32 (not changed); returns the new hidden
        states. ``table`` from :meth:`table`, ``cos``/``sin`` (rows, d) fp32, ``valid``
        (slots, columns) bool; ``t`` the column the new keys/values go to (each row
        attends its valid columns of ``[0, t]``)."""
        import torch

        kernel = _kernel()
        if kernel is None:
            raise RuntimeError("the fp16 layer loop is not available (fp16layers.available())")
        rows, columns = int(h.shape[0]), int(valid.shape[1])
        if (h.dtype != torch.float32 or tuple(h.shape) != (rows, self.hidden)
                or tuple(cos.shape) != (rows, self.d) or tuple(sin.shape) != (rows, self.d)
                or valid.dtype != torch.bool or not valid.is_contiguous()
                or not 0 <= t < columns or table.shape != (self.weights.shape[0], _PTRS)):
            raise ValueError("fp16layers.LayerPlan.run: inputs of the wrong shape or dtype")
        out = h.contiguous().clone()
        cos = cos.float().contiguous()
        sin = sin.float().contiguous()
        kernel(out, table, cos, sin, valid, rows, int(table.shape[0]), self.hidden,
               self.heads, self.d, self.inter, columns, t, self.eps, self.scale, threads,
               attn_threads)
        return out
