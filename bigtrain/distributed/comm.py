"""Collectives over one mesh axis, with byte accounting.

Every collective goes through :class:`AxisComm`, which records the payload it was handed per
axis and operation in a :class:`CommStats`. The bytes a rank *sends* follow from the payload and
the group size by the bandwidth-optimal algorithms' volumes (ring all-reduce sends 2(N-1)/N of the
buffer, all-gather and reduce-scatter (N-1)/N of the full buffer, all-to-all (N-1)/N of its
input), which is what the theory in the ZeRO and Megatron papers counts. Keeping the payload and
deriving the volume keeps the counts exact integers until the end.

Every collective also runs under a guard: a failure inside it (a Gloo timeout when a peer froze,
a broken connection when one died) is re-raised as a :class:`CollectiveError` that names this
rank, the collective, its axis, tag, payload and group, and the last few collectives this rank
completed (``CommStats.recent``), so that comparing the ranks' reports shows the odd one out.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
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


RECENT = 8  # completed collectives each rank remembers for its failure report


@dataclass(frozen=True)
class Collective:
    """One collective as a failure report names it."""

    op: str
    axis: str
    tag: str | None
    nbytes: int

    def __str__(self) -> str:
        tag = f" tag '{self.tag}'" if self.tag else ""
        return f"{self.op} on axis '{self.axis}'{tag} ({_readable(self.nbytes)})"


def _readable(nbytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


class CollectiveError(RuntimeError):
    """A collective failed (a timeout when a peer froze, a closed connection when one died).

    ``rank`` is the global rank that reports, ``collective`` what it was in, ``group`` the global
    ranks of its group, ``recent`` what it completed before (oldest first), ``cause`` the
    backend's own message; ``step`` is filled in by whoever knows it (the training loop)."""

    def __init__(self, rank: int, collective: Collective, group: list[int], elapsed_s: float,
                 recent: list[Collective], cause: BaseException):
        self.rank, self.collective, self.group, self.elapsed_s = rank, collective, group, elapsed_s
        self.recent, self.cause, self.step = recent, cause, None
        super().__init__(self.describe())

    def describe(self) -> str:
        where = f"rank {self.rank}" + (f" at step {self.step}" if self.step is not None else "")
        cause = " ".join(str(self.cause).split()) or type(self.cause).__name__
        timed_out = "timed out" in cause.lower() or "timeout" in cause.lower()
        lines = [f"{where}: {self.collective} {'timed out' if timed_out else 'failed'} after "
                 f"{self.elapsed_s:.1f} s in the group of ranks {self.group}: {cause}"]
        if timed_out:
            lines.append(f"  another rank of {self.group} did not take part: it stopped (frozen, killed, out of "
                         f"memory) or waits in another collective; the rank whose report is missing, or names "
                         f"another collective, is the odd one out (distributed.timeout_s sets the wait)")
        if self.recent:
            lines.append(f"  last {len(self.recent)} collectives rank {self.rank} completed (oldest first):")
            lines += [f"    {c}" for c in self.recent]
        else:
            lines.append(f"  rank {self.rank} had completed no collective before this one")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def __reduce__(self):  # survives pickling (a rank's report sent to a parent process)
        args = (self.rank, self.collective, self.group, self.elapsed_s, self.recent, RuntimeError(str(self.cause)))
        return _rebuild_collective_error, (args, self.step)


def _rebuild_collective_error(args: tuple, step: int | None) -> CollectiveError:
    error = CollectiveError(*args)
    error.step = step
    return error


def world_timeout() -> timedelta | None:
    """The default group's timeout, for groups made after it (``new_group`` alone would give them
    torch's 30-minute default whatever ``init_process_group`` was told); None when unknown."""
    if not dist.is_initialized():
        return None
    for device in ("cpu", "cuda"):  # Gloo serves the CPU; an NCCL-only group has only a CUDA backend
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


class CommStats:
    """Payload bytes and call counts per (axis, op); not shared between meshes."""

    def __init__(self) -> None:
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.group_size: dict[str, int] = {}
        self.recent: deque[Collective] = deque(maxlen=RECENT)  # completed, newest last

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


# torch 2.13 deprecates the *_tensor names in favour of *_single; older releases have only the former
# (the calibration calls these too, outside a Comm).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# The shape announcements of pipeline transfers (8 int64, 64 bytes): the smallest point-to-point
# message. On one channel with the tensors, an announcement matched out of order to a tensor's
# receive would fill the head of its buffer silently (Gloo accepts a message smaller than the
# receive), and a tensor matched to an announcement's receive would abort the process; on a channel
# of its own, an order broken anywhere leaves both waiting, and the timeout names the transfer.
WIRE_TAGS = {"meta": 1}


def _wire_tag(tag: str | None) -> int:
    return WIRE_TAGS.get(tag, 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _TrackedWork:
    """A work handle whose ``wait`` names the collective on failure and records it on success."""

    def __init__(self, work, comm: "AxisComm", collective: Collective, started: float):
        self._work, self._comm, self._collective, self._started = work, comm, collective, started
        self._done = False

    def wait(self, *args, **kwargs):
        with self._comm._guard(self._collective, self._started):
            out = self._work.wait(*args, **kwargs)
        self._finish()
        return out

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._finish()
        return done

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._comm.stats.recent.append(self._collective)

    def __getattr__(self, name):
        return getattr(self._work, name)


class AxisComm:
    """The collectives of one mesh axis (``group`` None with size 1 makes every op a no-op)."""

    def __init__(self, axis: str, group: dist.ProcessGroup | None, size: int, rank: int, stats: CommStats):
        self.axis, self.group, self.size, self.rank, self.stats = axis, group, size, rank, stats

    def _record(self, op: str, nbytes: int, tag: str | None) -> None:
        self.stats.record(self.axis, op if tag is None else f"{op}:{tag}", nbytes, self.size)

    # -- naming failures ---------------------------------------------------------------------------
    def _group_ranks(self) -> list[int]:
        try:
            if self.group is None:
                return list(range(dist.get_world_size()))
            return dist.get_process_group_ranks(self.group)
        except (RuntimeError, ValueError):
            return []

    @contextmanager
    def _guard(self, collective: Collective, started: float | None = None):
        """Re-raise a failure inside ``collective`` as a CollectiveError naming it."""
        started = time.monotonic() if started is None else started
        try:
            yield
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the backend raised, with its context
            rank = dist.get_rank() if dist.is_initialized() else self.rank
            raise CollectiveError(rank, collective, self._group_ranks(), time.monotonic() - started,
                                  list(self.stats.recent), e) from e

    def _run(self, op: str, nbytes: int, tag: str | None, async_op: bool, call):
        """Record, start and guard one collective; its work handle is tracked when ``async_op``."""
        self._record(op, nbytes, tag)
        collective = Collective(op, self.axis, tag, nbytes)
        started = time.monotonic()
        with self._guard(collective, started):
            work = call()
        if async_op and work is not None:
            return _TrackedWork(work, self, collective, started)
        self.stats.recent.append(collective)
        return work

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False, tag: str | None = None):
        """In place; returns a work handle when ``async_op`` (None when there is nothing to do)."""
        if self.size == 1:
            return None
        return self._run("all_reduce", _nbytes(tensor), tag, async_op,
                         lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, tag: str | None = None):
        """Concatenate equal shards into ``output`` (size x shard); Gloo needs equal sizes: pad first."""
        if self.size == 1:
            output.copy_(shard.view_as(output))
            return None
        return self._run("all_gather", _nbytes(output), tag, async_op,
                         lambda: all_gather_single(output, shard, group=self.group, async_op=async_op))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, op=dist.ReduceOp.SUM,
                       async_op: bool = False, tag: str | None = None):
        """Reduce ``full`` over the group and keep this rank's equal slice in ``shard``."""
        if self.size == 1:
            shard.copy_(full.view_as(shard))
            return None
        return self._run("reduce_scatter", _nbytes(full), tag, async_op,
                         lambda: reduce_scatter_single(shard, full, op=op, group=self.group, async_op=async_op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str | None = None,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None):
        """Rows ``input_splits[r]`` of ``input`` go to rank r, ``output_splits[r]`` rows come from it
        (None: equal parts). The payload recorded is the whole input, like the equal case, so the
        sent bytes are (N-1)/N of it: the expected share under balanced routing."""
        if self.size == 1:
            output.copy_(input)
            return None
        return self._run("all_to_all", _nbytes(input), tag, async_op,
                         lambda: dist.all_to_all_single(output, input, output_split_sizes=output_splits,
                                                        input_split_sizes=input_splits, group=self.group,
                                                        async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src_global_rank: int, tag: str | None = None) -> None:
        if self.size == 1:
            return
        self._run("broadcast", _nbytes(tensor), tag, False,
                  lambda: dist.broadcast(tensor, src=src_global_rank, group=self.group))

    # -- point to point (pipeline stages) --------------------------------------------------------
    # ``peer`` is a rank index along this axis (a pp-rank), not a global rank. Only sends are
    # recorded, under op "send": the receiver's bytes are its peer's sends. ``tag`` names the
    # traffic; most kinds share one channel between two ranks (wire tag 0), where transfers match
    # in the order both ranks post them. A kind in ``WIRE_TAGS`` travels on a channel of its own on
    # Gloo (NCCL ignores tags and keeps the order alone), so it never meets another kind's receive.
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
        op = dist.P2POp(dist.isend, tensor.contiguous(), self._global_peer(peer), group=self.group,
                        tag=_wire_tag(tag))
        op._bigtrain_tag = tag  # for the failure report of batch_isend_irecv
        return op

    def recv_op(self, tensor: torch.Tensor, peer: int, tag: str | None = None) -> dist.P2POp:
        """A receive from ``peer`` into ``tensor`` for :meth:`batch_isend_irecv` (``tag``: the
        sender's, where it is one of ``WIRE_TAGS``)."""
        op = dist.P2POp(dist.irecv, tensor, self._global_peer(peer), group=self.group, tag=_wire_tag(tag))
        op._bigtrain_tag = tag
        return op

    def _p2p(self, op: dist.P2POp) -> Collective:
        kind = "send to" if op.op is dist.isend else "recv from"
        return Collective(f"{kind} rank {op.peer}", self.axis, getattr(op, "_bigtrain_tag", None), _nbytes(op.tensor))

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list:
        """Post ``ops`` at once (coalesced where the backend can); returns one work per op. Transfers
        between two ranks match in the order both post them."""
        if not ops:
            return []
        started = time.monotonic()
        with self._guard(self._p2p(ops[0]), started):
            works = dist.batch_isend_irecv(ops)
        return [_TrackedWork(work, self, self._p2p(op), started) for op, work in zip(ops, works)]

    def send(self, tensor: torch.Tensor, peer: int, tag: str | None = None) -> None:
        """Blocking send (small, rare messages such as shapes)."""
        self._record("send", _nbytes(tensor), tag)
        global_peer = self._global_peer(peer)
        collective = Collective(f"send to rank {global_peer}", self.axis, tag, _nbytes(tensor))
        with self._guard(collective):
            dist.send(tensor, global_peer, group=self.group, tag=_wire_tag(tag))
        self.stats.recent.append(collective)

    def recv(self, tensor: torch.Tensor, peer: int, tag: str | None = None) -> None:
        """Blocking receive into ``tensor`` (``tag``: the sender's, where it is one of ``WIRE_TAGS``)."""
        global_peer = self._global_peer(peer)
        collective = Collective(f"recv from rank {global_peer}", self.axis, tag, _nbytes(tensor))
        with self._guard(collective):
            dist.recv(tensor, global_peer, group=self.group, tag=_wire_tag(tag))
        self.stats.recent.append(collective)

    def gather_objects(self, obj):
        """Every rank's ``obj`` as a list on the axis's first rank (None elsewhere); not counted:
        it is for checkpoints and timelines, not for training traffic."""
        if self.size == 1:
            return [obj]
        ranks = dist.get_process_group_ranks(self.group)
        out = [None] * self.size if dist.get_rank() == ranks[0] else None
        collective = Collective("gather_object", self.axis, None, 0)
        with self._guard(collective):
            dist.gather_object(obj, out, dst=ranks[0], group=self.group)
        self.stats.recent.append(collective)
        return out

    def max(self, tensor: torch.Tensor, tag: str | None = "metrics") -> torch.Tensor:
        """Element-wise max over the axis, in place (for worst-rank metrics)."""
        self.all_reduce(tensor, op=dist.ReduceOp.MAX, tag=tag)
        return tensor
