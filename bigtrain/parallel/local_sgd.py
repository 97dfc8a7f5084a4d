"""Local SGD: data-parallel replicas that step alone and average their parameters every K steps.

The synchronous engine all-reduces every gradient on every step. Here each replica normalizes its
loss by its own batch, clips by its own gradient norm and runs its own optimizer; every ``every``
steps the replicas' parameters are averaged with one all-reduce of a flat buffer (the same bytes as
one step's gradients), so the data-parallel traffic per step is 1/K of the synchronous engine's.

The optimizer state (Adam's moments, momentum) is not averaged: each replica keeps its own, as in
torch's ``PostLocalSGDOptimizer`` and DiLoCo's inner optimizers; averaging it too would triple the
bytes of an Adam sync. K = 1 is not "average after every independent step" (which equals
synchronous training only for plain SGD): the trainer runs the synchronous engine for it, so K = 1
is synchronous data parallel for every optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm


class ParameterAveraging:
    """Averages ``params`` over ``comm`` after every ``every``-th call of :meth:`after_step`."""

    def __init__(self, params: list[nn.Parameter], comm: AxisComm, every: int):
        if every < 1:
            raise ValueError(f"every={every}: average parameters every K >= 1 steps")
        self.params, self.comm, self.every = params, comm, every
        self.steps = 0

    def in_agreement(self) -> bool:
        """Whether the replicas hold the same parameters: the last step ended with an average (or
        none was taken since they started equal). Only then can a checkpoint hold the parameters: a
        replica's part of each range in between is a patchwork of replicas that no one trained."""
        return self.steps % self.every == 0

    def continue_at(self, step: int) -> None:
        """Count from optimizer step ``step`` (a resumed run's): the averages stay at the multiples of
        K that ``checkpoint.every`` is validated against, not K steps after the resume."""
        self.steps = step

    def due(self) -> bool:
        """Whether the step about to finish ends with an average."""
        return (self.steps + 1) % self.every == 0

    @torch.no_grad()
    def after_step(self) -> bool:
        """Count one optimizer step; on every K-th, average the parameters (collective). Returns
        whether it averaged."""
        due = self.due()
        self.steps += 1
        if not due or self.comm.size == 1:
            return due
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.comm.all_reduce(flat, tag="params")
        flat.div_(self.comm.size)
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return True
