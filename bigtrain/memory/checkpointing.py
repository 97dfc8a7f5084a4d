"""Activation checkpointing: keep a block's input, recompute its inside during backward.

Applied to a plain model after it is built: each chosen block is put inside a :class:`Checkpointed`
wrapper (``bigtrain/wrappers.py``), which adds no name, so parameter names (and so checkpoints and
parallel plans) stay the same as without it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bigtrain.wrappers import ModuleWrapper, WholeBackward, wrap_all


class _KeepInput(torch.autograd.Function):
    """Identity that saves its input for backward, so saved-tensor accounting sees what a
    checkpointed block really keeps alive (its input) instead of nothing."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def checkpointed_blocks(n_blocks: int, policy: str, every: int = 1) -> list[int]:
    """Which block indices a policy checkpoints: 'none', 'full', or 'every' k-th (0, k, 2k, ...)."""
    if policy == "none":
        return []
    if policy == "full":
        return list(range(n_blocks))
    if policy == "every":
        return list(range(0, n_blocks, every))
    raise ValueError(f"memory.checkpointing = '{policy}': must be 'none', 'full' or 'every'")


class Checkpointed(WholeBackward, ModuleWrapper):
    """A block that keeps only its input and recomputes its forward during backward (non-reentrant
    torch checkpoint). Hooks on the block run outside the checkpoint, once, as without it."""

    kind = "checkpoint"

    def forward(self, x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.wrapped.forward(x, *args, **kwargs)
        return checkpoint(self.wrapped.forward, _KeepInput.apply(x), *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: nn.ModuleList | nn.ModuleDict, policy: str, every: int = 1) -> list[int]:
    """Wrap the blocks the policy selects in :class:`Checkpointed`, in place; returns their indices."""
    chosen = checkpointed_blocks(len(blocks), policy, every)
    wrap_all(blocks, chosen, Checkpointed)
    return chosen
