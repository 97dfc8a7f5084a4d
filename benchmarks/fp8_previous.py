"""The float8 linear's autograd formulation before 2026-11-28, kept as the reference that the
current one (bigtrain/fp8/linear.py) must equal bit for bit and as the baseline that
benchmarks/bench_fp8_block.py times. Not reachable from any config.

It computed each GEMM's operands from the compute-precision tensors with ``float8_matmul_nt``:
the backward's transposed operands (W^T for dX, dY^T and x^T for dW) were copied transposed in
bf16 first, then reduced along the strided tokens (rowwise) and cast; dY was quantized once per
GEMM (tensorwise too, with the same scale), and the weight-gradient node kept the bf16 input.

    model = ...; convert_to_float8(model, recipe, backend); use_previous_formulation(model)
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.fp8.gemm import float8_matmul_nt
from bigtrain.fp8.linear import Float8Linear
from bigtrain.fp8.scaling import Float8Recipe


class _PreviousInputPath(torch.autograd.Function):
    """y = x W^T in float8; backward: dX = dY W in float8 (the weight comes in detached)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: Float8Recipe, backend: str):
        ctx.save_for_backward(weight)
        ctx.recipe, ctx.backend, ctx.x_dtype = recipe, backend, x.dtype
        y = float8_matmul_nt(x.reshape(-1, x.shape[-1]), recipe.forward_dtype, weight, recipe.forward_dtype,
                             recipe.rowwise, backend, x.dtype, recipe.fast_accum_forward)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        r = ctx.recipe
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = float8_matmul_nt(rows, r.grad_dtype, weight.t(), r.forward_dtype, r.rowwise, ctx.backend,
                                  ctx.x_dtype)
        return grad_x.view(*grad.shape[:-1], weight.shape[1]), None, None, None


class _PreviousWeightGrad(torch.autograd.Function):
    """Identity on the output; backward: dW = dY^T x in float8, from the saved bf16 input."""

    @staticmethod
    def forward(ctx, y, weight, x, recipe: Float8Recipe, backend: str):
        ctx.save_for_backward(x)
        ctx.recipe, ctx.backend, ctx.weight_dtype = recipe, backend, weight.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        r = ctx.recipe
        grad_w = None
        if ctx.needs_input_grad[1]:
            rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            grad_w = float8_matmul_nt(rows.t(), r.grad_dtype, inputs.t(), r.forward_dtype, r.rowwise, ctx.backend,
                                      ctx.weight_dtype)
        return grad, grad_w, None, None, None


class PreviousFloat8Linear(Float8Linear):
    """A :class:`Float8Linear` computing with the previous formulation (same parameters, recipe and
    backend)."""

    def float8_product(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        y = _PreviousInputPath.apply(x, weight.detach(), self.recipe, self.backend)
        if weight.requires_grad and torch.is_grad_enabled():
            y = _PreviousWeightGrad.apply(y, weight, x.detach(), self.recipe, self.backend)
        return y.view_as(y)


def use_previous_formulation(model: nn.Module) -> int:
    """Swap every :class:`Float8Linear` in ``model`` for a :class:`PreviousFloat8Linear` holding the
    same parameters; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Float8Linear:
                setattr(parent, name, PreviousFloat8Linear.from_linear(child, child.recipe, child.backend))
                swapped += 1
    return swapped
