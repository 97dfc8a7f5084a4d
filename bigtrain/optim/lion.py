"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2): the sign
of an interpolation of momentum and gradient, one moment (4 bytes per parameter), decoupled
weight decay. Elementwise, so it runs on flat ZeRO shards like AdamW.

    c = beta1 m + (1 - beta1) g;   p = p - lr (sign(c) + wd p);   m = beta2 m + (1 - beta2) g

The paper's defaults are beta1 0.9, beta2 0.99, and a learning rate 3-10x below AdamW's with
weight decay 3-10x above (the update's every element has magnitude lr): ``optim.beta1`` and
``optim.beta2`` are read as they are, so set them for Lion.
"""

from __future__ import annotations

import torch




class Lion(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], lr: float, beta1: float, beta2: float):
        super().__init__(groups, {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = [self.state[p].setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                       for p in params]
            lr, decay = group["lr"], group["weight_decay"]
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            # One temporary per tensor for the interpolation; the moment itself moves after.
            signs = torch._foreach_lerp(moments, grads, 1 - group["beta1"])
            torch._foreach_sign_(signs)
            torch._foreach_add_(params, signs, alpha=-lr)
            torch._foreach_lerp_(moments, grads, 1 - group["beta2"])
