"""Data parallelism: bucketed gradient all-reduce overlapped with backward.

Each parameter's ``.grad`` is a view into a flat bucket buffer, so autograd accumulates straight
into the buffers and a bucket is all-reduced without copying. Buckets hold parameters in reverse
registration order, which is roughly the order backward produces their gradients, so the first
bucket is ready early and its all-reduce runs on Gloo's/NCCL's own thread while backward continues.
On accumulation steps that do not synchronize, the hooks only re-home a gradient that was created
outside its bucket (after a caller's ``zero_grad(set_to_none=True)``), so any way of clearing
gradients stays correct. At construction every replica takes dp rank 0's parameters and buffers,
as torch DDP does, so replicas never start apart.

The loss is expected to be normalized by the *global* token count, so gradients are summed, not
averaged, across ranks: the sum over ranks and micro-batches is then exactly the single-process
gradient of the mean loss.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.parallel.grad_hooks import on_grad_ready

if TYPE_CHECKING:
    from bigtrain.parallel.placement import Placements


def _first_rank(comm: AxisComm) -> int:
    return dist.get_global_rank(comm.group, 0) if comm.group is not None else 0


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    comm: AxisComm  # the group that reduces these gradients (one per bucket)
    pending: int = 0
    work: object = None
    views: list[torch.Tensor] = field(default_factory=list)


@contextmanager
def sync_off(engine):
    """Clear ``engine._sync`` for the block (gradient engines skip reduction while it is False)."""
    previous, engine._sync = engine._sync, False
    try:
        yield
    finally:
        engine._sync = previous


def rehome_grad(param: nn.Parameter, home: torch.Tensor) -> None:
    """Make ``param.grad`` its view ``home`` in a flat gradient buffer again, keeping its value.

    After a caller's ``zero_grad(set_to_none=True)`` autograd puts the next gradient in a fresh
    tensor outside the buffer, where a reduction of the buffer would never see it; a parameter
    that got no gradient since then must contribute zeros, not what the buffer held before.
    """
    if param.grad is None:
        home.zero_()
    elif param.grad.data_ptr() != home.data_ptr():
        home.copy_(param.grad)
    param.grad = home


def _unique_trainable(model: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int, group_of=lambda p: None) -> list[list[nn.Parameter]]:
    """Group parameters (in reverse order) into buckets of about ``bucket_bytes`` each; a bucket
    holds parameters of one ``group_of(param)`` only (they are reduced by one collective)."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or group_of(p) != group_of(buckets[-1][0])):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


class DataParallel:
    """Synchronizes the gradients of ``model`` over ``comm`` (the mesh's dp axis), or, with
    ``placements``, each over the group the placement record names for it (experts over edp,
    dense weights over dp x sp; a gradient with no data-parallel axis is left alone).
    ``reduce=False`` keeps the flat buffers and the common start but reduces nothing (local SGD)."""

    def __init__(self, model: nn.Module, comm: AxisComm, bucket_mb: float = 25.0,
                 placements: "Placements | None" = None, reduce: bool = True):
        self.model, self.comm = model, comm
        self.params = _unique_trainable(model)
        if placements is None:
            self._comm_of = {id(p): comm for p in self.params}
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            hybrid = [names[id(p)] for p in self.params if placements[names[id(p)]].replica_axes]
            if hybrid:  # reducing over the ZeRO group alone would leave the replicas apart, silently
                raise ValueError(f"the replicated engine (parallel.zero = 0) reduces each gradient over one group, "
                                 f"and {hybrid[0]} is placed for hybrid sharding (parallel.dp_replicate > 1); use "
                                 f"parallel.zero = 1, 2 or 3, or parallel.dp alone")
            self._comm_of = {id(p): placements.grad_comm(names[id(p)]) for p in self.params}
        groups = plan_buckets(self.params, int(bucket_mb * 2**20), lambda p: id(self._comm_of[id(p)]))
        self.buckets = [self._make_bucket(group) for group in groups]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._view_of = {id(p): v for b in self.buckets for p, v in zip(b.params, b.views)}
        self._sync = True
        self._handles = []
        replicated = any(b.comm.size > 1 for b in self.buckets)
        self._reduces = reduce and replicated  # reduce=False: replicas keep their own gradients (local SGD)
        if replicated:
            self._broadcast_from_first_rank()
        if self._reduces:
            self._handles = on_grad_ready(self.params, self._on_grad_ready)

    def _make_bucket(self, params: list[nn.Parameter]) -> Bucket:
        dtype, device = params[0].dtype, params[0].device
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        bucket = Bucket(params=params, buffer=buffer, comm=self._comm_of[id(params[0])], pending=len(params))
        offset = 0
        for p in params:
            bucket.views.append(buffer[offset:offset + p.numel()].view_as(p))
            p.grad = bucket.views[-1]
            offset += p.numel()
        return bucket

    @torch.no_grad()
    def _broadcast_from_first_rank(self) -> None:
        """Start every replica from dp rank 0's weights and buffers, as torch DDP does: ranks that
        initialized with different seeds would otherwise train different models, silently."""
        for bucket in self.buckets:  # one message per bucket, packed in its (still zero) gradient buffer
            if bucket.comm.size == 1:
                continue
            for p, view in zip(bucket.params, bucket.views):
                view.copy_(p)
            bucket.comm.broadcast(bucket.buffer, _first_rank(bucket.comm), tag="init")
            for p, view in zip(bucket.params, bucket.views):
                p.copy_(view)
            bucket.buffer.zero_()
        if self.comm.size == 1:
            return
        trainable = {id(p) for p in self.params}
        frozen = [p for p in self.model.parameters() if id(p) not in trainable]
        for tensor in frozen + list(self.model.buffers()):
            self.comm.broadcast(tensor, _first_rank(self.comm), tag="init")

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        rehome_grad(param, self._view_of[id(param)])
        if not self._sync:
            return
        bucket = self._bucket_of[id(param)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        # On CUDA this runs on NCCL's stream, after the work already queued on the compute stream
        # (the bucket's gradients). The buffer lives as long as the bucket, so no allocator reuse
        # can race the collective; nothing writes it until finish_grad_sync has waited (every
        # gradient of the bucket has arrived, and the next writes are the next step's).
        bucket.work = bucket.comm.all_reduce(bucket.buffer, async_op=True, tag="grads")

    def no_sync(self):
        """Accumulate gradients locally (non-final micro-batches)."""
        return sync_off(self)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's all-reduce; launches buckets whose parameters got no gradient."""
        if not self._reduces:
            return
        for bucket in self.buckets:  # same order on every rank
            if bucket.work is None:
                for p, view in zip(bucket.params, bucket.views):
                    rehome_grad(p, view)  # no gradient this step contributes zeros
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # NCCL: the current stream waits; clipping and AdamW read reduced grads
            bucket.work, bucket.pending = None, len(bucket.params)

    def zero_grad(self) -> None:
        """Zero the buckets in place (the grads stay views of them)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def grad_comm(self, param: nn.Parameter) -> AxisComm:
        return self._comm_of[id(param)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
