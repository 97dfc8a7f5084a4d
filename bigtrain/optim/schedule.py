"""Learning-rate schedule: linear warm-up then cosine decay to a floor."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a section of the config, read here; the config module is the caller's
    from bigtrain.config import OptimConfig


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The peak rate, scaled linearly with the global batch when ``lr_scaling = 'linear'``
    (Goyal et al. 2017: k times the batch, k times the rate, with warm-up)."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch / cfg.base_batch
    return cfg.lr


def lr_at(step: int, total_steps: int, cfg: OptimConfig, global_batch: int) -> float:
    peak = peak_lr(cfg, global_batch)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = peak * cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
