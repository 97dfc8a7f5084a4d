"""What one step of an independent reference produced (``bigtrain check`` compares a layout's step
with it): written by each family's reference, read by :mod:`bigtrain.check.run`; and the learning
rate every reference steps with, written apart from the trainer's (``optim/schedule.py``)."""

from __future__ import annotations

import contextlib
import functools
import math

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    # MoE: each block's routings per expert over the step (before capacity drops), by block name;
    # empty where the reference does not count them (bigtrain/check/routing.py).
    routing: dict[str, list[int]] = field(default_factory=dict)



def reference_learning_rate(cfg, step: int) -> float:
    """Step ``step``'s learning rate as the references compute it, from the config alone: linear
    warm-up to the (optionally batch-scaled) peak, then ``optim.schedule``: a cosine or a straight
    line from the peak at the end of the warm-up to ``min_lr_ratio`` of it at the last step; WSD:
    the peak, then a straight line to the floor over the last ``decay_fraction`` of the steps (not
    before the warm-up ends); 'constant': the peak."""
    o, t = cfg.optim, cfg.train
    peak = o.lr * t.global_batch / o.base_batch if o.lr_scaling == "linear" else o.lr
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return peak
    first = o.warmup_steps
    if o.schedule == "wsd":
        first = max(first, t.steps - round(o.decay_fraction * t.steps))
        if step < first:
            return peak
    progress = min(1.0, (step - first) / max(1, t.steps - first))
    floor = peak * o.min_lr_ratio
    if o.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak + (floor - peak) * progress


class ReferenceLossScale:
    """fp16's dynamic loss scale as the references state it (apart from bigtrain.precision's): the
    loss is multiplied by ``scale`` before backward and the gradients divided by it after; a step
    whose gradient norm is not finite is skipped and the scale multiplied by
    ``precision.scale_backoff`` (not below 1); every ``precision.scale_growth_interval`` clean steps
    it doubles. Outside fp16: 1, and no step is skipped."""

    def __init__(self, precision):
        self.fp16 = precision.mode == "fp16"
        self.scale = precision.loss_scale if self.fp16 else 1.0
        self.backoff, self.growth_interval = precision.scale_backoff, precision.scale_growth_interval
        self.clean_steps = 0

    def skips(self, norm: float) -> bool:
        """Whether the step whose unscaled gradient norm is ``norm`` is skipped; the scale moves for the next."""
        if not self.fp16:
            return False
        if not math.isfinite(norm):
            self.scale = max(1.0, self.scale * self.backoff)
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False


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


def decay_groups(params, weight_decay: float) -> list[dict]:
    """The optimizer's parameter groups as every reference states them, apart from the trainer's:
    decay on matrices, none on vectors (norms, biases); an empty group left out."""
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def next_token_loss_backward(logits_of, tokens: torch.Tensor, targets: torch.Tensor, micro_batch: int,
                             counted: int, dtype: torch.dtype, scale: float = 1.0, masters=None, low=None) -> float:
    """A reference's step of the next-token loss, written apart from the trainer's: micro-batch by
    micro-batch of ``micro_batch`` sequences, the cross-entropy summed in ``dtype`` over the targets
    and its backward divided by the step's ``counted`` targets (times the fp16 loss ``scale``); a
    16-bit copy's (``low``) gradients accumulated into its fp32 ``masters`` after each. ``logits_of``:
    tokens -> logits. Returns the summed loss."""
    loss_sum = 0.0
    for first in range(0, tokens.shape[0], micro_batch):
        logits = logits_of(tokens[first:first + micro_batch])
        loss = F.cross_entropy(logits.to(dtype).flatten(0, 1), targets[first:first + micro_batch].flatten(),
                               reduction="sum")
        loss_sum += float(loss.detach())
        (loss / counted * scale).backward()
        if low is not None and low is not masters:
            accumulate_into_masters(masters, low)
    return loss_sum


@contextlib.contextmanager
def recorded_outputs(model: torch.nn.Module, captured, convert):
    """While the block runs, ``{name: [output, ...]}`` of the modules of ``model`` that ``captured``
    (name -> bool) names, each output kept as ``convert(output)`` on the CPU; forward hooks, removed
    after. An output that is not one tensor (a layer's tuple) is left out, as the layout's probe does."""
    outputs: dict[str, list[torch.Tensor]] = {}

    def record(name, module, args, out):
        if torch.is_tensor(out):
            outputs.setdefault(name, []).append(convert(out.detach()).cpu().clone())

    handles = [m.register_forward_hook(functools.partial(record, name)) for name, m in model.named_modules()
               if captured(name)]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()
