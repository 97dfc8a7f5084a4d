"""Gradients leave the device as the backward produces them (ZeRO-Offload's gradient path).

Under ``offload.optimizer`` on a GPU the device holds the compute weights, the activations and a
bounded set of gradient buckets, never a whole fp32 gradient. Each unit's gradient, as soon as the
backward has produced all of it, is reduced (reduce-scatter over its group) into a bucket; the
bucket is copied into pinned host memory on the copy stream (:class:`HostLink`), which waits for
the reduction, not the compute stream, so the backward of the next units goes on meanwhile; a host
thread then adds it into the unit's fp32 accumulator (a host tensor, the engine's ``grad_shard``),
across the micro-batches of the step (the first one of a step is copied, so nothing needs zeroing).

Bounded: ``buckets`` device buffers of the largest shard in the reduce dtype, and as many pinned
host buffers, allocated once. A bucket is reused only after the host folded its last content, which
implies its copy down completed: the main thread waits for that (``bucket``) before it queues the
next reduction into it, so at most ``buckets`` reduced shards are on the device or on their way
down at any time. One fold thread, first in first out: a unit's micro-batches are added in order,
the same arithmetic as the engine's fp32 ``grad_shard.add_`` on the device.

On a CPU device (the tests' ``separate_host``) the same objects run with no streams: the copy is
made by the fold thread after the collective's ``wait``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from bigtrain.parallel.zero.host import HostLink


class _Bucket:
    __slots__ = ("device", "host", "folded")

    def __init__(self, device: torch.Tensor, host: torch.Tensor):
        self.device, self.host = device, host
        self.folded: Future | None = None  # the host's fold of its last content


class GradientStream:
    """``fold(unit, reduced_host_tensor, final)`` is called on the fold thread for every reduced
    shard, in the order they were sent; ``final``: the step's last micro-batch."""

    def __init__(self, link: HostLink, numel: int, dtype: torch.dtype, buckets: int,
                 fold: Callable[[object, torch.Tensor, bool], None]):
        self.link, self.fold = link, fold
        self._buckets = [_Bucket(torch.empty(numel, dtype=dtype, device=link.device), link.empty(numel, dtype))
                         for _ in range(max(1, buckets))]
        self._next = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bigtrain-grad-fold")

    def bucket(self, numel: int) -> tuple[_Bucket, torch.Tensor]:
        """The next bucket (waiting until the host has folded its last content) and its first
        ``numel`` elements on the device, for a reduction to write."""
        bucket = self._buckets[self._next]
        self._next = (self._next + 1) % len(self._buckets)
        self._settle(bucket)
        return bucket, bucket.device[:numel]

    def send(self, bucket: _Bucket, unit, numel: int, work, final: bool) -> None:
        """The bucket's reduced shard (written by ``work``, a collective in flight, or already there
        when None) down to the host, then folded into ``unit``'s accumulator."""
        arriving = self.link.to_host(bucket.device[:numel], bucket.host[:numel], after=work)
        bucket.folded = self._worker.submit(lambda: self.fold(unit, arriving.read(), final))

    def drain(self) -> None:
        """Every shard sent so far is folded (errors of the fold thread are raised here)."""
        for bucket in self._buckets:
            self._settle(bucket)

    @staticmethod
    def _settle(bucket: _Bucket) -> None:
        if bucket.folded is not None:
            folded, bucket.folded = bucket.folded, None
            folded.result()

    def buffers(self) -> list[torch.Tensor]:
        return [t for b in self._buckets for t in (b.device, b.host)]

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._worker.shutdown()


class HostGradients:
    """The units' fp32 gradient accumulators in host memory (each unit's ``grad_shard``), allocated
    once (pinned on a GPU), and the :class:`GradientStream` that fills them. With gradients in files
    (the NVMe tier at stages 2-3) the fold goes to the unit's file instead
    (``UnitOffload.fold_grad``). With the delayed update each unit has a second buffer: the worker
    steps with one while the next backward fills the other (:meth:`hold` swaps them; no copy)."""

    def __init__(self, offload, units: list, reduce_dtype: torch.dtype, buckets: int):
        self.offload, self.link = offload, offload.link
        self._in_files = offload.grads_in_files
        self._spare: dict[int, torch.Tensor] = {}  # id(unit) -> the delayed update's other buffer
        self._fresh: set[int] = set()  # units whose accumulator holds nothing of this step yet
        numel = max(u.shard_numel for u in units)
        self.stream = GradientStream(self.link, numel, reduce_dtype, buckets, self._fold)

    def accumulator(self, unit) -> torch.Tensor:
        """A new unit's fp32 accumulator (zeros; plain memory when it lives in a file)."""
        pinned = not self._in_files
        if self.offload.delayed is not None and not self._in_files:
            self._spare[id(unit)] = self.link.zeros(unit.shard_numel, torch.float32, pinned=pinned)
        return self.link.zeros(unit.shard_numel, torch.float32, pinned=pinned)

    def _fold(self, unit, reduced: torch.Tensor, final: bool) -> None:
        """On the fold thread: a reduced shard into its unit's accumulator (the step's first is
        copied: 0 + x is x, and nothing has to be zeroed between steps)."""
        if self._in_files:
            self.offload.fold_grad(unit, reduced)
        elif id(unit) in self._fresh:
            unit.grad_shard.copy_(reduced)
            self._fresh.discard(id(unit))
        else:
            unit.grad_shard.add_(reduced)

    def finish(self, units: list) -> None:
        """Every reduction of the step folded; a unit none reached holds zeros."""
        self.stream.drain()
        for unit in units:
            if id(unit) in self._fresh:
                unit.grad_shard.zero_()
                self._fresh.discard(id(unit))

    def reset(self, unit) -> None:
        """The next step starts: the unit's accumulator is to be overwritten, not added to."""
        if not self._in_files:
            self._fresh.add(id(unit))

    def hold(self, unit) -> torch.Tensor:
        """The delayed update: the unit's accumulated gradient, for the worker, and a fresh buffer
        (the one the worker read last, which it has finished with) for the next backward."""
        held, unit.grad_shard = unit.grad_shard, self._spare[id(unit)]
        self._spare[id(unit)] = held
        return held

    def buffers(self) -> list[torch.Tensor]:
        return list(self._spare.values()) + self.stream.buffers()

    def close(self) -> None:
        self.stream.close()
