"""Activation checkpointing: keep a block's input, recompute its inside during backward.

Applied to a plain model after it is built, by replacing the chosen blocks' ``forward`` on the
instance, so parameter names (and so checkpoints and parallel plans) stay the same as without it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


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


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` recompute its forward during backward (non-reentrant torch checkpoint)."""
    inner = module.forward

    def forward(x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(x, *args, **kwargs)
        return checkpoint(inner, _KeepInput.apply(x), *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module.is_checkpointed = True


def apply_activation_checkpointing(blocks: nn.ModuleList, policy: str, every: int = 1) -> list[int]:
    """Checkpoint the blocks the policy selects; returns their indices."""
    chosen = checkpointed_blocks(len(blocks), policy, every)
    for i in chosen:
        checkpoint_module(blocks[i])
    return chosen
