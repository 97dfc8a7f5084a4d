"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in float8, and the swap that puts it in.

For y = x W^T (x: M x K tokens by input features, W: N x K):

    forward  y  = x  @ W^T   x: e4m3, W: e4m3   rowwise scales: x per token, W per output feature
    backward dX = dY @ W     dY: e5m2, W: e4m3  rowwise: dY per token, W per input feature
    backward dW = dY^T @ x   dY: e5m2, x: e4m3  rowwise: dY per output feature, x per input feature

each scale taken along that GEMM's reduction dimension (K, N, then the tokens M): rowwise
quantizes every operand twice, once per GEMM it enters. Dynamic scaling: each scale comes from the
tensor at hand, no amax history. What backward keeps of the weight is the weight itself, in the
compute precision: a float8 copy would keep a whole gathered weight alive under ZeRO-3. Of the
input it keeps, rowwise, the input itself (dW needs x scaled along the tokens, not per token, as
torchao does) and, tensorwise, the forward's float8 input and its scale: x^T's tensorwise
quantization is x's transposed (one amax, the same codes), so dW reads 1 byte an element of x,
not 2, and the saved activation is half bf16's.

Every operand whose reduction dimension is its first (W for dX, dY and x for dW) is quantized in
its own layout and only its float8 codes transposed (``scaling.quantize_transposed``): the
rowwise scales reduce along the tokens in memory order, and tensorwise dY is quantized by the
same operations for both backward GEMMs, which a compiled graph then computes once. The float8
values, and so the results, are bit for bit those of quantizing each transposed operand from a
transposed bf16 copy, as this module did until 2026-11-28 (``benchmarks/fp8_previous.py``, the
reference of ``tests/test_fp8.py -k previous``; docs/precision.md has what it saves).

The two backward GEMMs are two autograd nodes, as in :mod:`bigtrain.memory.compression`: the
forward node's backward computes dX only, and an identity node on its output computes dW. The
zero-bubble split backward (``parallel/pipeline/split_backward.py``) re-enters the latter for W
alone, which then reads only x and dY, never the weight ZeRO-3 may have released by then. (Its I
computes that node's dW too and drops it: a custom Function cannot tell which of its outputs a
backward call wants; the same holds for int8 compression.)

Master weights, the optimizer, norms, embedding, head and MoE routers are untouched: only the
linears the swap names change class, and their parameters (names, objects) stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from bigtrain.fp8.gemm import BACKENDS, scaled_matmul_nt
from bigtrain.fp8.scaling import Float8Recipe, quantize, quantize_transposed
from bigtrain.wrappers import name_in, unwrapped

if TYPE_CHECKING:  # a plan object, read here; the parallel plans are the caller's
    from bigtrain.parallel.parallel_plan import Float8Plan

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


class _Float8InputPath(torch.autograd.Function):
    """y = x W^T in float8 from x's float8 codes (quantized by the caller, which also hands them to
    the weight-gradient node); backward: dX = dY W in float8 (the weight comes in detached)."""

    @staticmethod
    def forward(ctx, x, x_q, x_scale, weight, recipe: Float8Recipe, backend: str):
        ctx.save_for_backward(weight)
        ctx.recipe, ctx.backend, ctx.x_dtype = recipe, backend, x.dtype
        w_q, w_scale = quantize(weight.contiguous(), recipe.forward_dtype, recipe.rowwise)
        y = scaled_matmul_nt(x_q, x_scale, w_q, w_scale, backend, x.dtype, recipe.fast_accum_forward)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        r = ctx.recipe
        rows = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_q, grad_scale = quantize(rows, r.grad_dtype, r.rowwise)
        # dX = dY @ W: B = W^T, whose rows (input features) run over the reduction (output features).
        weight_t_q, weight_t_scale = quantize_transposed(weight, r.forward_dtype, r.rowwise)
        grad_x = scaled_matmul_nt(grad_q, grad_scale, weight_t_q, weight_t_scale, ctx.backend, ctx.x_dtype)
        return grad_x.view(*grad.shape[:-1], weight.shape[1]), None, None, None, None, None


class _Float8WeightGrad(torch.autograd.Function):
    """Identity on the output; backward: dW = dY^T x in float8, from what was saved of the input
    alone: ``x_saved`` is the input itself (rowwise, ``x_scale`` None) or its float8 codes with their
    tensorwise scale ``x_scale``."""

    @staticmethod
    def forward(ctx, y, weight, x_saved, x_scale, recipe: Float8Recipe, backend: str):
        if recipe.rowwise:
            ctx.save_for_backward(x_saved)
        else:
            ctx.save_for_backward(x_saved, x_scale)
        ctx.recipe, ctx.backend, ctx.weight_dtype = recipe, backend, weight.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.recipe
        grad_w = None
        if ctx.needs_input_grad[1]:
            rows = grad.reshape(-1, grad.shape[-1]).contiguous()
            # dW = dY^T @ x: A = dY^T (output features x tokens), B = x^T (input features x tokens).
            grad_t_q, grad_t_scale = quantize_transposed(rows, r.grad_dtype, r.rowwise)
            if r.rowwise:
                (x,) = ctx.saved_tensors
                x_t_q, x_t_scale = quantize_transposed(x.reshape(-1, x.shape[-1]), r.forward_dtype, True)
            else:
                x_q, x_t_scale = ctx.saved_tensors
                x_t_q = x_q.t().contiguous()
            grad_w = scaled_matmul_nt(grad_t_q, grad_t_scale, x_t_q, x_t_scale, ctx.backend, ctx.weight_dtype)
        return grad, grad_w, None, None, None, None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` computing in float8 (``recipe``, on ``backend``: 'scaled_mm' or 'emulated').
    Same parameters and state-dict names; the bias, if any, is added in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Float8Recipe,
                 backend: str, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if backend not in BACKENDS:
            raise ValueError(f"float8 backend '{backend}': must be one of {', '.join(BACKENDS)}")
        self.recipe, self.backend = recipe, backend

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Float8Recipe, backend: str) -> "Float8Linear":
        """A Float8Linear holding ``linear``'s own parameter objects (built on the meta device:
        nothing is allocated, whatever device ``linear`` is on)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, backend=backend)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.float8_product(x)
        return y if self.bias is None else y + self.bias

    def float8_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in float8, without the bias (a row-parallel layer adds it after its sum:
        bigtrain/parallel/tensor/styles.py's ``RowParallelFloat8Linear``)."""
        weight, recipe = self.weight, self.recipe
        # x's float8 codes, for the forward GEMM and (tensorwise) saved for dW.
        x_q, x_scale = quantize(x.detach().reshape(-1, x.shape[-1]).contiguous(), recipe.forward_dtype,
                              recipe.rowwise)
        y = _Float8InputPath.apply(x, x_q, x_scale, weight.detach(), recipe, self.backend)
        if weight.requires_grad and torch.is_grad_enabled():
            saved = (x.detach(), None) if recipe.rowwise else (x_q, x_scale)
            y = _Float8WeightGrad.apply(y, weight, *saved, recipe, self.backend)
        # A view on top, as F.linear's output is a view of its matmul: a hook put on the module's
        # output (ZeRO-3 gathers before backward with one) must not sit on the node that the
        # split backward's W re-enters.
        return y.view_as(y)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8={self.recipe.scaling}, backend={self.backend}"


@dataclass(frozen=True)
class Float8Linears:
    """What the swap did, recorded on the parallel model: the linears (qualified names in the
    model given to :func:`convert_to_float8`), the recipe, the backend."""

    names: tuple[str, ...]
    recipe: Float8Recipe
    backend: str

    def check_kept(self, model: nn.Module) -> None:
        """Raise if a later step put a module that is no :class:`Float8Linear` where one of the named
        linears was (under any wrappers): the layer would compute in the compute dtype while this
        record says float8 (a row-parallel bias once did: parallel/tensor/styles.py)."""
        lost = [n for n in self.names if not isinstance(unwrapped(model.get_submodule(n)), Float8Linear)]
        if lost:
            kinds = sorted({type(unwrapped(model.get_submodule(n))).__name__ for n in lost})
            raise ValueError(f"float8: {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''} no longer compute in "
                             f"float8 after the parallel plans (now {', '.join(kinds)})")


def convert_to_float8(model: nn.Module, recipe: Float8Recipe, backend: str, root: str = "layers",
                      skip: tuple[str, ...] = ("router", "shared_gate")) -> Float8Linears:
    """Swap every plain ``nn.Linear`` under ``model.<root>`` (the transformer blocks) for a
    :class:`Float8Linear` holding the same parameters, except those whose attribute name is in
    ``skip`` (an MoE router's choice is discrete: float8 noise would flip experts; a shared expert's
    gate is one output wide, no float8 GEMM shape). Run it on the
    plain model before the parallel plans, which then cut and hook the float8 modules as they
    would the linears (they are ``nn.Linear`` instances)."""
    blocks = model.get_submodule(root)
    names = []
    for parent_name, parent in list(blocks.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child_name not in skip:
                setattr(parent, child_name, Float8Linear.from_linear(child, recipe, backend))
                names.append(".".join(n for n in (root, parent_name, child_name) if n))
    return Float8Linears(tuple(names), recipe, backend)


def float8_matmuls_on(device: torch.device | str) -> bool:
    """Whether ``device`` has float8 tensor cores (CUDA capability >= 8.9)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def float8_backend(device: torch.device | str, emulate: bool) -> str:
    """'emulated' when asked for; else 'scaled_mm', which needs float8 matmuls on ``device``."""
    if emulate:
        return "emulated"
    if float8_matmuls_on(device):
        return "scaled_mm"
    device = torch.device(device)
    what = (f"CUDA capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
            if device.type == "cuda" else f"a {device.type} device")
    raise ValueError(f"float8 matmuls need CUDA capability >= 8.9 (Ada, Hopper or newer); this run computes on "
                     f"{what}: set precision.fp8_emulate = true (float8 numerics with bf16/fp32 matmuls: "
                     f"correct, not faster) or precision.fp8 = 'none'")


def apply_float8(model: nn.Module, plan: "Float8Plan", device: torch.device | str) -> Float8Linears | None:
    """``plan`` on a plain model computing on ``device``: the block linears swapped, or None when
    ``plan.scaling`` is 'none'. Raises
    ValueError naming the fix when the device has no float8 matmuls and emulation was not asked for."""
    if plan.scaling == "none":
        return None
    if plan.blocks is None and not isinstance(getattr(model, "layers", None), nn.Module):
        raise ValueError(f"Float8Plan turns the blocks' linears float8, and a {type(model).__name__} has no "
                         f"'layers' (bigtrain's Llama's): give Float8Plan(blocks=lambda model: model.<its "
                         f"nn.ModuleList of blocks>)")
    root = name_in(model, plan.blocks(model)) if plan.blocks is not None else "layers"
    return convert_to_float8(model, Float8Recipe(plan.scaling), float8_backend(device, plan.emulate), root)
