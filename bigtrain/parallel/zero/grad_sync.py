"""ZeRO's gradient reduction, per unit as backward produces it (the ``backward`` half of
:class:`~bigtrain.parallel.zero.engine.ZeroEngine`, which derives from :class:`GradSync`).

A unit's gradients are reduced as soon as its last one arrives in backward, so communication
overlaps the rest of backward: all-reduce in stage 0, reduce-scatter in stages 1-3, in the reduce
dtype. Stages 0-1 accumulate full fp32 gradients locally and reduce once a step (``no_sync`` on the
other micro-batches); stages 2-3 keep only the shard and reduce every micro-batch. With offload on
a GPU each reduced gradient goes through a device bucket to its host accumulator
(:mod:`.grad_stream`), under HSDP after its replicas' all-reduce.

Under HSDP the ranks holding the same shard in the other groups add theirs: each unit's reduced
shard is all-reduced over the replicas (:class:`ReplicaReduction`), started asynchronously once its
reduce-scatter is done, so that it runs while backward goes on through the earlier units, and
waited for only when the shard is folded (the unit's next micro-batch, or ``finish_grad_sync``).
The start lags one unit (it happens at the next unit's reduction): waiting for a reduce-scatter
the moment it is issued would block (Gloo: the host; NCCL: the compute stream) for the whole
collective, where one unit's backward later it is (nearly always) done: on NCCL the compute stream
stalls only if that reduce-scatter outlasted the unit's backward. What stays exposed is the
all-reduce of the units reduced as the backward ends (the last-reduced one, the root, whose last
gradient is the embedding's, and the block before it). Stage 1 reduces once a step, on the final
micro-batch: its replica all-reduces overlap that micro-batch's backward; the others communicate
nothing.

The state it reads is the engine's (set up in ``ZeroEngine.__init__``): ``units``, ``stage``,
``precision``, ``offload``, ``gatherer``, ``_lazy`` (the fp32 buffers, :mod:`.lazy_grads`),
``_host_grads``, ``_grads_in_place``, ``_sync`` (cleared by ``no_sync``), ``_pending`` (reductions
in flight), ``_remaining`` (gradients still to come per unit), ``_unit_of`` and ``_grad_home``; it
calls the engine's ``drop_gathered``.

In flight, held in ``_pending`` until folded: at most one reduced shard per unit (a unit's previous
result is folded before it is reduced again), the unit shards together the rank's gradient shard
in the reduce dtype, as without HSDP; the replicas' all-reduce works in place on that buffer and
adds none. Of those at most one (the newest) waits for its replica all-reduce to start.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bigtrain.parallel.data import rehome_grad, sync_off
from bigtrain.parallel.zero.flat import FlatUnit


class ReplicaReduction:
    """HSDP's second level of one unit's reduction, as the work handle ``_pending`` holds: the ZeRO
    group's collective into ``out`` (``group_work``, None where there is nothing to wait for), then
    ``out`` all-reduced in place over ``replicas``, started by :meth:`start` and waited by :meth:`wait`.

    Every rank of a replica group must start these all-reduces in the same order (a collective
    matches its peers by order): the engine starts them in the order of ``_pending`` (the order
    of reduction, alike on every rank), at fixed points, never on whether a collective looks done."""

    def __init__(self, group_work, replicas, out: torch.Tensor):
        self.group_work, self.replicas, self.out = group_work, replicas, out
        self.started, self.replica_work = False, None

    def start(self) -> None:
        """Wait for the group's collective and start the replicas' all-reduce of its result."""
        if self.started:
            return
        if self.group_work is not None:
            # Gloo: blocks the host until the reduce-scatter is done. NCCL: makes the current stream
            # wait for it; the all-reduce below, on the replica group's own NCCL stream, waits in
            # turn for the current stream, so it reads the reduced shard.
            self.group_work.wait()
        self.replica_work = self.replicas.all_reduce(self.out, async_op=True, tag="grads")
        self.started = True

    def wait(self) -> None:
        """After this the fold may read ``out``: the sum over the group and over the replicas
        (NCCL: the current stream waits for the all-reduce; the host does not block)."""
        self.start()
        if self.replica_work is not None:
            self.replica_work.wait()


class GradSync:
    """Gradient reduction of a ZeRO engine's units (a base of ``ZeroEngine``; see the module)."""


    def no_sync(self):
        """Non-final micro-batches: stages 0-1 accumulate locally; stages 2-3 must reduce anyway."""
        return sync_off(self)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        unit = self._unit_of[id(param)]
        if self.stage <= 1 and self._host_grads is None:
            self._lazy.grow(unit)  # the unit's first gradient of the step: its buffer back in memory
            self._accumulate(unit, param)
            if not self._sync:
                return
        self._remaining[id(unit)] -= 1
        if self._remaining[id(unit)] == 0:
            self._reduce(unit)

    def _accumulate(self, unit: FlatUnit, param: nn.Parameter) -> None:
        """Stages 0-1: bring a parameter's new gradient into its place in the fp32 buffer (copied
        there if it is the step's first, which the freed buffer holds no zeros for: lazy_grads.py)."""
        home = self._grad_home[id(param)]
        if self._grads_in_place:
            rehome_grad(param, home)
        elif self._lazy.first_write(unit, param):
            home.copy_(param.grad)
            param.grad = None
        else:
            home.add_(param.grad)
            param.grad = None

    def _reduce(self, unit: FlatUnit) -> None:
        self._remaining[id(unit)] = len(unit.params)
        if self._host_grads is not None:
            self._reduce_to_host(unit)
            return
        if self.stage >= 2:  # fold the previous micro-batch's result first: one buffer per unit at most
            self._complete(lambda u: u is unit)
        reduce_dtype = self.precision.reduce
        if self.stage <= 1:
            if self._grads_in_place:
                for p, view in zip(unit.params, unit.grad_views):
                    rehome_grad(p, view)  # a parameter without a gradient since torch's zero_grad adds zeros
            self._lazy.ensure(unit)  # a unit whose gradients never came reduces zeros
            if unit.comm.size == 1 and unit.replicas.size == 1:
                return  # the local sum is the result; a cast to the reduce dtype would only round it
            payload = unit.full_grad if unit.full_grad.dtype == reduce_dtype else unit.full_grad.to(reduce_dtype)
        else:
            payload = unit.flat_grads(reduce_dtype)
            for p in unit.params:
                p.grad = None  # the full gradient is freed as soon as it is handed to the collective
        # On CUDA the collective runs on NCCL's own stream, which first waits for everything queued
        # so far on the current stream (the gradients copied into ``payload``). ``out`` stays
        # referenced in ``_pending`` until ``_complete`` has waited for it. ``payload`` may be a
        # temporary (a cast, or the flat copy of stages 2-3) that we drop here: c10d keeps the
        # input of an asynchronous collective from the caching allocator until it is done (it
        # records it on NCCL's stream, or, in newer torch, holds it until ``wait()``), as Gloo's
        # work holds it until it completes.
        if self.stage == 0 or (unit.comm.size == 1 and unit.replicas.size > 1):  # HSDP, groups of one rank:
            # nothing to scatter, only the replicas reduce (in _complete)
            work = unit.comm.all_reduce(payload, async_op=True, tag="grads") if unit.comm.size > 1 else None
            out = payload
        else:
            out = torch.empty(unit.shard_numel, dtype=reduce_dtype, device=payload.device)
            work = unit.comm.reduce_scatter(out, payload, async_op=True, tag="grads")
        if self.offload is not None and self.offload.grads_in_files:
            # Gradients go to their files as reductions complete: hold one unit's output, not all.
            self._complete(lambda u: True)
        if unit.replicas.size > 1:
            # HSDP: the units reduced before this one start their replica all-reduce now, their
            # reduce-scatter having run during this unit's backward; this one's starts at the next
            # reduction (or at once where there is no reduce-scatter to wait for: groups of one).
            self._start_replicas(len(self._pending))
            work = ReplicaReduction(work, unit.replicas, out)
            if work.group_work is None:
                work.start()
        self._pending.append((unit, work, out))
        if self.gatherer is not None:
            self.gatherer.after_reduce(unit)

    def _reduce_to_host(self, unit: FlatUnit) -> None:
        """The unit's gradient of this micro-batch reduced into a device bucket, which goes down to the
        host and is added into the unit's fp32 accumulator there (:mod:`.grad_stream`); the bucket
        is the only device memory it keeps. A group of one writes the flat gradient straight into it.
        Under HSDP the bucket is all-reduced over the replicas before it leaves, started here, on
        this thread, in the order of reduction (the fold's thread only waits for it): on NCCL the
        compute stream waits for the reduce-scatter and goes on, on Gloo the host waits for it."""
        stream = self._host_grads.stream
        bucket, out = stream.bucket(unit.shard_numel)
        work = None
        if unit.comm.size == 1:
            unit.flat_grads(self.precision.reduce, out=out)
        else:
            work = unit.comm.reduce_scatter(out, unit.flat_grads(self.precision.reduce), async_op=True, tag="grads")
        if unit.replicas.size > 1:
            work = ReplicaReduction(work, unit.replicas, out)
            work.start()
        for p in unit.params:
            p.grad = None  # queued on the compute stream before any reuse of the memory: the copy read it
        stream.send(bucket, unit, unit.shard_numel, work, final=self._sync)
        if self.gatherer is not None:
            self.gatherer.after_reduce(unit)

    def finish_grad_sync(self) -> None:
        """Wait for every reduction and fold the results into the gradient shards. ZeRO-3: no
        gathered unit outlives the step's backward (see below)."""
        if self._sync:
            reduced = {id(u) for u, _, _ in self._pending}
            local = self.stage <= 1 and self._host_grads is None  # accumulated here, reduced once a step
            for unit in self.units:  # units whose gradients never arrived (unused parameters)
                if self._remaining[id(unit)] != len(unit.params) or (local and id(unit) not in reduced):
                    self._reduce(unit)
        # ZeRO-3: the units reduced last (the root, whose last gradient is the embedding's, and the
        # first block) wait in the gatherer for a next unit's backward that never comes, and the
        # spares keep the bytes of those freed before: root + two blocks held from here to the
        # step. The backward is over (this runs after the last micro-batch's), so nothing reads
        # them; freed before the folds below, which allocate none. (Between micro-batches they
        # stay: the next forward starts with the root and the first block.)
        self.drop_gathered()
        if self._host_grads is not None:
            self._host_grads.finish(self.units)
        self._complete(lambda u: True)
        self._lazy.ensure_all()  # stage 2: a unit none of whose gradients came is not reduced: zeros

    def _start_replicas(self, upto: int) -> None:
        """Start the replica all-reduces of the first ``upto`` pending reductions not yet started,
        in order (the same order on every rank)."""
        for _, work, _ in self._pending[:upto]:
            if isinstance(work, ReplicaReduction):
                work.start()

    def _complete(self, which) -> None:
        """Wait for the pending reductions of the units ``which`` selects; fold them into the shards."""
        chosen = [i for i, (unit, _, _) in enumerate(self._pending) if which(unit)]
        if not chosen:
            return
        self._start_replicas(chosen[-1])  # the ones before the last chosen first, in order
        keep = []
        for unit, work, out in self._pending:
            if not which(unit):
                keep.append((unit, work, out))
                continue
            if work is not None:
                # NCCL: makes the current stream wait for the collective (the host does not block),
                # so the fold below and everything after it reads the reduced values. HSDP: the
                # replicas' all-reduce too (ReplicaReduction.wait), the fold reading their sum.
                work.wait()
            if self.stage <= 1:
                if out is not unit.full_grad:
                    unit.grad_shard.copy_(out)
            elif self.offload is not None and self.offload.grads_in_files:
                self.offload.fold_grad(unit, out)
            elif self._lazy.regrow(unit):  # released since the last step: this is its first fold
                unit.grad_shard.copy_(out)
            else:
                unit.grad_shard.add_(out)
        self._pending = keep

    def grad_piece(self, name: str) -> tuple[torch.Tensor, int]:
        """This rank's reduced gradient of parameter ``name`` after :meth:`finish_grad_sync` (a view
        the step reads: changing it changes the update), and the index in the parameter of its
        first element; empty where this rank's shard holds none of it."""
        unit = self._unit_holding(name)
        self._lazy.ensure(unit)
        return unit.slot_grad_piece(name)

    def _unit_holding(self, name: str) -> FlatUnit:
        for unit in self.units:
            if any(slot.name == name for slot in unit.slots):
                return unit
        raise KeyError(f"no parameter named {name!r} in this engine")

    @contextlib.contextmanager
    def editable_grad_piece(self, name: str):
        """:meth:`grad_piece`, kept in memory while the caller changes it in place (the tied copies'
        sum over the pipeline's ends): with ZeRO-Infinity's gradients in files (offload.optimizer =
        'nvme' at stages 2-3) the unit's shard is read in first and written back after, so the
        change reaches the step, which reads the shard from its file."""
        unit = self._unit_holding(name)
        in_files = self.offload is not None and self.offload.grads_in_files
        if in_files:
            self.offload.grad_in(unit)
        self._lazy.ensure(unit)
        try:
            yield unit.slot_grad_piece(name)
        finally:
            if in_files:
                self.offload.grad_out(unit)
