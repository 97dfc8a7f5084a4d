"""Test support: SGD with momentum, plugged into bigtrain through the optimizer seam alone.

Nothing in the library knows this optimizer (only the independent reference, which runs
``torch.optim.SGD`` for the same name): importing this module registers it, and the engines,
checkpoints and planner take everything they need from its declaration. The step is written here
from scratch, with torch.optim.SGD's rule (momentum ``optim.beta1``, no dampening, L2 weight decay
added to the gradient):

    d = g + wd p;   buf = d on the first step, then beta1 buf + d;   p = p - lr buf
"""

from __future__ import annotations

import torch

from bigtrain.optim import OptimizerSpec, StateTensor, register_optimizer


class SGDMomentum(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], lr: float, momentum: float):
        super().__init__(groups, {"lr": lr, "momentum": momentum, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=decay) if decay else p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = d.clone()
                else:
                    state["momentum_buffer"].mul_(momentum).add_(d)
                p.add_(state["momentum_buffer"], alpha=-lr)


def build(groups: list[dict], cfg) -> SGDMomentum:
    return SGDMomentum(groups, lr=cfg.lr, momentum=cfg.beta1)


SGD_MOMENTUM = register_optimizer(OptimizerSpec(
    name="sgd_momentum", state=(StateTensor("momentum_buffer"),), build=build,
    summary="SGD with momentum (test support): one fp32 buffer, 4 bytes per parameter"))
