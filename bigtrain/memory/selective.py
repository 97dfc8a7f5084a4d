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

from bigtrain.models.moe import MoEFeedForward
from bigtrain.wrappers import ModuleWrapper, replace_module


class Recomputed(ModuleWrapper):
    """A part of a block run under a non-reentrant checkpoint: its output is recomputed in backward
    from its input. Its hooks (Ulysses' all-to-all around the attention core) stay outside: they
    run once, and the recomputation does not communicate."""

    kind = "recompute"

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.wrapped.forward(*args, **kwargs)
        return checkpoint(self.wrapped.forward, *args, use_reentrant=False, **kwargs)


class RecomputedAttention(Recomputed):
    """The attention core under recomputation (``memory.selective_attention``). It runs eagerly
    under ``torch.compile``, a compiled block's graph breaking around it: inductor cannot compile a
    recomputed SDPA on a CPU (torch 2.13: SDPA's CPU kernel is a seeded-random op, and AOT
    autograd's replay of its random state inside a recomputed region fails to lower:
    ``AssertionError: ... RunAndSaveRngState``). Its own kernel is the flash kernel either way."""

    @torch._disable_dynamo  # the decorator bigtrain/parallel/eager.py uses, without its import
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def selective_parts(block: nn.Module, attention: bool = False) -> list[str]:
    """The names (in ``block``) of the modules of a Llama block that selective recomputation wraps
    (``attention``: the core too); of an MoE block the norms and the shared expert's activation."""
    parts = ["attention_norm", "ffn_norm"]
    ffn = block.feed_forward
    if isinstance(ffn, MoEFeedForward):  # the experts' SwiGLU runs inside their loop or grouped GEMM: kept
        if ffn.shared is not None:
            parts.append("feed_forward.shared.activation")
    else:
        parts.append("feed_forward.activation")
    return parts + ["attention.core"] if attention else parts


def apply_selective_recomputation(blocks: nn.ModuleList, attention: bool = False) -> list[int]:
    """Wrap the norms and activation (and with ``attention`` the attention core) of every block in
    :class:`Recomputed`, in place; returns the blocks' indices."""
    for block in blocks:
        for name in selective_parts(block, attention):
            kind = RecomputedAttention if name == "attention.core" else Recomputed
            replace_module(block, name, kind(block.get_submodule(name)))
    return list(range(len(blocks)))
