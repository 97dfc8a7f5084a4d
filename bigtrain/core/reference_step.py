"""What one step of an independent reference produced (``bigtrain check`` compares a layout's step
with it): written by each family's reference, read by :mod:`bigtrain.check.run`; and the learning
rate every reference steps with, written apart from the trainer's (``optim/schedule.py``)."""

from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch


@dataclass
class ReferenceStep:
    """What one step of the reference produced. ``outputs``, ``grads`` and ``weights`` are filled
    when the step was captured (full tensors by module / parameter name)."""

    loss: float
    grad_norm: float
    skipped: bool
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # after the update
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # reduced, unscaled, before clipping
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # forward outputs over the global batch



def reference_learning_rate(cfg, step: int) -> float:
    """Step ``step``'s learning rate as the references compute it, from the config alone: linear
    warm-up to the (optionally batch-scaled) peak, then a cosine to ``min_lr_ratio`` of it."""
    o, t = cfg.optim, cfg.train
    peak = o.lr * t.global_batch / o.base_batch if o.lr_scaling == "linear" else o.lr
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, t.steps - o.warmup_steps))
    floor = peak * o.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -- mixed precision, as the references state it: a low-precision copy computes, fp32 masters step --
def accumulate_into_masters(masters, low) -> None:
    """Add each low-precision parameter's gradient (``low``, the compute copy) into its master's,
    in the master's dtype, and clear it: what the trainer's mixed precision does per micro-batch."""
    for master, copy in zip(masters.parameters(), low.parameters()):
        if copy.grad is not None:
            grad = copy.grad.to(master.dtype)
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            copy.grad = None


@torch.no_grad()
def copy_masters_to(low, masters) -> None:
    """The compute copy takes the masters' values (rounded to its dtype) after an optimizer step."""
    for master, copy in zip(masters.parameters(), low.parameters()):
        copy.copy_(master)
