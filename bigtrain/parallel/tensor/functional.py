"""The differentiable collectives of tensor and sequence parallelism (each paired with its dual).

Megatron's f and g: ``copy_to_group`` (forward identity, backward all-reduce) enters a
column-parallel region; ``reduce_from_group`` (forward all-reduce, backward identity) leaves a
row-parallel one. With sequence parallelism they become ``gather_sequence`` (all-gather along the
sequence, backward reduce-scatter) and ``scatter_sequence_sum`` (reduce-scatter, backward
all-gather): the same bytes, but activations between them stay sequence-sharded. Ulysses moves
between sequence shards and head shards with one all-to-all each way.

All traffic goes through :class:`AxisComm`, so it is counted per axis and collective. Each public
function runs eagerly under ``torch.compile`` (:mod:`bigtrain.parallel.eager`): a compiled block's graph
breaks around its collectives (Python-side communication the compiler does not trace), and the
pieces between them compile (``bigtrain/parallel/compile.py``).
"""

from __future__ import annotations

import torch

from bigtrain.distributed.comm import AxisComm
from bigtrain.parallel.eager import eager_under_compile


def _all_reduce(x: torch.Tensor, comm: AxisComm, tag: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, tag=tag)
    return out


def gather_along(x: torch.Tensor, comm: AxisComm, dim: int, tag: str) -> torch.Tensor:
    """Concatenate equal shards of every rank along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((comm.size * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather(out, moved, tag=tag)
    # Contiguous, so the column-parallel layers that read it all save this one tensor for backward
    # (a strided view would be copied, and saved, by each of them).
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, comm: AxisComm, dim: int, tag: str) -> torch.Tensor:
    """Sum over ranks and keep this rank's equal slice along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % comm.size:
        raise ValueError(f"dimension {dim} of size {moved.shape[0]} does not divide by {comm.size} ranks")
    out = torch.empty((moved.shape[0] // comm.size,) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, moved, tag=tag)
    return out.movedim(0, dim)


def local_chunk(x: torch.Tensor, comm: AxisComm, dim: int) -> torch.Tensor:
    """This rank's equal slice of a replicated tensor, a copy: a slice that happens to be contiguous
    (the sequence of a single sample) would otherwise be a view keeping the whole tensor alive
    wherever autograd saves it (split_sequence's output, the first block's input under SP)."""
    return x.chunk(comm.size, dim=dim)[comm.rank].clone(memory_format=torch.contiguous_format)


class _Dual(torch.autograd.Function):
    """A collective in forward and its dual in backward, given as two functions of a tensor."""

    @staticmethod
    def forward(ctx, x, forward_fn, backward_fn):
        ctx.backward_fn = backward_fn
        return forward_fn(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad), None, None


def _all_to_all(x: torch.Tensor, comm: AxisComm, split_dim: int, cat_dim: int) -> torch.Tensor:
    n = comm.size
    chunks = x.chunk(n, dim=split_dim)
    send = torch.stack(chunks).contiguous()  # (n, ...) with chunk i going to rank i
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, tag="ulysses")
    return torch.cat(recv.unbind(0), dim=cat_dim)


@eager_under_compile
def copy_to_group(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Enter a column-parallel region: identity forward, all-reduce of the gradient."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: t.view_as(t), lambda g: _all_reduce(g, comm, "tp"))


@eager_under_compile
def reduce_from_group(x: torch.Tensor, comm: AxisComm, tag: str = "tp") -> torch.Tensor:
    """Leave a row-parallel region: all-reduce forward, identity backward."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: _all_reduce(t, comm, tag), lambda g: g)


@eager_under_compile
def gather_sequence(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    """Sequence shards -> whole sequence; the gradient is reduce-scattered back to shards."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: gather_along(t, comm, dim, "sp"), lambda g: _reduce_scatter(g, comm, dim, "sp"))


@eager_under_compile
def scatter_sequence_sum(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    """Partial sums of the whole sequence -> summed sequence shards; the gradient is all-gathered."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: _reduce_scatter(t, comm, dim, "sp"), lambda g: gather_along(g, comm, dim, "sp"))


@eager_under_compile
def gather_sequence_replicated(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    """Sequence shards -> the whole sequence, for a module every rank then runs alike on it (an
    MoE block under sequence parallelism): its input gradient is the same on every rank, so
    backward keeps this rank's shard of it instead of summing ranks' parts."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: gather_along(t, comm, dim, "sp"), lambda g: local_chunk(g, comm, dim))


@eager_under_compile
def split_sequence(x: torch.Tensor, comm: AxisComm, dim: int = 1) -> torch.Tensor:
    """The whole sequence, the same on every rank -> this rank's shard; the gradient is all-gathered,
    so every rank goes on backward through the whole sequence alike (the dual of the above)."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: local_chunk(t, comm, dim), lambda g: gather_along(g, comm, dim, "sp"))


@eager_under_compile
def all_to_all(x: torch.Tensor, comm: AxisComm, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Split ``split_dim`` across ranks and concatenate ``cat_dim`` from them (Ulysses); the
    gradient makes the opposite move."""
    if comm.size == 1:
        return x
    return _Dual.apply(x, lambda t: _all_to_all(t, comm, split_dim, cat_dim),
                       lambda g: _all_to_all(g, comm, cat_dim, split_dim))
