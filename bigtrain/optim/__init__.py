"""Optimizers, learning-rate schedules and gradient clipping."""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.config import OptimConfig


def build_adamw(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and vectors are not decayed)."""
    params = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for n, p in params.values() if p.ndim >= 2]
    no_decay = [p for n, p in params.values() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
