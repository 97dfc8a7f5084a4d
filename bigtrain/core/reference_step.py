"""What one step of an independent reference produced (``bigtrain check`` compares a layout's step
with it): written by each family's reference, read by :mod:`bigtrain.check.run`."""

from __future__ import annotations

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
