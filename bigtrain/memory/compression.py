"""int8 activation compression: a linear layer keeps its saved input as int8 with one scale per row.

A linear layer y = x W^T needs x in backward only for its weight gradient dW = dY^T x; the input
gradient dX = dY W needs W alone. So x is saved as q = round(x / s) in int8 with s = max|x_row| / 127
per row (token), and dW is computed from q s: a quarter of fp32's bytes (half of bf16's) plus 4 bytes
a row. The input gradient stays exact; the weight gradient carries the rounding error (at most
s / 2 per element, relative 1/254 of each row's largest entry), which the tests and the benchmark
report. (ActNN goes to 2 bits with per-group ranges and stochastic rounding; int8 with round to
nearest is the simple end of that trade.)

Linears that read the same input (wq, wk, wv; w1, w3) share one compressed copy: it is made once
per input tensor and version, so three linears do not keep three.

Under tensor parallelism a row-parallel linear (wo, w2: weight cut along its input features) sees
only its rank's share of each row, so a scale from the local features alone would differ from one
process's. Such a linear all-reduces (MAX) its rows' absolute maxima over the ranks that share the
row (one fp32 value a row, started before the matmul and waited for after it), so every rank
quantizes with the scale of the whole row: the int8 codes, and so the weight gradients, are those
of one process, whatever the layout (docs/activations.md says why not per-group scales). Inputs
whole on every rank (column-parallel linears, the head) and rows split by token (dp, Megatron SP,
Ulysses, micro-batches) need nothing: a row's scale is its own.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bigtrain.distributed.comm import AxisComm


def row_absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over each row of ``x`` (..., features), fp32 (..., 1): exact in any dtype."""
    return x.detach().float().abs().amax(dim=-1, keepdim=True)


def quantize_rows(x: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per row) of ``x`` (..., features). ``absmax``: each row's max |x|
    when the row is wider than ``x`` (its other features on other ranks); default ``x``'s own."""
    x32 = x.detach().float()
    if absmax is None:
        absmax = x32.abs().amax(dim=-1, keepdim=True)
    scale = absmax.clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(x32 / scale).clamp_(-127, 127).to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


class _Int8WeightGrad(torch.autograd.Function):
    """Identity on a linear's output that carries the weight gradient, from the int8 input.

    The output itself comes from ``F.linear(x, weight.detach())``, so the input gradient is torch's
    own (exact; and that matmul saves only the weight, not x). Keeping the two apart matters to the
    zero-bubble split backward: its W re-enters this node for the weight gradient alone, and it
    reads nothing there but the int8 copy and the incoming gradient (never the weight, which
    ZeRO-3 may have released by then)."""

    @staticmethod
    def forward(ctx, y, weight, bias, q, scale):
        ctx.save_for_backward(q, scale)
        ctx.x_dtype, ctx.has_bias = y.dtype, bias is not None
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        grad_w = grad_b = None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            x = dequantize_rows(q, scale, ctx.x_dtype)
            grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad, grad_w, grad_b, None, None


class _SharedQuantization:
    """The int8 copy of the input seen last, for the linears that read the same input one after the
    other (wq, wk, wv; w1, w3). Held by weak reference: the cache never keeps an input alive."""

    def __init__(self):
        self._last: tuple[weakref.ref, int, torch.Tensor, torch.Tensor] | None = None

    def of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is not None and self._last[0]() is x and self._last[1] == x._version:
            return self._last[2], self._last[3]
        q, scale = quantize_rows(x)
        self._last = (weakref.ref(x), x._version, q, scale)
        return q, scale


def compress_linear_inputs(modules: list[nn.Linear],
                           rows_split_over: dict[nn.Module, AxisComm] | None = None) -> int:
    """Make each linear of ``modules`` save its input in int8; returns how many. ``rows_split_over``:
    the linears whose input features are cut over a group of ranks (row-parallel), each with that
    group, over which its rows' scales are agreed."""
    shared = _SharedQuantization()
    split = rows_split_over or {}
    for linear in modules:
        def forward(x: torch.Tensor, linear=linear, comm=split.get(linear)) -> torch.Tensor:
            weight, bias = linear.weight, linear.bias
            if not torch.is_grad_enabled() or not weight.requires_grad:
                return F.linear(x, weight, bias)
            exact_bias = bias.detach() if bias is not None else None
            if comm is None:
                q, scale = shared.of(x)
                y = F.linear(x, weight.detach(), exact_bias)
            else:  # the whole row's max over the group, on the wire while the matmul runs
                absmax = row_absmax(x)
                pending = comm.all_reduce(absmax, op=dist.ReduceOp.MAX, async_op=True, tag="int8_row_absmax")
                y = F.linear(x, weight.detach(), exact_bias)
                if pending is not None:
                    pending.wait()
                q, scale = quantize_rows(x, absmax)
            out = _Int8WeightGrad.apply(y, weight, bias, q, scale)
            # A view on top, as F.linear's own output is a view of its matmul: hooks put on the
            # module's output (ZeRO-3 gathers before backward with one) must not sit on the node
            # that the split backward's W re-enters, or they run again there.
            return out.view_as(out)

        linear.forward = forward
    return len(modules)
