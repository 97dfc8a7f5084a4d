"""Selective recomputation (Korthikanti et al. 2022): recompute the cheap parts of a block, keep the rest.

In every block the two RMSNorms and the SwiGLU activation run under a non-reentrant checkpoint
each; the linear layers are not recomputed, and keep their inputs. What a block then saves per
token (B bytes per element of the compute dtype; ``plan/activations.py`` turns this into the
planner's formula):

    attention_norm: its input B h (the checkpoint's) and its output B h (the input of wq, wk, wv)
    attention:      what SDPA keeps: q, k, v  B (h + 2k), its output B h (wo's input), log-sum-exp 4 a
    ffn_norm:       its input B h and its output B h (the input of w1, w3)
    SwiGLU:         its inputs w1 x, w3 x  2 B F and its output B F (the input of w2)

against the plain block's fp32 norm internals (input in fp32, rsqrt, normalized x: 8 h + 4 bytes
in fp32 per norm) and silu's output (B F). The recomputed work is elementwise.

The attention core: Korthikanti's selective recomputation exists to drop the attention matrices
(the 5 a s / h term). SDPA (flash attention, on CPU and GPU) never keeps them, so recomputing the
core drops only its log-sum-exp, 4 bytes a head a token, for one more attention forward (measured
on ``small``: +9% CPU time for 0.2% of the saved bytes, where the norms and the activation give
21% for +6%). ``memory.selective_attention`` adds it (then wo alone keeps attention's output, and
under Ulysses no extra copy of it is kept). Parameter names and numerics are those of the plain
model: recomputation runs the same kernels.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def recompute_in_backward(module: nn.Module) -> None:
    """Run ``module``'s forward under a non-reentrant checkpoint (its hooks stay outside)."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def selective_parts(block: nn.Module, attention: bool = False) -> list[nn.Module]:
    """The modules of a Llama block that selective recomputation wraps (``attention``: the core too);
    of an MoE block the norms and the shared expert's activation."""
    parts = [block.attention_norm, block.ffn_norm]
    ffn = block.feed_forward
    if getattr(ffn, "is_moe", False):  # the experts' SwiGLU runs inside their loop or grouped GEMM: kept
        ffn = ffn.shared
    if ffn is not None:
        parts.append(ffn.activation)
    return parts + [block.attention.core] if attention else parts


def apply_selective_recomputation(blocks: nn.ModuleList, attention: bool = False) -> list[int]:
    """Recompute the norms and activation (and with ``attention`` the attention core) of every
    block; returns their indices."""
    for block in blocks:
        for part in selective_parts(block, attention):
            recompute_in_backward(part)
    return list(range(len(blocks)))
