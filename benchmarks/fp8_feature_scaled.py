"""An experimental float8 formulation for benchmarks/bench_fp8_block.py: every activation operand
scaled per *feature* (along the tokens) and quantized once, its scale folded into the weight operand.
Not reachable from any config: the block benchmark times it and measures its error beside the
recipes, so that one GPU call says whether it is worth a recipe (issue 27: rowwise must shed about
15 ms of quantization a step to reach 1.30x the compiled peer).

Rowwise (bigtrain/fp8) quantizes each activation twice: x per token for y = x W^T and per input
feature for dW = dY^T x; dY per token for dX = dY W and per output feature for dW, each time with
its own amax pass. Here each is quantized once, with one scale per feature over the tokens, which
is what dW needs, and the other GEMM takes the scale through its weight operand, exactly (the
scales are powers of two, and a bf16 weight times one is exact):

    y  = x W^T = (x_q diag(s_x)) W^T      = x_q (W diag(s_x))^T       A = x_q, scale 1 per token
    dX = dY W  = (dY_q diag(s_dy)) W      = dY_q (diag(s_dy) W)       A = dY_q, scale 1 per token
    dW = dY^T x = diag(s_dy) dY_q^T x_q diag(s_x)                     both operands rowwise

so x costs one amax pass and one cast (its float8 codes, 1 byte an element, are what backward
keeps: half of rowwise's bf16 input), and dY one amax pass and one cast; only the weight-sized
operands W diag(s_x) and diag(s_dy) W are quantized per GEMM. The price is in the numerics: a
token's values share their feature's scale over all tokens (per-token outliers, such as a first
token's massive activations, push that feature's other tokens towards float8's subnormals), and the
weight operand carries the activations' per-feature range (SmoothQuant's migration, all of it). The
benchmark reports each variant's error against the block computed in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.fp8.gemm import scaled_matmul_nt
from bigtrain.fp8.linear import Float8Linear
from bigtrain.fp8.scaling import Float8Recipe, quantize, quantize_transposed


class _FeatureScaledProduct(torch.autograd.Function):
    """y = x W^T with both activation operands quantized once per feature (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: Float8Recipe, backend: str):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        x_q, x_scale = quantize(rows, recipe.forward_dtype, True, dim=0)  # (M, K) codes, (1, K) scales
        w_q, w_scale = quantize(weight * x_scale.to(weight.dtype), recipe.forward_dtype, True)
        ones = torch.ones(rows.shape[0], 1, device=x.device)
        y = scaled_matmul_nt(x_q, ones, w_q, w_scale, backend, x.dtype, recipe.fast_accum_forward)
        ctx.save_for_backward(x_q, x_scale, weight)
        ctx.recipe, ctx.backend, ctx.x_dtype, ctx.x_shape = recipe, backend, x.dtype, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_q, x_scale, weight = ctx.saved_tensors
        r = ctx.recipe
        rows = grad.reshape(-1, grad.shape[-1]).contiguous()
        g_q, g_scale = quantize(rows, r.grad_dtype, True, dim=0)  # (M, N) codes, (1, N) scales
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # B = (diag(s_dy) W)^T: rows (input features) over the reduction (output features).
            w_t_q, w_t_scale = quantize_transposed(weight * g_scale.reshape(-1, 1).to(weight.dtype), r.forward_dtype,
                                                   True)
            ones = torch.ones(rows.shape[0], 1, device=grad.device)
            grad_x = scaled_matmul_nt(g_q, ones, w_t_q, w_t_scale, ctx.backend, ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # (1, N) scales as (N, 1) by reshape: a transposed view keeps a stride the kernel refuses.
            grad_w = scaled_matmul_nt(g_q.t().contiguous(), g_scale.reshape(-1, 1), x_q.t().contiguous(),
                                      x_scale.reshape(-1, 1), ctx.backend, weight.dtype)
        return grad_x, grad_w, None, None


class FeatureScaledFloat8Linear(Float8Linear):
    """A :class:`Float8Linear` computing with the feature-scaled formulation (same parameters)."""

    def float8_product(self, x: torch.Tensor) -> torch.Tensor:
        return _FeatureScaledProduct.apply(x, self.weight, self.recipe, self.backend)


def use_feature_scaled(model: nn.Module) -> int:
    """Swap every rowwise :class:`Float8Linear` in ``model`` for a :class:`FeatureScaledFloat8Linear`
    holding the same parameters; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Float8Linear and child.recipe.rowwise:
                setattr(parent, name, FeatureScaledFloat8Linear.from_linear(child, child.recipe, child.backend))
                swapped += 1
    return swapped
