"""A linear layer whose forward leaves its bias out: what row parallelism puts in place of a biased
``nn.Linear`` (bigtrain/parallel/tensor/styles.py's ``RowParallel`` adds the bias once, after the
tensor-parallel sum). Here, below both the parallel plans and the memory transforms, because int8
compression (bigtrain/memory/compression.py) must know the type too: it leaves the bias to the style."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Linear):
    """A linear layer whose forward leaves its bias out: under row parallelism each rank computes a
    partial sum, and the bias belongs to the whole sum, added once after the reduction (by the
    :class:`RowParallel` style's hook). Same parameters and names as the ``nn.Linear`` it replaces.
    int8 compression's wrapper (memory/compression.py) reads this type to leave the bias out too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @classmethod
    def replacing(cls, linear: nn.Linear) -> "RowParallelLinear":
        check_unhooked(linear)
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameter objects
        new.train(linear.training)
        return new


def check_unhooked(linear: nn.Linear) -> None:
    """A layer is replaced by its row-parallel form before any other style hooks it (a hook on the
    old module would be lost)."""
    if linear._forward_hooks or linear._forward_pre_hooks:
        raise ValueError("RowParallel with a bias must be the first style applied to its layer")
