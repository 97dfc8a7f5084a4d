"""fp32 gradient buffers that hold memory only from a step's first gradient to its optimizer step.

A ZeRO unit's fp32 gradient buffer (``full_grad`` at stages 0-1, the ``grad_shard`` at stage 2) is
4 bytes per parameter (3.6 GiB for a 1B model). Kept for the whole run it sits in memory through
every forward, next to the activations, although it holds nothing there: the previous step's
optimizer consumed it and the next gradient has not come. PyTorch's own loop frees ``p.grad``
after each step (``zero_grad(set_to_none=True)``) and regrows it in backward; so do we, without
dropping the tensor: after the step the buffer's storage is resized to zero bytes, and it is
resized back when the unit's first gradient of the next step arrives (stages 0-1: each parameter's
first gradient of the step is copied into its slot, and only the gaps between slots are zeroed,
:meth:`LazyGrads.grow`; stage 2: the step's first reduced shard is copied in, the later ones
added, :meth:`LazyGrads.regrow`). Resizing the storage keeps every view of it valid (the per-parameter
``grad_views``, the ``grad_shard`` of stages 0-1, the optimizer's ``view.grad`` pieces), as
ZeRO-3's gathered parameter buffers do (:meth:`FlatUnit.free_full`).

Within a step the buffers stay: micro-batches accumulate into them, and a pipeline's later
forwards run with them allocated; so the saving is a one-micro-batch, no-pipeline step's, where
no fp32 gradient exists at the end of the forward (:func:`bigtrain.plan.memory.lazy_grad_peak`
counts it the same way).

Where it applies (:func:`applies`): autograd's gradient arrives in a tensor of its own and is
added (or reduced, then added) into the fp32 buffer, i.e. not with fp32 compute at stages 0-1,
where ``param.grad`` *is* a view of the buffer and autograd accumulates into it; not with offload,
whose gradients live on the host or in files and are managed by :mod:`.offload` / :mod:`.grad_stream`;
not at stage 3, whose shard is the same 4P/N as stage 2's but which is not built for it.
"""

from __future__ import annotations

import torch

from bigtrain.parallel.zero.flat import FlatUnit


def applies(stage: int, grads_in_place: bool, offloaded: bool) -> bool:
    """Whether a ZeRO engine of this kind frees its fp32 gradient buffers between steps."""
    return stage <= 2 and not grads_in_place and not offloaded


def gradient_buffers(units: list[FlatUnit], stage: int, grads_in_place: bool, offloaded: bool
                     ) -> "LazyGrads | KeptGrads":
    """The engine's gradient buffers' lifetime: :class:`LazyGrads` (released now, until the first
    gradient) where :func:`applies`, else :class:`KeptGrads` (allocated for the whole run)."""
    if not applies(stage, grads_in_place, offloaded):
        return KeptGrads()
    lazy = LazyGrads(units, stage)
    lazy.release_all()
    return lazy


class KeptGrads:
    """Buffers the engine keeps allocated (and zeroes itself): nothing to release or regrow."""

    active = False

    def grow(self, unit: FlatUnit) -> None:
        pass

    def first_write(self, unit: FlatUnit, param: torch.Tensor) -> bool:
        return False

    def ensure(self, unit: FlatUnit) -> bool:
        return False

    def regrow(self, unit: FlatUnit) -> bool:
        return False

    def ensure_all(self) -> None:
        pass


class LazyGrads:
    """The units' fp32 gradient buffers, released after a step and regrown on first use."""

    active = True

    def __init__(self, units: list[FlatUnit], stage: int):
        self.units, self.stage = units, stage
        # Stages 0-1: ids of the parameters of regrown buffers whose slot holds no value yet this
        # step (its first gradient is copied there, not added to zeros), by unit.
        self._unwritten: dict[int, set[int]] = {}

    def buffer(self, unit: FlatUnit) -> torch.Tensor:
        """The tensor that owns the unit's fp32 gradient storage (the others are views of it)."""
        return unit.full_grad if self.stage <= 1 else unit.grad_shard

    def release(self, unit: FlatUnit) -> None:
        """No bytes until the next gradient (every view stays, pointing at none)."""
        self.buffer(unit).untyped_storage().resize_(0)
        self._unwritten.pop(id(unit), None)

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    def grow(self, unit: FlatUnit) -> None:
        """Stages 0-1, as a micro-batch's gradient of the unit arrives: the buffer in memory again
        if it was released, with zeros only where no parameter lies (alignment gaps, padding); each
        parameter's slot is written by its first gradient of the step (:meth:`first_write`), or
        zeroed by :meth:`ensure` if none comes. Zeroing the whole buffer and adding the first
        gradient into it read and wrote every element once more than the copy (on a GPU, a memset
        and an fp32 add over every parameter each step); 0 + g is g, so the sums are the same.
        (Stage 2 regrows with :meth:`regrow`, its whole shard at once.)"""
        if not self.regrow(unit):
            return
        buf = self.buffer(unit)
        end = 0
        for slot in sorted(unit.slots, key=lambda s: s.offset):
            if slot.offset > end:
                buf[end:slot.offset].zero_()
            end = max(end, slot.offset + slot.numel)
        if end < buf.numel():
            buf[end:].zero_()
        self._unwritten[id(unit)] = {id(p) for p in unit.params}

    def first_write(self, unit: FlatUnit, param: torch.Tensor) -> bool:
        """Whether ``param``'s slot holds no value yet this step (its gradient is to be copied
        there, not added); from now on it does."""
        unwritten = self._unwritten.get(id(unit))
        if unwritten is None or id(param) not in unwritten:
            return False
        unwritten.discard(id(param))
        return True

    def regrow(self, unit: FlatUnit) -> bool:
        """The buffer in memory again, whether it was released; if it was, its bytes are stale and
        the caller writes them (stage 2, as a reduced shard is folded in: the step's first fold is a
        copy, where zeros and an add read and wrote the shard once more; :meth:`grow`, :meth:`ensure`)."""
        buf = self.buffer(unit)
        storage, nbytes = buf.untyped_storage(), buf.numel() * buf.element_size()
        if storage.nbytes() >= nbytes:
            return False
        storage.resize_(nbytes)
        return True

    def ensure(self, unit: FlatUnit) -> bool:
        """The unit's buffer in memory, zeros if it was released (and zeros in the slots of the
        parameters whose gradient never came since :meth:`grow`); whether it was released."""
        unwritten = self._unwritten.pop(id(unit), None)
        if unwritten:
            views = {id(p): view for p, view in zip(unit.params, unit.grad_views)}
            for pid in unwritten:
                views[pid].zero_()
        if not self.regrow(unit):
            return False
        self.buffer(unit).zero_()
        return True

    def ensure_all(self) -> None:
        """Every buffer in memory: a unit whose gradients never came reads as zeros."""
        for unit in self.units:
            self.ensure(unit)
