"""Optimizers (the seam in :mod:`bigtrain.optim.spec`), learning-rate schedules and gradient clipping.

Importing this package does not import torch (config validation lists the optimizers' names); giving
an optimizer saved state is :func:`bigtrain.optim.loading.load_state`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigtrain.optim import adamw as _adamw  # noqa: F401 - registers "adamw"
from bigtrain.optim import efficient as _efficient  # noqa: F401 - registers "adamw8bit", "adafactor", "lion"
from bigtrain.optim.spec import (OptimizerSpec, StateTensor, get_optimizer, optimizer_names,
                                 register_optimizer, unregister_optimizer)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bigtrain.config import OptimConfig

__all__ = ["OptimizerSpec", "StateTensor", "build_adamw", "build_optimizer", "decay_groups", "get_optimizer",
           "optimizer_names", "register_optimizer", "unregister_optimizer"]


def decay_groups(decay: list, no_decay: list, cfg: "OptimConfig") -> list[dict]:
    """Parameter groups with weight decay on ``decay`` only; empty groups left out."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: "nn.Module", cfg: "OptimConfig", spec: OptimizerSpec | None = None
                    ) -> "torch.optim.Optimizer":
    """``cfg.name``'s optimizer (or ``spec``'s) over ``model``'s parameters, with weight decay on
    matrices only (norm gains and vectors are not decayed)."""
    spec = spec or get_optimizer(cfg.name)
    params = [p for p in model.parameters() if p.requires_grad]  # de-duplicated: a tied weight once
    return spec.build(decay_groups([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2], cfg), cfg)


def build_adamw(model: "nn.Module", cfg: "OptimConfig", lr: float) -> "torch.optim.Optimizer":
    """AdamW (fused where the device has the kernel) at learning rate ``lr``, whatever ``cfg.name``."""
    optimizer = build_optimizer(model, cfg, get_optimizer("adamw"))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return optimizer
