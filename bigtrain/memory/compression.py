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
from bigtrain.models.row_parallel_linear import RowParallelLinear
from bigtrain.wrappers import ModuleWrapper, replace_module, unwrapped



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
    other (wq, wk, wv; w1, w3). Held by weak reference, the input and its copy alike: the cache never
    keeps either alive. (It held the copy itself until 2026-11-29: the head's int8 input, B T h
    bytes, stayed alive from one step to the next, through evaluation and checkpoint saves.) The
    graph that saved the copy keeps it while the next linear may share it; where nothing does (a
    recomputed block's first forward, whose saved tensors are dropped), each linear quantizes anew."""

    def __init__(self):
        self._last: tuple[weakref.ref, int, weakref.ref, weakref.ref] | None = None

    def of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is not None and self._last[0]() is x and self._last[1] == x._version:
            q, scale = self._last[2](), self._last[3]()
            if q is not None and scale is not None:
                return q, scale
        q, scale = quantize_rows(x)
        self._last = (weakref.ref(x), x._version, weakref.ref(q), weakref.ref(scale))
        return q, scale


class Int8SavedInput(ModuleWrapper):
    """A linear layer that saves its input as int8 rows for its weight gradient (see the module
    docstring); ``shared``: the copy of the input that linears reading the same input share;
    ``rows_over``: for a row-parallel linear (its input features cut over a group of ranks), that
    group, over which each row's scale is agreed (its own quantization, not shared)."""

    kind = "int8_saved_input"

    def __init__(self, linear: nn.Linear, shared: _SharedQuantization, rows_over: AxisComm | None = None):
        if type(unwrapped(linear)) not in (nn.Linear, RowParallelLinear):  # it computes as nn.Linear does
            raise ValueError(f"int8 compression: {type(unwrapped(linear)).__name__} computes otherwise than "
                             f"nn.Linear, which this wrapper would silently replace")
        super().__init__(linear)
        object.__setattr__(self, "shared", shared)  # plain state of this wrapper, not a child
        object.__setattr__(self, "rows_over", rows_over)
        # A row-parallel layer's forward leaves its bias out: its style adds it once, after the
        # tensor-parallel sum (parallel/tensor/styles.py); added here too, every rank would add it.
        object.__setattr__(self, "adds_bias", not isinstance(unwrapped(linear), RowParallelLinear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, comm = self.weight, self.bias if self.adds_bias else None, self.rows_over
        if not torch.is_grad_enabled() or not weight.requires_grad:
            return F.linear(x, weight, bias)
        pending = None
        if comm is None:
            q, scale = self.shared.of(x)
        else:  # the whole row's max, on the wire while the matmul runs
            absmax = row_absmax(x)
            pending = comm.all_reduce(absmax, op=dist.ReduceOp.MAX, async_op=True, tag="int8_row_absmax")
        y = F.linear(x, weight.detach(), bias.detach() if bias is not None else None)
        if comm is not None:
            if pending is not None:
                pending.wait()
            q, scale = quantize_rows(x, absmax)
        out = _Int8WeightGrad.apply(y, weight, bias, q, scale)
        # A view on top, as F.linear's own output is a view of its matmul: hooks put on the
        # module's output (ZeRO-3 gathers before backward with one) must not sit on the node
        # that the split backward's W re-enters, or they run again there.
        return out.view_as(out)


def int8_linears(linears: list[nn.Linear], rows_over: list[AxisComm | None] | None = None) -> list[Int8SavedInput]:
    """:class:`Int8SavedInput` wrappers of ``linears``, sharing one int8 copy of a common input;
    ``rows_over``: each linear's group for agreed row scales (None: its own rows are whole)."""
    shared = _SharedQuantization()
    rows_over = rows_over or [None] * len(linears)
    return [Int8SavedInput(linear, shared, comm) for linear, comm in zip(linears, rows_over)]


def compress_linear_inputs(root: nn.Module, names: list[str], rows_split_over: dict[str, AxisComm] | None = None) -> int:
    """Make each linear ``names`` of ``root`` save its input in int8 (wrapped in place); returns how
    many. ``rows_split_over``: the linears (by name) whose input features are cut over a group of
    ranks (row-parallel), each with that group, over which its rows' scales are agreed."""
    split = rows_split_over or {}
    wrappers = int8_linears([root.get_submodule(n) for n in names], [split.get(n) for n in names])
    for name, wrapper in zip(names, wrappers):
        replace_module(root, name, wrapper)
    return len(names)
