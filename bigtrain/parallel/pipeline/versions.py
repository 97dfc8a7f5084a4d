"""Weight versions of the asynchronous pipelines: which weights each micro-batch runs with.

Without a flush, a micro-batch's forward and backward straddle optimizer updates, so each runs
with a *version* of its stage's weights kept apart from the live parameters (which the optimizer
updates in place). A version is a set of separate tensors, cloned from the live parameters at the
start of a step; nothing ever writes into it, so autograd's saved-tensor checks hold and no
``param.data`` is swapped. The stage runs through ``torch.func.functional_call`` with each weight
replaced by :func:`stashed`: the forward computes with the version's tensor and the backward adds
the gradient to the live parameter's ``.grad`` (its hooks, e.g. data parallel's, fire as usual).

Which version a micro-batch uses (versions are numbered by the updates they have seen):

* ``pipedream-2bw``: a micro-batch of step s runs with version s - 1 (version 0 for step 0), the
  update after step s is applied to version s: W(s+1) = W(s) - lr * grad(W(s-1)). At most two
  versions are held: s - 1 for the step finishing and s for the next step's early forwards.
* ``pipedream`` (an update per micro-batch): micro-batch k runs with the newest version when its
  forward starts on the stage (k - (p - 1 - r) on pipeline rank r), or, with vertical sync, with
  version k - (p - 1) on every stage (the one the first stage used). One version per micro-batch
  in flight: p - r on rank r, p with vertical sync.
"""

from __future__ import annotations

import torch
from torch import nn


class _Stashed(torch.autograd.Function):
    """Forward: the stashed tensor. Backward: the gradient goes to the live parameter."""

    @staticmethod
    def forward(ctx, live: torch.Tensor, version: torch.Tensor) -> torch.Tensor:
        return version.view_as(version)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def stashed(live: nn.Parameter, version: torch.Tensor) -> torch.Tensor:
    """``version``'s values, with gradients flowing into ``live``."""
    return _Stashed.apply(live, version)


def version_of(kind: str, microbatch: int, m: int, p: int, rank: int, vertical_sync: bool, newest: int) -> int:
    """The weight version micro-batch ``microbatch`` (counted from the first step) runs with on
    pipeline rank ``rank``; ``newest``: the newest version when its forward starts there."""
    if kind == "pipedream-2bw":
        return max(microbatch // m - 1, 0)
    if vertical_sync:
        return max(microbatch - (p - 1), 0)
    return newest


class WeightVersions:
    """The versions of one stage's weights that micro-batches in flight (or soon) run with."""

    def __init__(self, stage: nn.Module):
        self.stage = stage
        self.live = dict(stage.named_parameters())  # de-duplicated: a tied weight once
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.peak = 0  # the most versions held at once
        self.peak_bytes = 0

    @torch.no_grad()
    def snapshot(self, version: int) -> None:
        """Keep the live weights, which have seen ``version`` updates, as ``version``."""
        if version not in self.versions:
            self.versions[version] = {n: p.detach().clone() for n, p in self.live.items()}
        self.peak = max(self.peak, len(self.versions))
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """``functional_call``'s parameters for a forward with ``version``."""
        if version not in self.versions:
            raise RuntimeError(f"weight version {version} is not held (held: {sorted(self.versions)})")
        values = self.versions[version]
        return {n: stashed(p, values[n]) for n, p in self.live.items()}

    def release_below(self, version: int) -> None:
        """Drop the versions no micro-batch will run with again."""
        for old in [v for v in self.versions if v < version]:
            del self.versions[old]

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for values in self.versions.values() for t in values.values())
