"""Full, layout-independent state of a ZeRO engine: gather shards into per-parameter tensors, or
cut per-parameter tensors into this rank's shards. Used by checkpoints, so a run saved with one
stage and world size resumes under any other."""

from __future__ import annotations

import torch

from bigtrain.optim import load_state
from bigtrain.parallel.zero.flat import FlatUnit


def _gather_flat(engine, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
    full = torch.empty(unit.padded_numel, dtype=shard.dtype, device=shard.device)
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


def _gather_by_name(engine, shard_of) -> dict[str, torch.Tensor]:
    """``shard_of(unit)`` of every unit gathered over the shards, as full per-parameter CPU tensors."""
    out = {}
    for unit in engine.units:
        out.update({k: v.clone().cpu() for k, v in unit.unflatten(_gather_flat(engine, unit, shard_of(unit))).items()})
    return out


def full_weights(engine) -> dict[str, torch.Tensor]:
    """fp32 (master) weights by name, complete on every rank (collective)."""
    return _gather_by_name(engine, lambda unit: unit.master)


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Reduced gradients by name in fp32, unscaled and before clipping: what the optimizer step is
    about to use, complete on every rank (collective; call between finish_grad_sync and step)."""
    scale = engine.scaler.scale if engine.scaler is not None else 1.0
    return _gather_by_name(engine, lambda unit: unit.grad_shard.float() / scale)


def full_state(engine) -> tuple[dict[str, torch.Tensor], dict]:
    """(fp32 weights by name, optimizer state by name), complete on every rank (collective). The
    optimizer's ``per="element"`` state is gathered and cut by parameter like the weights; its
    ``per="tensor"`` state (one value per piece, alike on every piece) is copied to each parameter."""
    spec = engine.optim_spec
    weights, state = full_weights(engine), {}
    for unit in engine.units:
        pieces = _piece_states(engine, unit)
        if pieces is None:
            continue
        per_tensor = {k: pieces[0][k] for k in spec.tensor_state}
        per_element = {k: unit.unflatten(_gather_flat(engine, unit, torch.cat([s[k] for s in pieces])))
                       for k in spec.element_state}
        for slot in unit.slots:
            state[slot.name] = {**{k: v.clone().cpu() for k, v in per_tensor.items()},
                                **{k: per_element[k][slot.name].clone().cpu() for k in spec.element_state}}
    return weights, {"optimizer": spec.name, "state": state}


def load_full_state(engine, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
    """Cut saved full tensors into this rank's shards (no communication)."""
    spec = engine.optim_spec
    saved = spec.saved_state(optim_state)
    dev, states = engine.device, {}
    for unit in engine.units:
        unit.master.copy_(unit.shard_from_full_values(lambda n: weights[n], torch.float32, dev))
        first = unit.slots[0].name
        if first not in saved:
            continue
        per_element = {k: unit.shard_from_full_values(lambda n, k=k: saved[n][k], saved[first][k].dtype, dev)
                       for k in spec.element_state}
        for a, b, view in unit.pieces:
            states[view] = {**{k: saved[first][k].clone() for k in spec.tensor_state},
                            **{k: per_element[k][a:b].clone() for k in spec.element_state}}
    if states:
        load_state(engine.optimizer, states)
    engine.refresh_compute_weights()


# -- sharded checkpoints: what this rank holds, without gathering anything --------------------------
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
           "uint8": torch.uint8}


def _piece_index(unit: FlatUnit, a: int, b: int) -> int:
    """The optimizer piece holding shard range [a, b) (a parameter never straddles the decay split)."""
    return next(i for i, (pa, pb, _) in enumerate(unit.pieces) if pa <= a and b <= pb)


def checkpoint_pieces(engine):
    """Per unit, one :class:`Piece` for each parameter overlapping this rank's shard: views of its
    fp32 master range and of the optimizer's per-element state over it (no copies)."""
    from bigtrain.checkpoint.chunks import WEIGHT, Piece

    spec = engine.optim_spec
    for unit in engine.units:
        # A unit not cut into shards is held whole by each rank of its group: each writes a part.
        replicas, replica = (1, 0) if unit.shards > 1 else (unit.comm.size, unit.comm.rank)
        states = _piece_states(engine, unit)
        batch = []
        for slot, a, b in unit.shard_slot_ranges():
            first = unit.shard_start + a - slot.offset
            tensors, scalars = {WEIGHT: unit.master[a:b]}, {}
            if states is not None:
                i = _piece_index(unit, a, b)
                pa = unit.pieces[i][0]
                tensors.update({k: states[i][k][a - pa:b - pa] for k in spec.element_state})
                scalars = {k: states[i][k] for k in spec.tensor_state}
            batch.append(Piece(slot.name, slot.shape, first, first + b - a, tensors, scalars, replicas, replica))
        yield batch


def checkpoint_load_batches(engine, with_state: bool):
    """Per unit, :class:`Piece` s whose tensors are this rank's master shard and fresh optimizer
    state (zeros) to be filled by the caller; after the last batch the optimizer gets the state and
    the compute weights are refreshed. The last piece of each batch, with an empty range, asks for
    the unit's per-tensor state (alike on every piece: a step count)."""
    from bigtrain.checkpoint.chunks import WEIGHT, Piece

    spec, dev, states = engine.optim_spec, engine.device, {}
    declared = {s.name: _DTYPES[s.dtype] for s in spec.state}
    if with_state:  # replaced below: do not hold the old and the loaded state at once
        engine.optimizer.state.clear()
    for unit in engine.units:
        fresh = [{k: torch.zeros(b - a, dtype=declared[k], device=dev) for k in spec.element_state}
                 for a, b, _ in unit.pieces] if with_state else []
        batch = []
        for slot, a, b in unit.shard_slot_ranges():
            first = unit.shard_start + a - slot.offset
            tensors = {WEIGHT: unit.master[a:b]}
            if with_state:
                i = _piece_index(unit, a, b)
                pa = unit.pieces[i][0]
                tensors.update({k: fresh[i][k][a - pa:b - pa] for k in spec.element_state})
            batch.append(Piece(slot.name, slot.shape, first, first + b - a, tensors))
        carrier = Piece(unit.slots[0].name, unit.slots[0].shape, 0, 0, {})
        batch.append(carrier)
        yield batch
        if with_state:
            for (_, _, view), values in zip(unit.pieces, fresh):
                states[view] = {**{k: carrier.scalars[k].clone() for k in spec.tensor_state}, **values}
    if states:
        load_state(engine.optimizer, states)
    engine.refresh_compute_weights()
