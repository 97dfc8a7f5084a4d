"""int8 activation compression (``memory.activation_compression = 'int8'``), stated again for the
independent references (bigtrain/check/reference.py, bigtrain/families/hf_reference.py): written
apart from the trainer's wrapper (``memory/compression.py``), which the references must not share.

The rule: a linear layer computes its output and its input gradient from its exact input, and its
weight (and bias) gradient from the input rounded per row (the last dimension, whole) to int8 with
s = max|row| / 127 in fp32 (never below the smallest normal), q = round(x / s) within +-127.
A bias is added once per layer (its gradient the output gradient's sum: no int8 in it), whatever
cut a layout makes of the layer. An MoE router stays exact (its block's logits are fp32).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn



def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as int8 compression keeps it for a weight gradient: q s in ``x``'s dtype, computed in fp32
    (in float64 for a float64 ``x``: a check's exact twin of its reference, the same rule unrounded)."""
    x32 = x.detach().to(torch.promote_types(x.dtype, torch.float32))
    s = x32.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return (torch.round(x32 / s).clamp(-127, 127) * s).to(x.dtype)


def _weight_gradient_from_int8(module: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """A forward hook: the linear's output again, its value and input gradient from the exact input
    (W detached), plus a zero whose only gradient is the weight's (and bias's) from the int8 copy."""
    if not torch.is_grad_enabled() or not module.weight.requires_grad:
        return None
    x = args[0]
    bias = module.bias
    exact = F.linear(x, module.weight.detach(), bias.detach() if bias is not None else None)
    from_int8 = F.linear(int8_round_trip(x), module.weight, bias)
    return exact + (from_int8 - from_int8.detach())


def int8_weight_gradients(blocks: nn.Module, head: nn.Linear | None, exact: Iterable[nn.Module] = ()) -> None:
    """Every linear module under ``blocks`` but those in ``exact`` (the caller's MoE routers), and
    ``head`` if given (the output projection, unless the fused loss holds it), takes its weight
    gradient from an int8 copy of its input. A router stays exact: its block computes the logits in
    fp32 from its weight, and its input is the block's, kept whole for them anyway."""
    kept = {id(m) for m in exact}
    linears = [m for m in blocks.modules() if isinstance(m, nn.Linear) and id(m) not in kept]
    for linear in linears + ([head] if head is not None else []):
        linear.register_forward_hook(_weight_gradient_from_int8)
