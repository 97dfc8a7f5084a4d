"""The reference loop's memory-efficient optimizers, written again from their papers with plain torch
ops, sharing nothing with :mod:`bigtrain.optim` (an error in ours cannot hide in these):

- ``adafactor``: ``torch.optim.Adafactor`` itself (the definition bigtrain follows);
- ``lion``: Algorithm 2 of Chen et al. (2023), one tensor at a time;
- ``adamw8bit``: AdamW whose moments are stored block-wise in 8 bits with the code maps
  bigtrain documents (log-spaced magnitudes: int8 0, +-1e-5 r**k up to 1; uint8 0, 1e-8 r**k up
  to 1; a value's code its rounded log-step, 0 below half the smallest), each block of
  ``optim.block_size`` elements of a flattened parameter scaled by its largest magnitude;
  :func:`replay_adamw8bit` takes one of its steps from a layout's own weights, state and gradient
  (``bigtrain check`` compares each step of a layout's 8-bit state with it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bigtrain.core.reference_step import decay_groups


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


def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's largest magnitude (one fp32 scale per block of flat ``x``)."""
    n = x.numel()
    return F.pad(x.reshape(-1), (0, (-n) % block)).view(-1, block).abs().amax(dim=1)


def codes_at(x: torch.Tensor, scale: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    """The codes (as float: +-k signed, k unsigned) of flat ``x`` in blocks of ``block`` scaled by
    ``scale``; non-decreasing in each element's value."""
    smallest, steps = (1e-5, 127) if signed else (1e-8, 255)
    n = x.numel()
    blocks = F.pad(x.reshape(-1), (0, (-n) % block)).view(-1, block)
    scale = scale.reshape(-1, 1)
    rel = blocks.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
    k = ((rel / smallest).log() / (-math.log(smallest) / (steps - 1))).round().clamp(0, steps - 1) + 1
    k = torch.where(rel < smallest / 2, torch.zeros_like(k), k)
    if signed:
        k = k * blocks.sign()
    return k.reshape(-1)[:n]


def _codes(x: torch.Tensor, signed: bool, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = block_scales(x, block)
    return codes_at(x, scale, signed, block), scale


def code_values(k: torch.Tensor, scale: torch.Tensor, signed: bool, block: int) -> torch.Tensor:
    smallest, steps = (1e-5, 127) if signed else (1e-8, 255)
    mag = k.abs()
    v = torch.exp(math.log(smallest) + (mag - 1).double() * (-math.log(smallest) / (steps - 1))).float()
    v = torch.where(mag == steps, torch.ones_like(v), v)
    v = torch.where(mag == 0, torch.zeros_like(v), v) * (k.sign() if signed else 1)
    return v * scale.repeat_interleave(block)[:k.numel()]


class PlainAdamW8bit(torch.optim.Optimizer):
    """``keep_moments``: also keep each step's fp32 moments before they are coded (``m32``, ``v32``)
    and the size of the terms each was summed from (``m_terms``, ``v_terms``: a bound on its
    rounding), for :func:`replay_adamw8bit`."""

    def __init__(self, groups, lr, beta1, beta2, eps, block, keep_moments: bool = False):
        super().__init__(groups, {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": 0.0})
        self.block, self.keep_moments = block, keep_moments

    def __getstate__(self):  # torch's keeps defaults, state and groups only: a deep copy lost these
        return {**super().__getstate__(), "block": self.block, "keep_moments": self.keep_moments}

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
                m_old = b1 * code_values(s["m"], s["ms"], True, self.block)
                v_old = b2 * code_values(s["v"], s["vs"], False, self.block)
                m = m_old + (1 - b1) * g
                v = v_old + (1 - b2) * g * g
                p.mul_(1 - lr * wd)
                denom = v.sqrt() / math.sqrt(1 - b2 ** s["t"]) + eps
                p.add_((-lr / (1 - b1 ** s["t"]) * m / denom).view_as(p))
                if self.keep_moments:
                    s.update(m32=m, v32=v, m_terms=m_old.abs() + (1 - b1) * g.abs(), v_terms=v_old + (1 - b2) * g * g)
                s["m"], s["ms"] = _codes(m, True, self.block)
                s["v"], s["vs"] = _codes(v, False, self.block)


def replay_adamw8bit(weights: dict[str, torch.Tensor], state: dict[str, dict], grads: dict[str, torch.Tensor],
                     lr: float, max_norm: float, o) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """One step of :class:`PlainAdamW8bit` from given full ``weights`` and 8-bit ``state`` (bigtrain's
    names: ``exp_avg`` int8 codes, ``exp_avg_sq`` uint8 codes, their per-block scales, ``step``;
    empty: the first step) with gradients ``grads``, clipped to ``max_norm`` by
    ``torch.nn.utils.clip_grad_norm_``, at learning rate ``lr``, decay on matrices only. Returns the
    weights after it and each parameter's state (:class:`PlainAdamW8bit`'s names, moments kept)."""
    params = {n: torch.nn.Parameter(w.detach().clone().float()) for n, w in weights.items() if n in grads}
    for n, p in params.items():
        p.grad = grads[n].detach().clone().float().view_as(p)
    optimizer = PlainAdamW8bit(decay_groups(params.values(), o.weight_decay), lr, o.beta1, o.beta2, o.eps, o.block_size,
                               keep_moments=True)
    for n, p in params.items():
        if state.get(n):
            s = state[n]
            optimizer.state[p].update(t=int(s["step"].item()), m=s["exp_avg"].reshape(-1).float(),
                                      v=s["exp_avg_sq"].reshape(-1).float(), ms=s["exp_avg_scale"].float().clone(),
                                      vs=s["exp_avg_sq_scale"].float().clone())
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    optimizer.step()
    return ({n: p.detach() for n, p in params.items()}, {n: optimizer.state[p] for n, p in params.items()})


def replay_adamw(weights: dict[str, torch.Tensor], state: dict[str, dict], grads: dict[str, torch.Tensor],
                 lr: float, max_norm: float, o) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """One step of ``torch.optim.AdamW`` (the reference's) from given full ``weights`` and state
    (torch's names: ``exp_avg``, ``exp_avg_sq``, ``step``; empty: the first step) with gradients
    ``grads``, clipped to ``max_norm``, at learning rate ``lr``, decay on matrices only: the weights
    and each parameter's state after it."""
    params = {n: torch.nn.Parameter(w.detach().clone().float()) for n, w in weights.items() if n in grads}
    for n, p in params.items():
        p.grad = grads[n].detach().clone().float().view_as(p)
    optimizer = torch.optim.AdamW(decay_groups(params.values(), o.weight_decay), lr=lr, betas=(o.beta1, o.beta2),
                                  eps=o.eps, foreach=False)
    for n, p in params.items():
        if state.get(n):
            s = state[n]
            optimizer.state[p].update(step=s["step"].detach().clone().float().reshape(()),
                                      exp_avg=s["exp_avg"].detach().clone().float().view_as(p),
                                      exp_avg_sq=s["exp_avg_sq"].detach().clone().float().view_as(p))
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    optimizer.step()
    return {n: p.detach() for n, p in params.items()}, {n: optimizer.state[p] for n, p in params.items()}


def reference_optimizer(groups: list[dict], o) -> torch.optim.Optimizer | None:
    if o.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=o.lr, beta2_decay=o.adafactor_decay, d=o.adafactor_clip,
                                     eps=(None, o.adafactor_eps))
    if o.name == "lion":
        return PaperLion(groups, o.lr, o.beta1, o.beta2)
    if o.name == "adamw8bit":
        return PlainAdamW8bit(groups, o.lr, o.beta1, o.beta2, o.eps, o.block_size)
    return None
