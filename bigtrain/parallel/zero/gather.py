"""ZeRO-3 parameter gathering: all-gather a unit just before it runs, free it right after.

Forward: a unit's pre-forward hook waits for (or starts) its all-gather and starts the next
unit's, so the next gather overlaps this unit's compute; its forward hook frees it (unless
``reshard_after_forward`` is off, the ZeRO-2-like trade-off). Backward: a pre-backward hook
gathers it again and prefetches the unit that backward reaches next; the engine frees it once its
gradients are reduced. The all-gather writes into the parameters' storage behind autograd's back,
so its version counter is restored afterwards: the graph saved references to exactly these views.
"""

from __future__ import annotations

import torch

from bigtrain.parallel.zero.flat import FlatUnit


class ParameterGatherer:
    def __init__(self, engine, reshard_after_forward: bool, prefetch: bool):
        self.engine, self.reshard_after_forward, self.prefetch = engine, reshard_after_forward, prefetch
        self.units: list[FlatUnit] = engine.units  # forward order: root first, then blocks
        self._work: dict[int, object] = {}
        for i, module in enumerate(engine.unit_modules):
            module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
            module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.gathered or id(unit) in self._work:
            return
        unit.allocate_full()
        version = unit.full._version
        work = self.engine.comm.all_gather(unit.full, unit.shard_param, async_op=True, tag="params")
        self._work[id(unit)] = (work, version)

    def _finish(self, unit: FlatUnit) -> None:
        if id(unit) not in self._work:
            return
        work, version = self._work.pop(id(unit))
        if work is not None:  # None: a group of one rank copied synchronously
            work.wait()
        # The collective bumps the version counter (on Gloo's thread, whenever it completes);
        # nothing else writes these bytes, so restore the version autograd saved.
        torch._C._autograd._unsafe_set_version_counter((unit.full,), (version,))

    def _wait(self, unit: FlatUnit) -> None:
        self._start_gather(unit)
        self._finish(unit)

    def _before_forward(self, i: int) -> None:
        self._wait(self.units[i])
        if self.prefetch and i + 1 < len(self.units):
            self._start_gather(self.units[i + 1])

    def _after_forward(self, i: int, out) -> None:
        # The root unit wraps the whole model: its forward hook runs after the model's forward.
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(self.units[i])
        first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                      if torch.is_tensor(t) and t.requires_grad), None)
        if first is not None:
            # The gradient of the unit's output arrives just before the unit's own backward starts.
            first.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._wait(self.units[i])
        # Backward runs the blocks in reverse; the root (index 0) spans it all, prefetch the last block.
        following = len(self.units) - 1 if i == 0 else i - 1
        if self.prefetch and following > 0:
            self._start_gather(self.units[following])

    def _free(self, unit: FlatUnit) -> None:
        self._finish(unit)
        if unit.gathered:
            unit.free_full()

    def after_reduce(self, unit: FlatUnit) -> None:
        """Called once the unit's gradients are handed to the reduce-scatter: its weights are done."""
        self._free(unit)

    def free_all(self) -> None:
        for unit in self.units:
            self._free(unit)

