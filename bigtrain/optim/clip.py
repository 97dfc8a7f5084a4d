"""Global gradient-norm clipping over gradients that are sharded, partitioned and replicated.

Where each gradient lives is the placement record's business (:mod:`bigtrain.parallel.placement`):
every rank adds the squared norm of each part it holds that the record counts here (one copy of
replicated values, every shard and ZeRO range, every pipeline stage's weights), and one all-reduce
over every rank sums them. One rule for any placement, so an expert sharded over ``ep`` or a
table sharded over its group needs no code of its own here.

Everything stays on the gradients' device until one host transfer: the per-tensor squared norms,
their sum, the overflow flag and the collective over them (NCCL takes device tensors only), then
a single ``tolist()`` in :func:`global_norm` brings the norm and the flag to the host, where the
engine decides whether to skip the step (fp16) and how much to clip. That is the step's one host
synchronization before the update.
"""

from __future__ import annotations

from typing import Iterable

import torch

from bigtrain.distributed.comm import AxisComm


def square_sums(grads: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """[sum of squares of ``grads``, overflow flag] on ``device`` (the gradients' device; also
    where an empty list of gradients puts its zeros)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total = total + torch.linalg.vector_norm(g, dtype=torch.float32).pow(2)
    return torch.stack([total, (~torch.isfinite(total)).float()])


def global_norm(parts: torch.Tensor, summed_over: AxisComm | None = None) -> tuple[float, bool]:
    """(global L2 norm, overflow anywhere) from :func:`square_sums`, summed over ``summed_over``
    (every rank, each having counted only its own parts). One host sync."""
    if summed_over is not None:
        summed_over.all_reduce(parts, tag="grad_norm")
    return norm_of(parts)


def norm_of(summed: torch.Tensor) -> tuple[float, bool]:
    """(L2 norm, overflow) of :func:`square_sums` already summed over every rank (the half of
    :func:`global_norm` after its collective, for a caller that posted the collective itself)."""
    norm, flag = torch.stack([summed[0].sqrt(), summed[1]]).tolist()
    return norm, flag > 0


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that a global norm of ``norm`` becomes at most ``max_norm``."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))

