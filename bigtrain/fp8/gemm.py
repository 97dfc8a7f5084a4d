"""One float8 GEMM, ``A @ B^T`` with both operands' reduction dimension last, on two backends.

* ``scaled_mm``: ``torch._scaled_mm`` (cuBLAS / CUTLASS float8 kernels; CUDA capability >= 8.9).
  Its contract, from torch's ``ScaledBlas.cpp``: ``mat1`` row-major and ``mat2`` column-major
  (on H100 the only accepted pair), both dimensions of ``mat2`` and the inner one of ``mat1``
  multiples of 16, never two e5m2 operands; ``scale_a`` / ``scale_b`` are the *dequantization*
  factors, fp32, either one element each (tensorwise) or ``(M, 1)`` and ``(1, N)`` contiguous
  (rowwise). The result is ``(A_q * s_a) @ (B_q * s_b)^T`` accumulated in fp32 (fast-accum mode:
  less) and rounded once to ``out_dtype``. torch's CPU build runs it too (oneDNN), which is how
  CI checks this call against the emulation.
* ``emulated``: the same operands dequantized (exactly: power-of-two scales) and multiplied by
  ``torch.mm`` in ``out_dtype``, the run's compute dtype. It differs from the kernel only in the
  order of the fp32 accumulation (and fast-accum's narrower accumulator): the float8 rounding,
  which is what changes a run's numerics, is the same.
"""

from __future__ import annotations

import torch

from bigtrain.fp8.scaling import dequantize, quantize

BACKENDS = ("scaled_mm", "emulated")


def scaled_matmul_nt(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                     backend: str, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale)^T`` of quantized operands: ``a_q`` (M, K) and ``b_q``
    (N, K), both row-major, with scales () each or (M, 1) and (N, 1)."""
    if backend == "scaled_mm":
        # b_q is (N, K) row-major, so b_q.t() is the column-major (K, N) matrix the kernel wants.
        return torch._scaled_mm(a_q, b_q.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    if backend == "emulated":
        return torch.mm(dequantize(a_q, a_scale, out_dtype), dequantize(b_q, b_scale, out_dtype).t())
    raise ValueError(f"float8 backend '{backend}': must be one of {', '.join(BACKENDS)}")


def float8_matmul_nt(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_dtype: torch.dtype, rowwise: bool,
                     backend: str, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b.T`` for 2-D ``a`` (M, K) and ``b`` (N, K), each quantized to its float8 format with
    its own scale (per row of each, over K, when ``rowwise``)."""
    a_q, a_scale = quantize(a.contiguous(), a_dtype, rowwise)
    b_q, b_scale = quantize(b.contiguous(), b_dtype, rowwise)
    return scaled_matmul_nt(a_q, a_scale, b_q, b_scale, backend, out_dtype, fast_accum)
