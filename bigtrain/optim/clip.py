"""Global gradient-norm clipping that also works when gradients are sharded."""

from __future__ import annotations

from typing import Iterable

import torch

from bigtrain.distributed.comm import AxisComm


def clip_grad_norm(grads: Iterable[torch.Tensor], max_norm: float, shard_comms: Iterable[AxisComm] = ()) -> float:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``; return the norm
    before clipping. ``shard_comms`` are the axes over which the gradients are *partitioned*
    (their squared norms are summed there); replicated axes must not be listed."""
    grads = [g for g in grads if g is not None]
    if grads:
        square_sum = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]).sum()
    else:
        square_sum = torch.zeros((), dtype=torch.float32)
    for comm in shard_comms:
        comm.all_reduce(square_sum, tag="grad_norm")
    norm = float(square_sum.sqrt())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm
