"""The differentiable collectives of tensor and sequence parallelism (each paired with its dual).

Megatron's f and g: ``copy_to_group`` (forward identity, backward all-reduce) enters a
column-parallel region; ``reduce_from_group`` (forward all-reduce, backward identity) leaves a
row-parallel one. With sequence parallelism they become ``gather_sequence`` (all-gather along the
sequence, backward reduce-scatter) and ``scatter_sequence_sum`` (reduce-scatter, backward
all-gather): the same bytes, but activations between them stay sequence-sharded. Ulysses moves
between sequence shards and head shards with one all-to-all each way.

All traffic goes through :class:`AxisComm`, so it is counted per axis and collective.
"""

from __future__ import annotations

import torch

from bigtrain.distributed.comm import AxisComm


def _all_reduce(x: torch.Tensor, comm: AxisComm, tag: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, tag=tag)
    return out


def _all_gather(x: torch.Tensor, comm: AxisComm, dim: int, tag: str) -> torch.Tensor:
    """Concatenate equal shards of every rank along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((comm.size * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather(out, moved, tag=tag)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, comm: AxisComm, dim: int, tag: str) -> torch.Tensor:
    """Sum over ranks and keep this rank's equal slice along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % comm.size:
        raise ValueError(f"dimension {dim} of size {moved.shape[0]} does not divide by {comm.size} ranks")
    out = torch.empty((moved.shape[0] // comm.size,) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, moved, tag=tag)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, comm: AxisComm, dim: int) -> torch.Tensor:
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm, "tp"), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm, "tp")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, "sp")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm, ctx.dim, "sp"), None, None


class _ScatterSequenceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim, "sp")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim, "sp"), None, None


class _SplitSequence(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor; backward gathers the slices."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _split(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim, "sp"), None, None


class _AllToAll(torch.autograd.Function):
    """Split ``split_dim`` across ranks and concatenate ``cat_dim`` from them (Ulysses)."""

    @staticmethod
    def forward(ctx, x, comm, split_dim, cat_dim):
        ctx.comm, ctx.split_dim, ctx.cat_dim = comm, split_dim, cat_dim
        return _all_to_all(x, comm, split_dim, cat_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.comm, ctx.cat_dim, ctx.split_dim), None, None, None


def _all_to_all(x: torch.Tensor, comm: AxisComm, split_dim: int, cat_dim: int) -> torch.Tensor:
    n = comm.size
    chunks = x.chunk(n, dim=split_dim)
    send = torch.stack(chunks).contiguous()  # (n, ...) with chunk i going to rank i
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, tag="ulysses")
    return torch.cat(recv.unbind(0), dim=cat_dim)


def copy_to_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    return x if comm.size == 1 else _CopyToGroup.apply(x, comm)


def reduce_from_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceFromGroup.apply(x, comm)


def gather_sequence(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    return x if comm.size == 1 else _GatherSequence.apply(x, comm, dim)


def scatter_sequence_sum(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    return x if comm.size == 1 else _ScatterSequenceSum.apply(x, comm, dim)


def split_sequence(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    return x if comm.size == 1 else _SplitSequence.apply(x, comm, dim)


def all_to_all(x: torch.Tensor, comm: AxisComm, split_dim: int, cat_dim: int) -> torch.Tensor:
    return x if comm.size == 1 else _AllToAll.apply(x, comm, split_dim, cat_dim)
