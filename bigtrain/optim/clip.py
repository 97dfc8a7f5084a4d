"""Global gradient-norm clipping when gradients are partitioned (ZeRO) or sharded (tensor parallel).

Everything stays on the gradients' device until one host transfer: the per-tensor squared norms,
their sums, the overflow flag and the collectives over them (NCCL takes device tensors only), then
a single ``tolist()`` in :func:`global_norm` brings the norm and the flag to the host, where the
engine decides whether to skip the step (fp16) and how much to clip. That is the step's one host
synchronization before the update.
"""

from __future__ import annotations

from typing import Iterable

import torch

from bigtrain.distributed.comm import AxisComm


def square_sums(grads: Iterable[tuple[torch.Tensor, bool]], device: torch.device | str) -> torch.Tensor:
    """[sum of squares of tp-sharded grads, of tp-replicated grads, overflow flag] of local tensors,
    on ``device`` (the gradients' device; also where an empty list of gradients puts its zeros);
    ``grads`` yields (tensor, is_replicated_over_tp)."""
    sums = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(2)]  # [sharded, replicated]
    for g, is_replicated in grads:
        sums[is_replicated] = sums[is_replicated] + torch.linalg.vector_norm(g, dtype=torch.float32).pow(2)
    sharded, replicated = sums
    total = sharded + replicated
    return torch.stack([sharded, replicated, (~torch.isfinite(total)).float()])


def global_norm(parts: torch.Tensor, partitioned_over: Iterable[AxisComm] = (), tp: AxisComm | None = None
                ) -> tuple[float, bool]:
    """(global L2 norm, overflow anywhere) from :func:`square_sums`. ``partitioned_over``: axes
    whose ranks hold disjoint parts of every gradient (ZeRO's dp); ``tp``: the axis over which the
    sharded part is split while the replicated part is the same on every rank. One host sync."""
    for comm in partitioned_over:
        comm.all_reduce(parts, tag="grad_norm")
    if tp is not None and tp.size > 1:
        tp_parts = parts[0::2].clone()  # [sharded, flag]: a strided view, no index tensor from the host
        tp.all_reduce(tp_parts, tag="grad_norm")
        parts = torch.stack([tp_parts[0], parts[1], tp_parts[1]])
    norm, flag = torch.stack([(parts[0] + parts[1]).sqrt(), parts[2]]).tolist()
    return norm, flag > 0


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so that a global norm of ``norm`` becomes at most ``max_norm``."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))


def clip_grad_norm(grads: Iterable[torch.Tensor], max_norm: float, shard_comms: Iterable[AxisComm] = ()) -> float:
    """Clip replicated-or-partitioned ``grads`` to ``max_norm``; returns the norm before clipping."""
    grads = [g for g in grads if g is not None]
    device = grads[0].device if grads else torch.device("cpu")
    norm, _ = global_norm(square_sums(((g, False) for g in grads), device), shard_comms)
    clip_(grads, norm, max_norm)
    return norm
