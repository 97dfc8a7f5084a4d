"""Global gradient-norm clipping when gradients are partitioned (ZeRO) or sharded (tensor parallel)."""

from __future__ import annotations

from typing import Iterable

import torch

from bigtrain.distributed.comm import AxisComm


def square_sums(grads: Iterable[tuple[torch.Tensor, bool]]) -> torch.Tensor:
    """[sum of squares of tp-sharded grads, of tp-replicated grads, overflow flag] of local tensors;
    ``grads`` yields (tensor, is_replicated_over_tp)."""
    sharded, replicated = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)
    for g, is_replicated in grads:
        sq = torch.linalg.vector_norm(g, dtype=torch.float32).pow(2)
        if is_replicated:
            replicated = replicated + sq
        else:
            sharded = sharded + sq
    total = sharded + replicated
    return torch.stack([sharded, replicated, (~torch.isfinite(total)).float()])


def global_norm(parts: torch.Tensor, partitioned_over: Iterable[AxisComm] = (), tp: AxisComm | None = None
                ) -> tuple[float, bool]:
    """(global L2 norm, overflow anywhere) from :func:`square_sums`. ``partitioned_over``: axes
    whose ranks hold disjoint parts of every gradient (ZeRO's dp); ``tp``: the axis over which the
    sharded part is split while the replicated part is the same on every rank."""
    for comm in partitioned_over:
        comm.all_reduce(parts, tag="grad_norm")
    if tp is not None and tp.size > 1:
        tp_parts = parts[[0, 2]].clone()
        tp.all_reduce(tp_parts, tag="grad_norm")
        parts = torch.stack([tp_parts[0], parts[1], tp_parts[1]])
    return float((parts[0] + parts[1]).sqrt()), bool(parts[2] > 0)


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that a global norm of ``norm`` becomes at most ``max_norm``."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))


def clip_grad_norm(grads: Iterable[torch.Tensor], max_norm: float, shard_comms: Iterable[AxisComm] = ()) -> float:
    """Clip replicated-or-partitioned ``grads`` to ``max_norm``; returns the norm before clipping."""
    grads = [g for g in grads if g is not None]
    norm, _ = global_norm(square_sums((g, False) for g in grads), shard_comms)
    clip_(grads, norm, max_norm)
    return norm
