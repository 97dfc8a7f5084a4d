"""Selective recomputation (Korthikanti et al. 2022): recompute the cheap parts of a block, keep the rest.

In every block the two RMSNorms, the attention core (scaled dot-product attention) and the SwiGLU
activation run under a non-reentrant checkpoint each; the linear layers are not recomputed, and
keep their inputs. What a block then saves per token (B bytes per element of the compute dtype;
``plan/activations.py`` turns this into the planner's formula):

    attention_norm: its input B h (the checkpoint's) and its output B h (the input of wq, wk, wv)
    attention core: its inputs q, k, v  B (h + 2k) (SDPA saves these anyway) and its output B h
                    (the input of wo); no log-sum-exp, no rotated copies beyond q, k
    ffn_norm:       its input B h and its output B h (the input of w1, w3)
    SwiGLU:         its inputs w1 x, w3 x  2 B F and its output B F (the input of w2)

against the plain block's fp32 norm internals (input in fp32, rsqrt, normalized x), the
log-sum-exp and silu's output. The recomputed work is elementwise plus attention itself (about
4 s h FLOPs per token of a causal block), where full recomputation redoes every matmul.
Parameter names and numerics are those of the plain model: recomputation runs the same kernels.
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


def selective_parts(block: nn.Module) -> list[nn.Module]:
    """The modules of a Llama block that selective recomputation wraps."""
    return [block.attention_norm, block.attention.core, block.ffn_norm, block.feed_forward.activation]


def apply_selective_recomputation(blocks: nn.ModuleList) -> list[int]:
    """Recompute the norms, attention core and activation of every block; returns their indices."""
    for block in blocks:
        for part in selective_parts(block):
            recompute_in_backward(part)
    return list(range(len(blocks)))
