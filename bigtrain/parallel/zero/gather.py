"""ZeRO-3 parameter gathering: all-gather a unit just before it runs, free it right after.

Forward: a unit's pre-forward hook waits for (or starts) its all-gather and starts the next
unit's, so the next gather overlaps this unit's compute; its forward hook frees it (unless
``reshard_after_forward`` is off, the ZeRO-2-like trade-off). Backward: a pre-backward hook
gathers it again and prefetches the unit that backward reaches next; once its gradients are reduced
it is freed when backward reaches the next unit (:meth:`after_reduce` says why not at once). The all-gather writes into the parameters' storage behind autograd's back,
so its version counter is restored afterwards: the graph saved references to exactly these views.

Which unit runs next comes from how the units' modules nest, not from their positions: a unit
that contains others (the root unit of a model, or of a pipeline stage) runs around them, so it
comes first both ways; units side by side (a stage's blocks, a rank's interleaved pipeline chunks)
run forward in the order given and backward in reverse. A stage may have no root unit at all (a
middle stage holds only blocks), and a pipeline runs other micro-batches in between, so a
prefetched unit can outlive the pass that wanted it: :meth:`free_all` at every optimizer step
makes sure no gathered copy of the old weights is ever read after an update.

On CUDA the all-gathers run on NCCL's stream, overlapping compute on the current stream; three
orderings keep that safe without ``record_stream``. (1) The buffer is allocated on the current
stream just before the gather, and NCCL's stream first waits for the work queued there, so the
gather cannot overwrite memory that compute queued earlier still reads. (2) ``work.wait()`` in
:meth:`_finish`, before the unit's forward or backward, makes the current stream wait for the
gather (the host does not block), so compute reads gathered weights. (3) A buffer is freed only
through :meth:`_free`, which finishes its gather first; the kernels that read it were queued on
the current stream before the free, and the caching allocator reuses the block only for work
queued after them on that stream, or for a later gather, which waits for them by (1).
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.memory.spares import SpareBuffers
from bigtrain.parallel.zero.flat import FlatUnit


def call_orders(modules: list[nn.Module]) -> tuple[list[int], list[int]]:
    """Indices of ``modules`` in the order their forwards start and their backwards start."""
    inside = [{id(m) for m in module.modules()} for module in modules]
    children: dict[int | None, list[int]] = {}
    for i, module in enumerate(modules):
        holders = [j for j in range(len(modules)) if j != i and id(module) in inside[j]]
        parent = min(holders, key=lambda j: len(inside[j]), default=None)  # the innermost holder
        children.setdefault(parent, []).append(i)

    def walk(node: int | None, backward: bool):
        for child in reversed(children.get(node, [])) if backward else children.get(node, []):
            yield child
            yield from walk(child, backward)

    return list(walk(None, False)), list(walk(None, True))


def _successors(order: list[int]) -> dict[int, int]:
    return dict(zip(order, order[1:]))


class ParameterGatherer:
    """Gathers around each unit module; a module holding units of several groups (dense weights
    and experts) gathers all of them together. Indices below are positions in ``modules``."""

    def __init__(self, engine, reshard_after_forward: bool, prefetch: bool):
        self.engine, self.reshard_after_forward, self.prefetch = engine, reshard_after_forward, prefetch
        self.modules: list[nn.Module] = []
        self.units: list[list[FlatUnit]] = []  # per module
        for unit, module in zip(engine.units, engine.unit_modules):
            if not any(m is module for m in self.modules):
                self.modules.append(module)
                self.units.append([])
            self.units[next(i for i, m in enumerate(self.modules) if m is module)].append(unit)
        self._add_borrowed_units(engine)
        forward, backward = call_orders(self.modules)
        self._next_forward, self._next_backward = _successors(forward), _successors(backward)
        self._work: dict[int, object] = {}
        self._reduced: list[FlatUnit] = []  # units whose gradients are reduced, freed when backward moves on
        self.spares = SpareBuffers()  # freed units' bytes, for the next gathers (the module's docstring)
        self._most_gathered = 0  # the most bytes gathered at once so far: the spares' bound
        for i, module in enumerate(self.modules):
            module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
            module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    def _add_borrowed_units(self, engine) -> None:
        """A module also gathers the units owning weights that its own part uses but another unit
        holds: a weight registered in two modules (tied embeddings) belongs to one unit only, but
        both modules read it. With the fused loss the head is a unit of its own that runs after
        the model's forward, when the root unit (the embedding's) is released: tied, the head's
        unit owns the shared weight and the root borrows it for the embedding's lookup."""
        owner = {id(p): unit for unit in engine.units for p in unit.params}
        for i, module in enumerate(self.modules):
            inside = {id(m) for m in module.modules()}
            nested = {id(m) for j, other in enumerate(self.modules) if j != i and id(other) in inside
                      for m in other.modules()}
            used = [p for m in module.modules() if id(m) not in nested for p in m._parameters.values() if p is not None]
            for p in used:
                unit = owner.get(id(p))
                if unit is not None and not any(unit is u for u in self.units[i]):
                    self.units[i].append(unit)

    def _start_gather(self, units: list[FlatUnit]) -> None:
        for unit in units:
            if unit.gathered or id(unit) in self._work:
                continue
            self.spares.give(unit.full.untyped_storage(), unit.padded_numel * unit.full.element_size())
            self._most_gathered = max(self._most_gathered, self.gathered_bytes())
            source = unit.shard_param
            if self.engine.offload is not None:  # the shard read back from its file, or copied up from the host
                source = self.engine.offload.before_gather(unit)
            version = unit.full._version
            work = unit.comm.all_gather(unit.full, source, async_op=True, tag="params")
            self._work[id(unit)] = (work, version, source)  # the source lives until the gather is done

    def _finish(self, unit: FlatUnit) -> None:
        if id(unit) not in self._work:
            return
        work, version, _ = self._work.pop(id(unit))
        if work is not None:  # None: a group of one rank copied synchronously
            work.wait()
        # The collective bumps the version counter (on Gloo's thread, whenever it completes);
        # nothing else writes these bytes, so restore the version autograd saved.
        torch._C._autograd._unsafe_set_version_counter((unit.full,), (version,))
        if self.engine.offload is not None:
            self.engine.offload.after_gather(unit)

    def _wait(self, units: list[FlatUnit]) -> None:
        self._start_gather(units)
        for unit in units:
            self._finish(unit)

    def _before_forward(self, i: int) -> None:
        self._run_then_prefetch(i, self._next_forward)

    def _run_then_prefetch(self, i: int, successors: dict[int, int]) -> None:
        self._wait(self.units[i])
        if self.prefetch and i in successors:
            self._start_gather(self.units[successors[i]])

    def _after_forward(self, i: int, out) -> None:
        # The root unit wraps the whole model: its forward hook runs after the model's forward.
        if self.reshard_after_forward or not torch.is_grad_enabled():
            for unit in self.units[i]:
                self._free(unit)
        first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                      if torch.is_tensor(t) and t.requires_grad), None)
        if first is not None:
            # The gradient of the unit's output arrives just before the unit's own backward starts.
            first.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._free_reduced()
        self._run_then_prefetch(i, self._next_backward)

    def _free(self, unit: FlatUnit) -> None:
        self._finish(unit)
        if unit.gathered:
            storage = unit.full.untyped_storage()
            # kept while what is gathered (this unit no longer) and the spares stay within the peak
            room = self._most_gathered - (self.gathered_bytes() - storage.nbytes())
            self.spares.take(storage, limit=room)

    def gathered_bytes(self) -> int:
        """Bytes of the units gathered now (or being gathered)."""
        return sum(unit.full.untyped_storage().nbytes() for unit in self.engine.units)

    def after_reduce(self, unit: FlatUnit) -> None:
        """Called once the unit's gradients are handed to the reduce-scatter. Its weights may still
        be read: a linear layer that computes its weight gradient in an autograd node of its own
        (int8 activation compression, float8) reads the weight for its input gradient after that
        node. A unit holding only such a weight (a tied head's copy on the last pipeline stage)
        would be freed under that read. So the unit is freed when backward reaches the next unit,
        whose output gradient needs every read of this one done; the last ones reduced (the root,
        the first block), which no next unit follows, by the engine's ``finish_grad_sync`` once the
        step's backward is over (between micro-batches they stay for the next forward, which
        starts with them)."""
        self._reduced.append(unit)

    def _free_reduced(self) -> None:
        for unit in self._reduced:
            self._free(unit)
        self._reduced.clear()

    def free_all(self) -> None:
        """Drop every gathered copy (waiting for gathers in flight): the weights are about to change;
        and the spare bytes (between steps ZeRO-3 holds no gathered unit)."""
        self._reduced.clear()
        for units in self.units:
            for unit in units:
                self._free(unit)
        self.spares.drop()

