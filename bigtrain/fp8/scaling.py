"""Float8 formats, recipes and dynamic scaling: what a float8 GEMM operand is made of.

Every GEMM of a float8 linear layer is written ``A @ B^T`` with both operands' reduction dimension
last (the row-major x column-major form cuBLAS's float8 kernels take). An operand is quantized
with a *scale* s, the factor that takes the float8 values back: ``A ~ q * s``.

* ``tensorwise``: one s for the whole operand, from its largest magnitude.
* ``rowwise``: one s per row of the operand, i.e. per outer index of the GEMM, each from its
  largest magnitude *along the reduction dimension* (so s factors out of every dot product).

s is a power of two, ``2^ceil(log2(amax / fmax))`` (computed as torchao does, through the
multiplier ``fmax / amax`` rounded down to a power of two): q = x / s is then the float8 rounding
of x itself, the dequantized value q * s is exact in bf16 and fp32, and multiplying the GEMM's
result by the two scales adds no rounding. A power of two costs at most one binade of range
(amax lands in (fmax/2, fmax]). The values are clamped to the format's largest finite value
before the cast: eager casts to float8 did not saturate before torch 2.12.

Formats: e4m3 (3 mantissa bits, largest 448) for inputs and weights; e5m2 (2 mantissa bits,
largest 57344) for output gradients, whose range across a run is wider. The gradient operand is
always the first GEMM operand (A) in backward: the rowwise CUTLASS kernel accepts e5m2 only
there, and cuBLAS no e5m2 x e5m2 product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
SCALINGS = ("tensorwise", "rowwise")
EPS = 1e-12  # an all-zero operand gets a finite scale (torchao's guard)


@dataclass(frozen=True)
class Float8Recipe:
    """How a float8 linear layer quantizes. ``fast_accum_forward``: the forward GEMM accumulates
    in the tensor cores' faster, lower-precision mode (torchao's and Transformer Engine's default;
    the two backward GEMMs do not). It is a no-op for the emulated path."""

    scaling: str = "tensorwise"
    forward_dtype: torch.dtype = E4M3  # inputs and weights
    grad_dtype: torch.dtype = E5M2  # output gradients
    fast_accum_forward: bool = True

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"float8 scaling '{self.scaling}': must be one of {', '.join(SCALINGS)}")

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"


def float8_scale(t: torch.Tensor, dtype: torch.dtype, rowwise: bool, dim: int = -1) -> torch.Tensor:
    """The power-of-two dequantization scale of ``t``: shape () tensorwise; rowwise one per slice
    along ``dim``, kept as a dimension of 1 ((rows, 1) along the last, (1, columns) along the first);
    fp32."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True) if rowwise else t.detach().abs().amax()
    # fmax / amax in fp64 then fp32, as torchao does: eager and compiled code agree on it.
    multiplier = (torch.finfo(dtype).max / amax.double().clamp_min(EPS)).float()
    return torch.exp2(torch.floor(torch.log2(multiplier))).reciprocal()


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, scale) of a 2-D operand ``t`` (rows x reduction dimension); rowwise scales
    along ``dim``, the reduction dimension (:func:`quantize_transposed` passes 0)."""
    scale = float8_scale(t, dtype, rowwise, dim)
    fmax = torch.finfo(dtype).max
    # Dividing by a power of two is exact in the operand's own dtype (bf16 has fp32's exponents),
    # which saves eager mode an fp32 copy; the cast then rounds that exact value to float8.
    q = (t.detach() / scale.to(t.dtype)).clamp_(-fmax, fmax).to(dtype)
    return q, scale


def quantize_transposed(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, scale) of the operand ``t^T`` for a 2-D ``t`` whose *first* dimension is the
    GEMM's reduction dimension (the tokens of dY and x for dW, the output features of W for dX):
    bit for bit ``quantize(t.t().contiguous(), dtype, rowwise)``, values (columns, rows) row-major
    and scale () or (columns, 1), computed in ``t``'s own layout. The scales reduce along dim 0 (an
    amax is exact in any order), in memory order: no bf16/fp32 transposed copy is made and no
    reduction runs along a strided dimension; the division and cast are elementwise, and only the
    float8 result is transposed, at 1 byte an element. Tensorwise, the operand's codes are ``t``'s
    own, transposed: the same operations as ``quantize(t, ...)``, so a compiled graph that
    quantizes dY for dX and dY^T for dW quantizes it once (AOT autograd merges identical
    operations) and copies the float8 bytes."""
    q, scale = quantize(t, dtype, rowwise, dim=0)
    return q.t().contiguous(), (scale.reshape(-1, 1) if rowwise else scale)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in ``dtype`` (exact in bf16 and fp32: see the module docstring)."""
    return q.to(dtype) * scale.to(dtype)
