"""Learning-rate schedule: linear warm-up, then cosine, linear or warm-up-stable-decay (WSD)
decay to a floor, or the peak throughout."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a section of the config, read here; the config module is the caller's
    from bigtrain.config import OptimConfig

SCHEDULES = ("cosine", "linear", "wsd", "constant")


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The peak rate, scaled linearly with the global batch when ``lr_scaling = 'linear'``
    (Goyal et al. 2017: k times the batch, k times the rate, with warm-up)."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch / cfg.base_batch
    return cfg.lr


def decay_start(total_steps: int, cfg: OptimConfig) -> int:
    """The first step of the decay: after the warm-up; for WSD, at the last ``decay_fraction`` of the
    run (Hägele et al. 2024's cool-down), so the stable part before it does not depend on the
    run's length and a run extended on resume took the same rates so far."""
    if cfg.schedule == "wsd":
        return max(cfg.warmup_steps, total_steps - round(cfg.decay_fraction * total_steps))
    return cfg.warmup_steps


def lr_at(step: int, total_steps: int, cfg: OptimConfig, global_batch: int) -> float:
    peak = peak_lr(cfg, global_batch)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    start = decay_start(total_steps, cfg)
    if cfg.schedule == "constant" or step < start:
        return peak
    progress = min(1.0, (step - start) / max(1, total_steps - start))
    floor = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress  # linear, and WSD's decay
