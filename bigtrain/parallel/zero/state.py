"""Full, layout-independent state of a ZeRO engine: gather shards into per-parameter tensors, or
cut per-parameter tensors into this rank's shards. Used by checkpoints, so a run saved with one
stage and world size resumes under any other.

The optimizer's state comes in three kinds (:class:`~bigtrain.optim.spec.StateTensor`): per element
(gathered and cut like the weights), per block of the flattened parameter (the unit is laid out so
cuts fall on block boundaries: in units of blocks it is a flat layout like the elements', with every
offset divided by the block), and per tensor (alike on every piece of a parameter: copied). An
elementwise optimizer holds at most two flat pieces per unit, sharing their per-tensor state (a step
count); any other holds one piece per parameter in the shard (``unit.piece_slots``), each with its
own per-tensor state, which only the ranks holding part of that parameter have.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from bigtrain.optim.loading import declared_dtypes, load_state
from bigtrain.parallel.zero.flat import FlatUnit
from bigtrain.parallel.chunks import WEIGHT, WEIGHT_IN_USE, Piece


def _gather_flat(engine, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
    shard = shard.to(engine.device)  # a host master (offload) goes through the device's collective
    full = torch.empty(shard.numel() * unit.shards, dtype=shard.dtype, device=shard.device)
    unit.comm.all_gather(full, shard.contiguous(), tag="checkpoint") if unit.shards > 1 else full.copy_(shard)
    return full


def _piece_states(engine, unit: FlatUnit) -> list[dict] | None:
    """The optimizer's state of each piece of the unit's shard, checked against the declared names;
    None before the first step (every rank agrees: they step together)."""
    states = [engine.optimizer.state.get(view) for _, _, view in unit.pieces]
    if not all(states):
        return None
    for state in states:
        engine.optim_spec.check_state(state, f"the optimizer's state of unit {unit.name}")
    return states


def _slot_of_piece(unit: FlatUnit) -> list:
    """The slot each optimizer piece belongs to (None for the flat pieces of an elementwise one)."""
    return getattr(unit, "piece_slots", [None] * len(unit.pieces))


def _gather_by_name(engine, shard_of) -> dict[str, torch.Tensor]:
    """``shard_of(unit)`` of every unit gathered over the shards, as full per-parameter CPU tensors."""
    out = {}
    for unit in engine.units:
        out.update({k: v.clone().cpu() for k, v in unit.unflatten(_gather_flat(engine, unit, shard_of(unit))).items()})
    return out


def full_weights(engine) -> dict[str, torch.Tensor]:
    """fp32 (master) weights by name, complete on every rank (collective)."""
    with _resident(engine):
        return _gather_by_name(engine, lambda unit: unit.master)


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Reduced gradients by name in fp32, unscaled and before clipping: what the optimizer step is
    about to use, complete on every rank (collective; call between finish_grad_sync and step)."""
    scale = engine.scaler.scale if engine.scaler is not None else 1.0
    with _resident(engine):
        return _gather_by_name(engine, lambda unit: unit.grad_shard.float() / scale)


# -- the block layout of a unit ------------------------------------------------------------------------
def _block(engine, unit: FlatUnit) -> int:
    return unit.align


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _shard_of_states(unit: FlatUnit, states: list[dict], key: str, per_block: int = 0) -> torch.Tensor:
    """The unit's shard of one state tensor (in elements, or in blocks of ``per_block``), each
    piece's part written where the piece lies, zeros in the gaps between parameters."""
    scale = per_block or 1
    first = states[0][key]
    shard = torch.zeros(unit.shard_numel // scale, dtype=first.dtype, device=first.device)
    for (a, b, _), state in zip(unit.pieces, states):
        lo = a // scale
        shard[lo:lo + state[key].numel()].copy_(state[key].reshape(-1))
    return shard


def _per_slot_tensor_state(engine, unit: FlatUnit, states: list[dict]) -> dict[str, dict]:
    """{slot name: per-tensor state} for every parameter of the unit: flat pieces share theirs (a
    step count); otherwise each parameter has its piece on every rank (empty where the shard holds
    none of it), so every rank holds every parameter's per-tensor state."""
    keys, slots = engine.optim_spec.tensor_state, _slot_of_piece(unit)
    if slots and slots[0] is None:
        shared = {k: states[0][k].cpu() for k in keys}
        return {slot.name: shared for slot in unit.slots}
    return {slot.name: {k: state[k].cpu() for k in keys} for slot, state in zip(slots, states)}


def _resident(engine):
    """Offloaded masters and state read back for the duration (nothing to do without offload)."""
    return engine.offload.all_resident() if engine.offload is not None else contextlib.nullcontext()


def full_state(engine) -> tuple[dict[str, torch.Tensor], dict]:
    """(fp32 weights by name, optimizer state by name), complete on every rank (collective). Block
    state comes out flat, one value per block of the parameter's (tp-local) elements."""
    with _resident(engine):
        return _full_state(engine)


def _full_state(engine) -> tuple[dict[str, torch.Tensor], dict]:
    spec = engine.optim_spec
    weights, state = full_weights(engine), {}
    for unit in engine.units:
        pieces = _piece_states(engine, unit)
        if pieces is None:
            continue
        per_tensor = _per_slot_tensor_state(engine, unit, pieces)
        per_element = {k: unit.unflatten(_gather_flat(engine, unit, _shard_of_states(unit, pieces, k)))
                       for k in spec.element_state}
        block = _block(engine, unit)
        per_block = {k: _gather_flat(engine, unit, _shard_of_states(unit, pieces, k, block))
                     for k in spec.block_state}
        for slot in unit.slots:
            entry = {k: v.clone() for k, v in per_tensor[slot.name].items()}
            entry.update({k: per_element[k][slot.name].clone().cpu() for k in spec.element_state})
            lo = slot.offset // block
            entry.update({k: v[lo:lo + _blocks(slot.numel, block)].clone().cpu() for k, v in per_block.items()})
            state[slot.name] = entry
    return weights, {"optimizer": spec.name, "state": state}


def _piece_range(unit: FlatUnit, slot, a: int, b: int) -> tuple[int, int]:
    """The range of the parameter ``slot`` that shard range [a, b) holds."""
    first = unit.shard_start + a - slot.offset
    return first, first + b - a


def load_full_state(engine, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
    """Cut saved full tensors into this rank's shards (no communication)."""
    with _resident(engine):
        _load_full_state(engine, weights, optim_state)


def _load_full_state(engine, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
    spec = engine.optim_spec
    saved = spec.saved_state(optim_state)
    dev, states = engine.host_device, {}  # where the masters and the optimizer's state live
    for unit in engine.units:
        unit.master.copy_(unit.shard_from_full_values(lambda n: weights[n], torch.float32, dev))
        first = unit.slots[0].name
        if first not in saved:
            continue
        per_element = {k: unit.shard_from_full_values(lambda n, k=k: saved[n][k], saved[first][k].dtype, dev)
                       for k in spec.element_state}
        block = _block(engine, unit)
        for (a, b, view), slot in zip(unit.pieces, _slot_of_piece(unit)):
            entry = saved[first] if slot is None else saved[slot.name]
            state = {k: entry[k].clone().to(dev) if entry[k].dim() else entry[k].clone()
                     for k in spec.tensor_state}
            state.update({k: per_element[k][a:b].clone() for k in spec.element_state})
            state.update({k: torch.zeros(0, dtype=entry[k].dtype, device=dev) for k in spec.block_state})
            if slot is not None and spec.block_state and a < b:
                lo, hi = _piece_range(unit, slot, a, b)
                state.update({k: entry[k].reshape(-1)[lo // block:_blocks(hi, block)].clone().to(dev)
                              for k in spec.block_state})
            states[view] = state
    if states:
        load_state(engine.optimizer, states, engine.optim_spec)
    engine.refresh_compute_weights()


# -- sharded checkpoints: what this rank holds, without gathering anything --------------------------
def _piece_index(unit: FlatUnit, a: int, b: int) -> int:
    """The optimizer piece holding shard range [a, b) (a parameter never straddles the decay split)."""
    return next(i for i, (pa, pb, _) in enumerate(unit.pieces) if pa <= a and b <= pb)


def checkpoint_pieces(engine):
    """Per unit, one :class:`Piece` for each parameter overlapping this rank's shard: views of its
    fp32 master range and of the optimizer's per-element and per-block state over it (no copies).
    With offload's files, only the unit whose batch is out is read in (the caller copies it before
    asking for the next): reading every unit in for the whole save held the states in memory
    twice over, with their copies (a run whose states were all in files peaked at 3.5x its
    training peak saving them)."""
    if engine.offload is None:
        yield from _checkpoint_pieces(engine, engine.units)
        return
    for unit in engine.units:
        with engine.offload.unit_resident(unit):
            yield from _checkpoint_pieces(engine, [unit])


def checkpoint_units(engine):
    """:func:`checkpoint_pieces` with offload's files, each batch with the context manager that
    reads its unit back in (``SavedChunk.readable``): the writer reads each chunk when it writes
    it, so the save holds no copy of the rank's states (their copies were all in memory until
    written, the whole rank's masters and state)."""
    for unit in engine.units:
        with engine.offload.unit_resident(unit):
            for batch in _checkpoint_pieces(engine, [unit]):
                yield batch, functools.partial(engine.offload.unit_resident, unit)


def _delayed(engine) -> bool:
    return engine.offload is not None and engine.offload.delayed is not None


def _checkpoint_pieces(engine, units):

    spec = engine.optim_spec
    for unit in units:
        # A unit not cut into shards is held whole by each rank of its group: each writes a part.
        replicas, replica = (1, 0) if unit.shards > 1 else (unit.comm.size, unit.comm.rank)
        states = _piece_states(engine, unit)
        batch = []
        for slot, a, b in unit.shard_slot_ranges():
            lo, hi = _piece_range(unit, slot, a, b)
            tensors, scalars, blocks = {WEIGHT: unit.master[a:b]}, {}, {}
            if _delayed(engine):  # the compute weights, one update behind the masters
                tensors[WEIGHT_IN_USE] = unit.shard_param[a:b].to(unit.master.device, torch.float32)
            if states is not None:
                i = _piece_index(unit, a, b)
                pa = unit.pieces[i][0]
                tensors.update({k: states[i][k].view(-1)[a - pa:b - pa] for k in spec.element_state})
                scalars = {k: states[i][k] for k in spec.tensor_state}
                blocks = {k: states[i][k] for k in spec.block_state}  # a piece per parameter: all of it
            batch.append(Piece(slot.name, slot.shape, lo, hi, tensors, scalars, replicas, replica, blocks, unit.align))
        yield batch


def checkpoint_load_batches(engine, with_state: bool):
    """Per unit, :class:`Piece` s whose tensors are this rank's master shard and fresh optimizer
    state (zeros) to be filled by the caller; once the caller has filled a batch, its unit's
    optimizer gets the state and its compute weights are refreshed. Each piece's ``scalars`` are
    filled with its parameter's per-tensor state (flat pieces of an elementwise optimizer share their
    first parameter's). With offload's files, only the unit being read is in memory (as for a save:
    :func:`checkpoint_pieces`): reading every unit back for the whole load held the states as a run
    without offload does (1.21 GiB peak RSS for a run whose training peak is 0.52 GiB)."""
    offload = engine.offload
    if offload is not None and offload.delayed is not None:
        offload.delayed.wait()  # an update still running writes the masters being replaced
    if with_state:  # replaced unit by unit below: neither read back from files nor held twice
        engine.optimizer.state.clear()
    engine.drop_gathered()
    in_use = False
    for unit in engine.units:
        with offload.unit_resident(unit) if offload is not None else contextlib.nullcontext():
            in_use = yield from _load_unit(engine, unit, with_state)
    if offload is not None and offload.delayed is not None:
        # A delayed update's run: its next step computes with the saved weights in use.
        offload.delayed.unpublished = in_use


def _load_unit(engine, unit: FlatUnit, with_state: bool):
    """One unit's batch (see :func:`checkpoint_load_batches`); once it is filled, the optimizer's
    state of its pieces and its compute weights (the saved weights in use of a delayed update's run,
    else the masters). Returns whether the weights in use were in the checkpoint."""
    spec, dev = engine.optim_spec, engine.host_device
    declared = declared_dtypes(spec)
    block = unit.align
    fresh = [{k: torch.zeros(b - a, dtype=declared[k], device=dev) for k in spec.element_state}
             | {k: torch.zeros(_blocks(b - a, block), dtype=declared[k], device=dev) for k in spec.block_state}
             for a, b, _ in unit.pieces] if with_state else []
    batch, holder = [], []
    use = torch.empty(unit.shard_numel, dtype=torch.float32, device=dev) if _delayed(engine) else None
    for slot, a, b in unit.shard_slot_ranges():
        lo, hi = _piece_range(unit, slot, a, b)
        tensors, blocks = {WEIGHT: unit.master[a:b]}, {}
        if use is not None:
            tensors[WEIGHT_IN_USE] = use[a:b]
        i = _piece_index(unit, a, b) if unit.pieces else None
        if with_state:
            pa = unit.pieces[i][0]
            tensors.update({k: fresh[i][k][a - pa:b - pa] for k in spec.element_state})
            blocks = {k: fresh[i][k] for k in spec.block_state}
        batch.append(Piece(slot.name, slot.shape, lo, hi, tensors, {}, 1, 0, blocks, block))
        holder.append(i)
    # The carrier holds no range; it also says, alike on every rank, whether the weights in use
    # were in the checkpoint (the loader drops the entry where they were not).
    carrier = Piece(unit.slots[0].name, unit.slots[0].shape, 0, 0, {WEIGHT_IN_USE: use} if use is not None else {})
    batch.append(carrier)
    per_piece = {i: piece for piece, i in zip(batch, holder) if i is not None}
    for i, ((a, b, _), slot) in enumerate(zip(unit.pieces, _slot_of_piece(unit))):
        if slot is not None and i not in per_piece:  # an empty piece: its per-tensor state only
            per_piece[i] = Piece(slot.name, slot.shape, 0, 0, {})
            batch.append(per_piece[i])
    yield batch
    if with_state:
        states = {}
        for i, ((_, _, view), values) in enumerate(zip(unit.pieces, fresh)):
            source = carrier if _slot_of_piece(unit)[i] is None else per_piece[i]
            states[view] = {**{k: source.scalars[k].clone() for k in spec.tensor_state}, **values}
        if states:
            kept = dict(engine.optimizer.state)  # load_state leaves the optimizer only the states it is given
            load_state(engine.optimizer, states, spec)
            engine.optimizer.state.update({p: s for p, s in kept.items() if p not in states})
    in_use = WEIGHT_IN_USE in carrier.tensors
    engine.publish_unit(unit, use if in_use else None)
    return in_use
