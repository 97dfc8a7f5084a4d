"""The reference loop's memory-efficient optimizers, written again from their papers with plain torch
ops, sharing nothing with :mod:`bigtrain.optim` (an error in ours cannot hide in these):

- ``adafactor``: ``torch.optim.Adafactor`` itself (the definition bigtrain follows);
- ``lion``: Algorithm 2 of Chen et al. (2023), one tensor at a time;
- ``adamw8bit``: AdamW whose moments are stored block-wise in 8 bits with the code maps
  bigtrain documents (log-spaced magnitudes: int8 0, +-1e-5 r**k up to 1; uint8 0, 1e-8 r**k up
  to 1; a value's code its rounded log-step, 0 below half the smallest), each block of
  ``optim.block_size`` elements of a flattened parameter scaled by its largest magnitude.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class PaperLion(torch.optim.Optimizer):
    def __init__(self, groups, lr, beta1, beta2):
        super().__init__(groups, {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, b1, b2, wd = group["lr"], group["beta1"], group["beta2"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.copy_(p - lr * (torch.sign(c) + wd * p))
                m.copy_(b2 * m + (1 - b2) * p.grad)


def _codes(x: torch.Tensor, signed: bool, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    smallest, steps = (1e-5, 127) if signed else (1e-8, 255)
    n = x.numel()
    blocks = F.pad(x.reshape(-1), (0, (-n) % block)).view(-1, block)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    rel = blocks.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
    k = ((rel / smallest).log() / (-math.log(smallest) / (steps - 1))).round().clamp(0, steps - 1) + 1
    k = torch.where(rel < smallest / 2, torch.zeros_like(k), k)
    if signed:
        k = k * blocks.sign()
    return k.reshape(-1)[:n], scale.reshape(-1)


def _values(k: torch.Tensor, scale: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    smallest, steps = (1e-5, 127) if signed else (1e-8, 255)
    mag = k.abs()
    v = torch.exp(math.log(smallest) + (mag - 1).double() * (-math.log(smallest) / (steps - 1))).float()
    v = torch.where(mag == steps, torch.ones_like(v), v)
    v = torch.where(mag == 0, torch.zeros_like(v), v) * (k.sign() if signed else 1)
    return v * scale.repeat_interleave(block)[:k.numel()]


class PlainAdamW8bit(torch.optim.Optimizer):
    def __init__(self, groups, lr, beta1, beta2, eps, block):
        super().__init__(groups, {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": 0.0})
        self.block = block

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, b1, b2, eps, wd = (group[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    nb = -(-p.numel() // self.block)
                    s.update(t=0, m=torch.zeros(p.numel()), v=torch.zeros(p.numel()), ms=torch.zeros(nb),
                             vs=torch.zeros(nb))
                s["t"] += 1
                g = p.grad.reshape(-1).float()
                m = b1 * _values(s["m"], s["ms"], True, self.block) + (1 - b1) * g
                v = b2 * _values(s["v"], s["vs"], False, self.block) + (1 - b2) * g * g
                p.mul_(1 - lr * wd)
                denom = v.sqrt() / math.sqrt(1 - b2 ** s["t"]) + eps
                p.add_((-lr / (1 - b1 ** s["t"]) * m / denom).view_as(p))
                s["m"], s["ms"] = _codes(m, True, self.block)
                s["v"], s["vs"] = _codes(v, False, self.block)


def reference_optimizer(groups: list[dict], o) -> torch.optim.Optimizer | None:
    if o.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=o.lr, beta2_decay=o.adafactor_decay, d=o.adafactor_clip,
                                     eps=(None, o.adafactor_eps))
    if o.name == "lion":
        return PaperLion(groups, o.lr, o.beta1, o.beta2)
    if o.name == "adamw8bit":
        return PlainAdamW8bit(groups, o.lr, o.beta1, o.beta2, o.eps, o.block_size)
    return None
