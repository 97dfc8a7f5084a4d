"""Collectives over one mesh axis, with byte accounting.

Every collective goes through :class:`AxisComm`, which records the payload it was handed per
axis and operation in a :class:`CommStats`. The bytes a rank *sends* follow from the payload and
the group size by the bandwidth-optimal algorithms' volumes (ring all-reduce sends 2(N-1)/N of the
buffer, all-gather and reduce-scatter (N-1)/N of the full buffer, all-to-all (N-1)/N of its
input), which is what the theory in the ZeRO and Megatron papers counts. Keeping the payload and
deriving the volume keeps the counts exact integers until the end.
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import torch
import torch.distributed as dist


def sent_fraction(op: str, n: int) -> Fraction:
    """Bytes a rank sends per payload byte for ``op`` on a group of ``n`` ranks."""
    base = op.split(":", 1)[0]
    if n <= 1:
        return Fraction(0)
    if base == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if base in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction(n - 1, n)
    return Fraction(1)  # broadcast, send


class CommStats:
    """Payload bytes and call counts per (axis, op); not shared between meshes."""

    def __init__(self) -> None:
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.group_size: dict[str, int] = {}

    def record(self, axis: str, op: str, nbytes: int, group_size: int) -> None:
        self.payload[(axis, op)] += nbytes
        self.calls[(axis, op)] += 1
        self.group_size[axis] = group_size

    def sent_bytes(self, axis: str | None = None, op: str | None = None) -> float:
        """Bytes this rank sent, summed over the matching axis and op (prefix match on op)."""
        total = Fraction(0)
        for (a, o), payload in self.payload.items():
            if (axis is None or a == axis) and (op is None or o == op or o.split(":")[0] == op):
                total += payload * sent_fraction(o, self.group_size[a])
        return float(total)

    def by_axis(self) -> dict[str, float]:
        return {axis: self.sent_bytes(axis) for axis in sorted({a for a, _ in self.payload})}

    def by_op(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for (axis, op) in sorted(self.payload):
            out.setdefault(axis, {})[op] = self.sent_bytes(axis, op)
        return out

    def snapshot(self) -> "CommStats":
        copy = CommStats()
        copy.payload.update(self.payload)
        copy.calls.update(self.calls)
        copy.group_size.update(self.group_size)
        return copy

    def since(self, earlier: "CommStats") -> "CommStats":
        """The traffic recorded after ``earlier`` (a snapshot of this object) was taken."""
        delta = CommStats()
        delta.group_size.update(self.group_size)
        for key, value in self.payload.items():
            if value - earlier.payload.get(key, 0):
                delta.payload[key] = value - earlier.payload.get(key, 0)
                delta.calls[key] = self.calls[key] - earlier.calls.get(key, 0)
        return delta

    def reset(self) -> None:
        self.payload.clear()
        self.calls.clear()


# torch 2.13 deprecates the *_tensor names in favour of *_single; older releases have only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class AxisComm:
    """The collectives of one mesh axis (``group`` None with size 1 makes every op a no-op)."""

    def __init__(self, axis: str, group: dist.ProcessGroup | None, size: int, rank: int, stats: CommStats):
        self.axis, self.group, self.size, self.rank, self.stats = axis, group, size, rank, stats

    def _record(self, op: str, nbytes: int, tag: str | None) -> None:
        self.stats.record(self.axis, op if tag is None else f"{op}:{tag}", nbytes, self.size)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False, tag: str | None = None):
        """In place; returns a work handle when ``async_op`` (None when there is nothing to do)."""
        if self.size == 1:
            return None
        self._record("all_reduce", _nbytes(tensor), tag)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, tag: str | None = None):
        """Concatenate equal shards into ``output`` (size x shard); Gloo needs equal sizes: pad first."""
        if self.size == 1:
            output.copy_(shard.view_as(output))
            return None
        self._record("all_gather", _nbytes(output), tag)
        return _all_gather_single(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, op=dist.ReduceOp.SUM,
                       async_op: bool = False, tag: str | None = None):
        """Reduce ``full`` over the group and keep this rank's equal slice in ``shard``."""
        if self.size == 1:
            shard.copy_(full.view_as(shard))
            return None
        self._record("reduce_scatter", _nbytes(full), tag)
        return _reduce_scatter_single(shard, full, op=op, group=self.group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str | None = None):
        if self.size == 1:
            output.copy_(input)
            return None
        self._record("all_to_all", _nbytes(input), tag)
        return dist.all_to_all_single(output, input, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_global_rank: int, tag: str | None = None) -> None:
        if self.size == 1:
            return
        self._record("broadcast", _nbytes(tensor), tag)
        dist.broadcast(tensor, src=src_global_rank, group=self.group)

    # -- point to point (pipeline stages) --------------------------------------------------------
    # ``peer`` is a rank index along this axis (a pp-rank), not a global rank. Only sends are
    # recorded, under op "send": the receiver's bytes are its peer's sends.
    def _global_peer(self, peer: int) -> int:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"peer {peer} along axis {self.axis!r} must be another of its {self.size} ranks "
                             f"(this rank is {self.rank})")
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def send_op(self, tensor: torch.Tensor, peer: int, tag: str | None = None) -> dist.P2POp:
        """A send of ``tensor`` to ``peer`` for :meth:`batch_isend_irecv`; keep ``tensor`` alive and
        unmodified until its work completes. A strided view (a sequence shard under Megatron
        sequence parallelism) is sent as a contiguous copy, which the op keeps alive."""
        self._record("send", _nbytes(tensor), tag)
        return dist.P2POp(dist.isend, tensor.contiguous(), self._global_peer(peer), group=self.group)

    def recv_op(self, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        """A receive from ``peer`` into ``tensor`` for :meth:`batch_isend_irecv`."""
        return dist.P2POp(dist.irecv, tensor, self._global_peer(peer), group=self.group)

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list:
        """Post ``ops`` at once (coalesced where the backend can); returns one work per op. Transfers
        between two ranks match in the order both post them."""
        return dist.batch_isend_irecv(ops) if ops else []

    def send(self, tensor: torch.Tensor, peer: int, tag: str | None = None) -> None:
        """Blocking send (small, rare messages such as shapes)."""
        self._record("send", _nbytes(tensor), tag)
        dist.send(tensor, self._global_peer(peer), group=self.group)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Blocking receive into ``tensor``."""
        dist.recv(tensor, self._global_peer(peer), group=self.group)

    def gather_objects(self, obj):
        """Every rank's ``obj`` as a list on the axis's first rank (None elsewhere); not counted:
        it is for checkpoints and timelines, not for training traffic."""
        if self.size == 1:
            return [obj]
        ranks = dist.get_process_group_ranks(self.group)
        out = [None] * self.size if dist.get_rank() == ranks[0] else None
        dist.gather_object(obj, out, dst=ranks[0], group=self.group)
        return out

    def max(self, tensor: torch.Tensor, tag: str | None = "metrics") -> torch.Tensor:
        """Element-wise max over the axis, in place (for worst-rank metrics)."""
        self.all_reduce(tensor, op=dist.ReduceOp.MAX, tag=tag)
        return tensor
