"""``x @ w.T`` for fp32 activations and fp16 weights at a few rows, summed in fp32: the
multi-row ``fp16`` kernel path (:mod:`rtts.engines.kernels`).

Why a kernel of our own: on CPUs without native bf16 (an AVX2 AMD EPYC, Zen 3), torch's
fp16 matrix product is scalar code, MKL and oneDNN have no fp16 weights, and inductor's
generated dot product (``kernels.fp16_linear``) is fast only where the rows are graph
inputs. Inside the GPT step, at 2+ rows, it stored the widened product as a buffer, or
vectorized over the rows with scalar weight loads: 0.4-1.3 s a step instead of 20-40 ms.
This loop reads each fp16 weight once, widens it in registers (F16C) and multiplies it
into up to four rows at a time. Measured on that EPYC (2 threads, the GPT's 80 linears,
best of 6, ms): 1 row 25.6-25.9, 2 rows 27.7-31.0, 4 rows 27.2-28.6, 8 rows 55-72;
MKL fp32 at the same rows 63-73, 128-138, 144-159, 176-194.

It is written with ATen's portable vector types (``at::vec``, what inductor's own CPU
kernels use, so the same source builds for AVX2 or AVX-512) and built at first use by
inductor's C++ toolchain (``CppPythonBindingsCodeCache``: torch's compiler flags for this
CPU, its cache, a binding that takes tensors). That is a private torch API and needs a
C++ compiler: where either is missing, :func:`available` is false and the ``fp16`` path
keeps its torch-only forms."""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["MATVEC", "available", "mm"]

logger = logging.getLogger("rtts.fp16mm")

# The product as a C++ function, also compiled into rtts.engines.fp16layers' layer loop.
MATVEC = r"""
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
using at::vec::Vectorized;

// y (rows, n) = x (rows, k) @ w (n, k).T: x fp32, w fp16, sums in fp32
static void fp16_matvec(const float* x, const at::Half* w, float* y, const int64_t rows,
                        const int64_t n, const int64_t k, const int64_t threads) {
    constexpr int64_t V = Vectorized<float>::size();
    constexpr int64_t R = 4;  // rows per pass over a weight row (8 accumulators: no spills)
    const int64_t body = k - k % (2 * V);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; ++j) {
        const at::Half* wr = w + j * k;
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
            const int64_t rn = std::min(R, rows - r0);
            Vectorized<float> acc[R][2];
            for (int64_t r = 0; r < R; ++r) {
                acc[r][0] = Vectorized<float>(0);
                acc[r][1] = Vectorized<float>(0);
            }
            for (int64_t i = 0; i < body; i += 2 * V) {
                auto wv = at::vec::convert<float, 2, at::Half, 1>(
                    Vectorized<at::Half>::loadu(wr + i, 2 * V));
                for (int64_t r = 0; r < rn; ++r) {
                    const float* xr = x + (r0 + r) * k + i;
                    acc[r][0] = at::vec::fmadd(wv[0], Vectorized<float>::loadu(xr), acc[r][0]);
                    acc[r][1] = at::vec::fmadd(wv[1], Vectorized<float>::loadu(xr + V),
                                               acc[r][1]);
                }
            }
            for (int64_t r = 0; r < rn; ++r) {
                float sum = at::vec::vec_reduce_all<float>(
                    [](Vectorized<float>& a, Vectorized<float>& b) { return a + b; },
                    acc[r][0] + acc[r][1]);
                const float* xr = x + (r0 + r) * k;
                for (int64_t i = body; i < k; ++i) {
                    sum += static_cast<float>(wr[i]) * xr[i];
                }
                y[(r0 + r) * n + j] = sum;
            }
        }
    }
}
"""

_SOURCE = MATVEC + r"""
extern "C" void kernel(const float* x, const at::Half* w, float* y, const int64_t rows,
                       const int64_t n, const int64_t k, const int64_t threads) {
    fp16_matvec(x, w, y, rows, n, k, threads);
}
"""
_ARGS = ["const float*", "const at::Half*", "float*", "int64_t", "int64_t", "int64_t",
         "int64_t"]


@functools.cache
def _kernel() -> Any:
    """The built kernel, or None where it cannot be built here (logged once)."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(_ARGS, _SOURCE)
    except Exception as exc:  # noqa: BLE001 - no compiler, a torch without the API, ...
        logger.warning("the fp16 multi-row kernel is not available here (%s: %s); the fp16 "
                       "path keeps torch's own forms", type(exc).__name__, exc)
        return None


def available() -> bool:
    """Whether the kernel builds on this machine (built once, at the first call)."""
    return _kernel() is not None


def mm(x: Any, w: Any) -> Any:
    """``x @ w.T``: ``x`` fp32 (rows, K), ``w`` fp16 (N, K), both contiguous on the CPU
    (the caller's invariants, checked); fp32 (rows, N). Only where :func:`available`."""
    import torch

    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fp16 kernel is not available (fp16mm.available())")
    if (x.dtype != torch.float32 or w.dtype != torch.float16 or x.dim() != 2
            or w.dim() != 2 or x.shape[1] != w.shape[1] or x.device.type != "cpu"
            or w.device.type != "cpu"):
        raise ValueError(f"fp16mm.mm needs fp32 (rows, K) and fp16 (N, K) on the CPU, not "
                         f"{x.dtype} {tuple(x.shape)} and {w.dtype} {tuple(w.shape)}")
    x = x.contiguous()
    w = w.contiguous()
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    kernel(x, w, y, x.shape[0], w.shape[0], w.shape[1], torch.get_num_threads())
    return y
