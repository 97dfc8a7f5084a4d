"""ZeRO-Offload and ZeRO-Infinity for the ZeRO engine: the optimizer steps unit by unit on the host,
its fp32 masters and state optionally kept in files (the NVMe tier), and ZeRO-3's parameter shards
optionally kept in files too, read in just before their unit is gathered.

What lives where (``offload.optimizer`` / ``offload.params``):

- ``optimizer = "cpu"``: the step runs one unit at a time on the host with the optimizer's own
  kernel (AdamW: torch's fused CPU kernel, one pass over the flat shard), publishing each unit's
  weights as soon as it is stepped. On a CPU device the host is the device: only the order changes.
- ``optimizer = "nvme"``: the same, and between steps each unit's optimizer state, and its fp32
  masters where they are not the live parameters (mixed precision; ZeRO-3 fp32 with
  ``params = "nvme"``), are in files: read in (the next unit's read overlapping this unit's step)
  and written back after the unit's step. ``masters = "cpu"`` keeps those masters in host memory
  and only the state in files (a host that holds masters and gradients but not the state too).
- ``params = "cpu"`` (ZeRO-3): the parameter shards are in host memory and each unit's shard is
  copied to the device just before its all-gather (which the gatherer's prefetch runs a unit
  ahead), the copy freed when the gather completes. On a CPU device the host is the device and
  this is ZeRO-3 as it runs anyway, unless the link is told to keep separate host copies (tests).
- ``params = "nvme"`` (ZeRO-3): a unit's parameter shard is in its file except while it is
  gathered (read in when the gather starts, which the gatherer's static prefetch order already
  runs a unit ahead; released when the gather completes) and while it is stepped.

A checkpoint is saved and loaded one unit in memory at a time (:meth:`UnitOffload.unit_resident`); the
full state reads everything back first (:meth:`UnitOffload.all_resident`).

Host and device (:mod:`.host`): on a GPU the masters, the optimizer's state, the files' tensors and
the offloaded parameter shards are host tensors; each unit's gradient shard comes down to a pinned
host buffer before its host step, its updated weights go back up after it, both on a side copy
stream (:class:`~bigtrain.parallel.zero.host.HostLink`). On a CPU device the link copies nothing
unless ``OffloadPlan.separate_host`` asks it to (tests: the GPU path's copies, on the CPU).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bigtrain.memory.swap import SwapStore
from bigtrain.parallel.zero.delayed import DelayedUpdate
from bigtrain.parallel.zero.grad_stream import HostGradients
from bigtrain.parallel.zero.host import HostLink
from bigtrain.parallel.zero.tiers import held_bytes


@dataclass(frozen=True)
class OffloadPlan:
    optimizer: str = "none"  # none | cpu | nvme
    params: str = "none"  # none | cpu | nvme
    nvme_dir: str = ""
    prefetch_depth: int = 1
    delayed_update: bool = False  # ZeRO-Offload's one-step delayed update (:mod:`.delayed`)
    grad_buckets: int = 4  # device buffers reduced gradients pass through on their way to the host (:mod:`.grad_stream`)
    masters: str = "auto"  # offload.masters: 'cpu' keeps separate fp32 masters in host memory under optimizer = nvme
    # Not a config key: on a CPU device, keep the host tier's tensors apart from the compute shards
    # and make every copy a GPU makes (tests run the CUDA path's logic this way). Always so on a GPU.
    separate_host: bool = False

    @property
    def active(self) -> bool:
        return self.optimizer != "none" or self.params != "none"


class UnitOffload:
    def __init__(self, engine, plan: OffloadPlan, directory: str | Path):
        if engine.device.type not in ("cpu", "cuda"):
            raise ValueError(f"offload.optimizer / offload.params: the host and NVMe tiers are built for CPU "
                             f"and CUDA devices, not {engine.device.type}; set offload.optimizer = 'none' and "
                             f"offload.params = 'none', or train on 'cuda' or 'cpu'")
        self.engine, self.plan = engine, plan
        self.link = HostLink(engine.device, separate=plan.separate_host)
        # ZeRO-3's parameter shards in host memory (apart from the device): copied up for each gather.
        self.params_on_host = engine.stage == 3 and plan.params != "none" and self.link.separate
        self._host_grads: dict[int, torch.Tensor] = {}  # id(unit) -> its host gradient buffer (fp32)
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self.store = SwapStore(directory) if "nvme" in (plan.optimizer, plan.params) else None
        self._stepping = False
        self._depth = 0  # nested all_resident contexts
        # ZeRO-Infinity keeps gradients off the device too: with the NVMe tier at stages 2-3 each
        # unit's fp32 gradient shard is in its file except while a reduction is folded into it and
        # while its unit is stepped. ``_zero``: shards whose file is stale and whose value is zero
        # (after zero_grad), so neither a read nor a write is needed.
        self.grads_in_files = plan.optimizer == "nvme" and engine.stage >= 2
        self._zero: set[int] = set()
        self.delayed = DelayedUpdate(self) if plan.delayed_update else None
        self.last_host_step: tuple[float, float] | None = None  # (start, end) of the last synchronous one
        # With the host apart from the device, the host steps and every gradient leaves the device as
        # the backward produces it, accumulated in fp32 on the host (:mod:`.grad_stream`).
        self.streams_grads = self.link.separate and (plan.optimizer != "none" or self.params_on_host)
        self.host_grads = HostGradients(self, engine.units, engine.precision.reduce, plan.grad_buckets) \
            if self.streams_grads else None

    # -- which tensors of a unit go to files ---------------------------------------------------------
    def _keys(self, unit) -> str:
        # The process's global rank: ranks of other pipeline stages, tp or sp groups share their
        # dp rank and unit names, and by default one directory (``<run dir>/offload``).
        return f"{self._rank}.{unit.name.replace(':', '-')}"

    def _state_tensors(self, unit) -> list[tuple[str, torch.Tensor]]:
        if self.plan.optimizer != "nvme":
            return []
        out, optimizer = [], getattr(self.engine, "optimizer", None)
        for i, (_, _, view) in enumerate(getattr(unit, "pieces", []) if optimizer is not None else []):
            for name, t in optimizer.state.get(view, {}).items():
                if torch.is_tensor(t) and t.dim() > 0:
                    out.append((f"{self._keys(unit)}.piece{i}.{name}", t))
        return out

    def _master(self, unit) -> list[tuple[str, torch.Tensor]]:
        """The fp32 master shard, where it is not the live parameter shard."""
        separate = unit.master is not unit.shard_param
        in_files_with_state = self.plan.optimizer == "nvme" and self.plan.masters != "cpu"
        if (in_files_with_state and separate) or (self.plan.params == "nvme" and not separate):
            return [(f"{self._keys(unit)}.master", unit.master)]
        return []

    def _shard(self, unit) -> list[tuple[str, torch.Tensor]]:
        if self.plan.params == "nvme" and unit.master is not unit.shard_param:
            return [(f"{self._keys(unit)}.shard", unit.shard_param)]
        return []

    def _file_bytes(self, unit) -> int:
        """Bytes of the unit's tensors kept in files (each written once at least)."""
        prefix = self._keys(unit) + "."
        return sum(n for key, n in self.store._nbytes.items() if key.startswith(prefix))

    def _optimizer_side(self, unit):
        return self._master(unit) + self._state_tensors(unit)

    def _grad_key(self, unit) -> str:
        return f"{self._keys(unit)}.grad"

    def _held_key(self, unit) -> str:
        return f"{self._keys(unit)}.held_grad"

    # -- gradients in files ------------------------------------------------------------------------
    def grad_in(self, unit) -> torch.Tensor:
        """The unit's gradient shard, in memory (zeros if it was zeroed since its last write)."""
        g = unit.grad_shard
        if id(unit) in self._zero:
            self.store.give_bytes(g, g.numel() * g.element_size())
            g.zero_()
            self._zero.discard(id(unit))
        else:
            self.store.swap_in(self._grad_key(unit), g)
        return g

    def grad_out(self, unit) -> None:
        self.store.swap_out(self._grad_key(unit), unit.grad_shard)

    def fold_grad(self, unit, reduced: torch.Tensor) -> None:
        """Add a reduced gradient (in host memory) into the unit's shard, which then goes back to its
        file (on the fold thread of :mod:`.grad_stream` when the host is apart from the device)."""
        if id(unit) in self._zero:  # nothing to add to: no read
            g = unit.grad_shard
            self.store.give_bytes(g, g.numel() * g.element_size())
            g.copy_(reduced)
            self._zero.discard(id(unit))
        else:
            self.grad_in(unit).add_(reduced)
        self.grad_out(unit)

    def zero_grad(self, unit) -> None:
        self.store.wait_for([self._grad_key(unit)])
        self.zero_grad_now(unit)

    def zero_grad_now(self, unit) -> None:
        self.store.take_bytes(unit.grad_shard)
        self._zero.add(id(unit))

    # -- moves -----------------------------------------------------------------------------------------
    def _out(self, tensors) -> None:
        for key, t in tensors:
            self.store.swap_out(key, t)

    def _in(self, tensors, wait: bool = True) -> None:
        for key, t in tensors:
            (self.store.swap_in if wait else self.store.prefetch)(key, t)

    def release(self, unit) -> None:
        """One unit's file-kept tensors to their files (waits: the memory is free on return)."""
        if self.store is not None:
            self._out(self._optimizer_side(unit) + self._shard(unit))
            self.store.wait()

    def allocate_state(self) -> None:
        """The optimizer's state allocated (its pages touched) now, unit by unit, and with the NVMe
        tier written to its files, rather than in the first step. Only AdamW's: its fresh state is
        zero moments and a zero fp32 step count on the parameter's device, which is what torch
        creates on the first step (``AdamW._init_group``), so the first step is the same; other
        optimizers keep their own lazy initialization."""
        engine = self.engine
        if engine.optim_spec.name != "adamw":
            return
        for unit in engine.units:
            for _, _, view in unit.pieces:
                engine.optimizer.state[view] = {"step": torch.zeros((), dtype=torch.float32, device=view.device),
                                                "exp_avg": torch.zeros_like(view), "exp_avg_sq": torch.zeros_like(view)}
            self.release(unit)

    def release_grad(self, unit) -> None:
        """A newly allocated (zero) gradient shard: no bytes until a reduction is folded in."""
        if self.grads_in_files:
            self.store.take_bytes(unit.grad_shard)
            self._zero.add(id(unit))

    def release_all(self) -> None:
        """After construction and after a step: everything that lives in files goes there."""
        if self.store is None:
            return
        for unit in self.engine.units:
            self._out(self._optimizer_side(unit) + self._shard(unit))
        self.store.wait()  # the memory is free when this returns
        self.store.drop_spares()

    def before_gather(self, unit) -> torch.Tensor:
        """The tensor to all-gather the unit from: its shard (read back from its file first), or,
        kept on the host, a device copy of it made now (freed by the caller after the gather)."""
        if self.store is not None and self.plan.params == "nvme" and not self._stepping:
            self._in(self._shard(unit) + (self._master(unit) if unit.master is unit.shard_param else []))
        if not self.params_on_host:
            return unit.shard_param
        on_device = torch.empty(unit.shard_numel, dtype=unit.shard_param.dtype, device=self.engine.device)
        self.link.to_device(unit.shard_param, on_device)
        self.link.wait()  # the gather (queued after this on the compute stream's order) reads the copy
        return on_device

    def after_gather(self, unit) -> None:
        if self.store is not None and self.plan.params == "nvme" and not self._stepping:
            self._out(self._shard(unit) + (self._master(unit) if unit.master is unit.shard_param else []))

    @contextlib.contextmanager
    def all_resident(self):
        """Everything in memory for the duration (the full state, its loading); a delayed
        update still running is waited for first (its masters are what is read)."""
        if self.delayed is not None:
            self.delayed.wait()
        if self.store is None or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._stepping, self._depth = True, 1
        try:
            for unit in self.engine.units:
                self._in(self._optimizer_side(unit) + self._shard(unit))
                if self.grads_in_files:
                    self.grad_in(unit)
            yield
        finally:
            self._stepping, self._depth = False, 0
            if self.grads_in_files:
                for unit in self.engine.units:
                    self.grad_out(unit)
            self.release_all()

    @contextlib.contextmanager
    def unit_resident(self, unit):
        """One unit's file-kept masters, state and parameter shard in memory for the duration (a
        checkpoint copies that unit's pieces meanwhile, or a load fills them), back in their files after; a delayed
        update still running is waited for first (its masters are what is read)."""
        if self.delayed is not None:
            self.delayed.wait()
        if self.store is None or self._depth:
            yield
            return
        self._stepping, self._depth = True, 1
        try:
            self._in(self._optimizer_side(unit) + self._shard(unit))
            yield
        finally:
            self._stepping, self._depth = False, 0
            self.release(unit)

    # -- the step, unit by unit ----------------------------------------------------------------------
    def before_step(self) -> None:
        """Start of the engine's step: a delayed update computed during this step's forward and
        backward is waited for and its weights published (the next forward computes with them)."""
        if self.delayed is not None:
            self.delayed.publish()

    def step(self, grads: list, lr: float) -> None:
        """Step each unit alone, publishing its weights before the next; with the delayed update,
        hand the (clipped) gradients to the worker thread instead and return at once."""
        if self.delayed is not None:
            self.delayed.start([self.delayed.hold(u, g) for u, g in zip(self.engine.units, grads)], lr)
            return
        start = time.perf_counter()
        self.step_units(grads, lr, publish=True)
        self.last_host_step = (start, time.perf_counter())

    def step_units(self, grads: list, lr: float, publish: bool, stop=None) -> None:
        """Step each unit alone (its pieces given their gradient, the others none); with files, the
        next units' reads overlap this unit's step. ``publish``: each unit's compute weights are
        updated after its step (the parameter shard is read in for it); the delayed update leaves
        them to :meth:`publish_all` and never touches the shards the forward is gathering. ``stop``
        (a ``threading.Event``, the delayed update's): once set, no further unit is stepped."""
        engine, units = self.engine, self.engine.units
        moved = (lambda u: self._optimizer_side(u) + self._shard(u)) if publish else self._optimizer_side
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        if self.store is not None:  # spare buffers for one unit: the next unit's reads reuse the last one's
            self.store.spare_limit = max(self._file_bytes(u) for u in units)
        self._stepping = publish
        try:
            ahead, in_flight = self.plan.prefetch_depth, []  # 0: each unit read when it is stepped
            if self.store is not None:
                for unit in units[:ahead]:
                    self._in(moved(unit), wait=False)
            for i, (unit, grad) in enumerate(zip(units, grads)):
                if stop is not None and stop.is_set():  # cancelled: its trainer is closed or gone
                    break
                if self.store is not None:
                    for nxt in units[i + 1:i + 1 + ahead]:
                        self._in(moved(nxt), wait=False)
                    self._in(moved(unit))
                if not torch.is_tensor(grad):  # still in its file, or still coming down from the device
                    grad = grad.read()
                for a, b, view in unit.pieces:
                    view.grad = grad[a:b]
                engine.optimizer.step()
                for _, _, view in unit.pieces:
                    view.grad = None
                if publish:
                    engine.publish_unit(unit)
                elif self.grads_in_files:  # the handed-over gradient is spent: no bytes, no write
                    self.store.take_bytes(grad)
                if self.store is not None:
                    written = moved(unit)
                    if self.grads_in_files and publish:  # stepped: its gradient is spent, no write needed
                        self.zero_grad_now(unit)
                    self._out(written)
                    # At most one unit's writes in flight: a slow disk must not pile units up in memory.
                    self.store.wait_for([key for key, _ in in_flight])
                    in_flight = written
            if self.store is not None:
                self.store.wait_for([key for u in units for key, _ in moved(u)])
                self.store.drop_spares()
        finally:
            self._stepping = False

    def publish_all(self) -> None:
        """The delayed update's masters into the compute weights, unit by unit (main thread: stages
        1-2 all-gather here). Masters and shards kept in files are read for it and written back."""
        moved = lambda u: self._master(u) + self._shard(u)  # noqa: E731
        units = self.engine.units
        self._stepping = True  # the gatherer must not move the shards meanwhile (it does not run now)
        try:
            if self.store is not None and units:
                self._in(moved(units[0]), wait=False)
            for i, unit in enumerate(units):
                if self.store is not None:
                    if i + 1 < len(units):
                        self._in(moved(units[i + 1]), wait=False)
                    self._in(moved(unit))
                self.engine.publish_unit(unit)
                if self.store is not None:
                    self._out(moved(unit))
            if self.store is not None:
                self.store.wait_for([key for u in units for key, _ in moved(u)])
        finally:
            self._stepping = False

    def host_grad(self, unit) -> torch.Tensor:
        """The unit's buffer for a gradient handed over to the delayed update (fp32, allocated once):
        a copy on a CPU device, or the tensor that goes to a file of its own (gradients in files)."""
        if id(unit) not in self._host_grads:
            pinned = not self.grads_in_files  # a file's tensor is freed and regrown: plain memory
            self._host_grads[id(unit)] = self.link.empty(unit.shard_numel, torch.float32, pinned=pinned)
        return self._host_grads[id(unit)]

    def host_grad_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._host_grads.values())

    def hand_over(self, unit, g: torch.Tensor) -> None:
        """Delayed update, gradients in files: the unit's (unscaled) gradient ``g`` goes to a file of
        its own for the worker, and the shard the next backward folds into starts at zero."""
        held = self.delayed.held_buffer(unit)
        self.store.wait_for([self._held_key(unit)])
        self.store.give_bytes(held, held.numel() * held.element_size())
        held.copy_(g)
        self.store.swap_out(self._held_key(unit), held)
        self.store.wait_for([self._grad_key(unit)])
        self.zero_grad_now(unit)

    def step_streaming(self, lr: float, max_norm: float, skip) -> tuple[float, bool]:
        """The engine's step with gradients in files: unscale each shard and add up its squared norm
        one unit at a time, agree on the norm (and on skipping) over every rank, then read each
        shard once more for its unit's clipped step. Returns (norm, skipped)."""
        from bigtrain.optim.clip import square_sums

        engine = self.engine
        counted = engine.placements.counted_in_norm
        parts = torch.zeros(2, dtype=torch.float32, device=engine.device)
        for unit in engine.units:
            g = self.grad_in(unit)
            if engine.scaler is not None:
                g.div_(engine.scaler.scale)
            parts += square_sums((g[a:b] for slot, a, b in unit.shard_slot_ranges() if counted(slot.name)),
                                 engine.device)
            if self.delayed is not None:  # the worker reads it from a file of its own (unused if skipped)
                self.hand_over(unit, g)
            else:
                self.grad_out(unit)
        norm, found_inf = engine.agree_on_norm(parts, skip)
        if found_inf:
            return norm, True
        scale = max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0
        self.step([_Lazy(self, unit, scale, held=self.delayed is not None) for unit in engine.units], lr)
        return norm, False

    def host_step_timing(self, start: float, end: float) -> dict[str, float]:
        """The run's overlap timeline: the host step that finished since the last call (the delayed
        update's, when it was waited for), its duration and the share of it that ran during this
        step's forward and backward [start, end] (none, unless it is delayed); {} if none finished."""
        if self.delayed is not None:
            span, self.delayed.finished = self.delayed.finished, None
        else:
            span, self.last_host_step = self.last_host_step, None
        if span is None:
            return {}
        duration = max(span[1] - span[0], 1e-9)
        hidden = max(0.0, min(span[1], end) - max(span[0], start))
        return {"step_ms": round(duration * 1e3, 3), "hidden": round(hidden / duration, 4)}

    def buffers(self) -> list[torch.Tensor]:
        """The offload's own buffers: the gradients' host buffers and buckets, the staging ring."""
        streamed = self.host_grads.buffers() if self.host_grads is not None else []
        return list(self._host_grads.values()) + streamed + self.link.buffers()

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes this rank's offload keeps in host memory (``host``) and in files (``nvme``). Kept
        apart from the device (a GPU, or ``separate_host``): the engine's host tier as measured
        (:mod:`.tiers`). On a CPU device: the optimizer's state, masters apart from the compute
        weights and handed-over gradients, as far as they are resident (the host is the device)."""
        if self.link.separate:
            tiers = held_bytes(self.engine)
            return {"host": tiers["host"], "nvme": tiers["nvme"]}
        host = 0
        if self.plan.optimizer != "none":
            tensors = [t for u in self.engine.units for _, t in self._host_side(u)]
            host = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())
            host += self.host_grad_bytes()
        return {"host": host, "nvme": self.store.stored_bytes if self.store is not None else 0}

    def _host_side(self, unit) -> list[tuple[str, torch.Tensor]]:
        optimizer = getattr(self.engine, "optimizer", None)
        out = [("master", unit.master)] if unit.master is not unit.shard_param else []
        for _, _, view in unit.pieces if optimizer is not None else []:
            out += [(k, t) for k, t in list(optimizer.state.get(view, {}).items()) if torch.is_tensor(t) and t.dim()]
        return out

    def close(self) -> None:
        if self.host_grads is not None:
            self.host_grads.close()
        if self.delayed is not None:
            self.delayed.close()
        self.link.close()
        if self.store is not None:
            self.store.close()


class _Lazy:
    """A unit's gradient shard still in its file: read (and clipped) when its unit is stepped."""

    def __init__(self, offload: UnitOffload, unit, scale: float, held: bool = False):
        self.offload, self.unit, self.scale, self.held = offload, unit, scale, held

    def read(self) -> torch.Tensor:
        if self.held:  # handed over to the delayed update: its own file
            g = self.offload.delayed.held_buffer(self.unit)
            self.offload.store.swap_in(self.offload._held_key(self.unit), g)
        else:
            g = self.offload.grad_in(self.unit)
        if self.scale != 1.0:
            g.mul_(self.scale)
        return g
