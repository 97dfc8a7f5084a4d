"""A ZeRO engine's buffers on this rank, unit by unit, from a model built on the meta device.

Each unit's parameters get their initial values once each (a thread pool: a CPU random draw runs on
one core, and each value depends on its name only, so the order does not matter), from which the
fp32 master shard (on the host with offload) and the compute weights (the whole unit below ZeRO-3,
the shard at ZeRO-3) are cut; then its gradient buffer (with offload on a GPU: the fp32 accumulator
on the host, :mod:`.grad_stream`) and the views the optimizer is given. With offload the host tier's
tensors are counted as such (``HostLink.adopt``), files are written before the next unit is
allocated, and the pinned staging ring is allocated once, at the end.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from bigtrain.parallel.zero.flat import FlatUnit
from bigtrain.parallel.zero.units import replace_parameters

InitFn = Callable[[str, tuple], torch.Tensor]  # (name, shape) -> full fp32 value


def allocate_units(engine, init_fn: InitFn) -> None:
    """Every unit's buffers on this rank, one unit at a time (the model was built on the meta device)."""
    compute, dev = engine.precision.compute, engine.device
    # ZeRO-3 shards kept on the host (offload.params on a GPU) or on the device.
    shard_dev = engine.host_device if engine.offload is not None and engine.offload.params_on_host else dev
    with ThreadPoolExecutor(max_workers=_init_threads(), thread_name_prefix="bigtrain-init") as pool:
        for unit in engine.units:
            _allocate_unit(engine, unit, init_fn, pool, shard_dev)
    if engine.offload is not None and engine.offload.link.separate:  # pinned once, up front
        engine.offload.link.reserve_staging(max(u.shard_numel for u in engine.units), compute)


def _allocate_unit(engine, unit: FlatUnit, init_fn: InitFn, pool: ThreadPoolExecutor, shard_dev) -> None:
    """One unit's buffers, its parameters' initial values computed once each (threads: a CPU
    random draw runs on one core, and each value depends on its name only, not on the order)."""
    compute, dev = engine.precision.compute, engine.device
    needed = unit.slots if engine.stage < 3 else [slot for slot, _, _ in unit.shard_slot_ranges()]
    values = dict(zip([s.name for s in needed], pool.map(lambda s: init_fn(s.name, s.shape), needed)))
    master = _on_host(engine, unit.shard_from_full_values(values.__getitem__, torch.float32, engine.host_device))
    if engine.stage == 3:
        full = torch.empty(unit.padded_numel, dtype=compute, device=dev)
        unit.shard_param = master if not engine._separate_master else master.to(shard_dev, compute, copy=True)
        if engine.offload is not None and engine.offload.params_on_host:
            _on_host(engine, unit.shard_param)
    else:
        full = unit.flatten(values, compute, dev)
        unit.shard_param = unit.shard_of(full)
    del values
    replace_parameters(engine.model, unit.bind(full))
    if engine.stage == 3:
        unit.free_full()
    unit.master = master if engine._separate_master else unit.shard_param
    _cut_pieces(engine, unit)
    if engine.offload is not None:  # to its file before the next unit is allocated
        engine.offload.release(unit)
    _allocate_grads(engine, unit)
    if engine.offload is not None:
        engine.offload.release_grad(unit)


def _on_host(engine, t: torch.Tensor) -> torch.Tensor:
    """``t``, counted in the host tier when offload keeps it apart from the device."""
    if engine.offload is not None and engine.offload.link.separate and t.device == engine.host_device:
        engine.offload.link.adopt(t)
    return t


def _allocate_grads(engine, unit: FlatUnit) -> None:
    if engine._host_grads is not None:  # the fp32 gradient lives on the host; the device has buckets
        unit.grad_shard = engine._host_grads.accumulator(unit)
        return
    if engine.stage >= 2:
        # Gradients in files (ZeRO-Infinity) are host tensors: reductions come down to be folded in.
        in_files = engine.offload is not None and engine.offload.grads_in_files
        unit.grad_shard = torch.zeros(unit.shard_numel, dtype=torch.float32,
                                      device=engine.host_device if in_files else engine.device)
        return
    unit.full_grad = torch.zeros(unit.padded_numel, dtype=torch.float32, device=engine.device)
    views = unit.unflatten(unit.full_grad)
    unit.grad_views = [views[slot.name] for slot in unit.slots]
    if engine._grads_in_place:
        for p, view in zip(unit.params, unit.grad_views):
            p.grad = view
    unit.grad_shard = unit.shard_of(unit.full_grad)


def _cut_pieces(engine, unit: FlatUnit) -> None:
    """The views of the unit's master shard the optimizer will be given (made while the master
    is in memory: an offloaded one is not, later)."""
    if engine.optim_spec.elementwise:
        ranges = unit.shard_pieces()
        unit.piece_slots = [None] * len(ranges)
    else:
        held = {slot.name: (a, b) for slot, a, b in unit.shard_slot_ranges()}
        ranges = [(*held.get(slot.name, (_empty_at(unit, slot),) * 2), slot.decay) for slot in unit.slots]
        unit.piece_slots = list(unit.slots)
    unit.pieces = [(a, b, unit.master[a:b]) for a, b, _ in ranges]
    unit.piece_decay = [is_decay for _, _, is_decay in ranges]


def _init_threads() -> int:
    """Threads computing initial values: the cores this process may use, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores))


def _empty_at(unit: FlatUnit, slot) -> int:
    """Where in the shard an empty piece of a parameter the shard does not hold goes (keeps order)."""
    return min(max(slot.offset - unit.shard_start, 0), unit.shard_numel)
