"""Full, layout-independent state of a ZeRO engine: gather shards into per-parameter tensors, or
cut per-parameter tensors into this rank's shards. Used by checkpoints, so a run saved with one
stage and world size resumes under any other."""

from __future__ import annotations

import torch

from bigtrain.parallel.zero.flat import FlatUnit

MOMENTS = ("exp_avg", "exp_avg_sq")


def _gather_flat(engine, unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
    full = torch.empty(unit.padded_numel, dtype=shard.dtype, device=shard.device)
    engine.comm.all_gather(full, shard.contiguous(), tag="checkpoint") if unit.shards > 1 else full.copy_(shard)
    return full


def _moment_shard(engine, unit: FlatUnit, key: str) -> torch.Tensor | None:
    pieces = [engine.optimizer.state.get(view, {}).get(key) for _, _, view in unit.pieces]
    if any(p is None for p in pieces):
        return None
    return torch.cat(pieces) if pieces else torch.zeros(0, device=unit.master.device)


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
    """(fp32 weights by name, optimizer state by name), complete on every rank (collective)."""
    weights, state = full_weights(engine), {}
    for unit in engine.units:
        step = next((engine.optimizer.state[v]["step"] for _, _, v in unit.pieces if v in engine.optimizer.state), None)
        if step is None:
            continue
        moments = {}
        for key in MOMENTS:
            shard = _moment_shard(engine, unit, key)
            moments[key] = unit.unflatten(_gather_flat(engine, unit, shard))
        for slot in unit.slots:
            state[slot.name] = {"step": step.clone().cpu(), **{k: moments[k][slot.name].clone().cpu() for k in MOMENTS}}
    return weights, {"state": state}


def load_full_state(engine, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
    """Cut saved full tensors into this rank's shards (no communication)."""
    saved = optim_state.get("state", {})
    dev = engine.device
    for unit in engine.units:
        unit.master.copy_(unit.shard_from_full_values(lambda n: weights[n], torch.float32, dev))
        if not saved or unit.slots[0].name not in saved:
            continue
        moments = {k: unit.shard_from_full_values(lambda n, k=k: saved[n][k], torch.float32, dev) for k in MOMENTS}
        step = saved[unit.slots[0].name]["step"]
        for a, b, view in unit.pieces:
            engine.optimizer.state[view] = {"step": step.clone(), **{k: moments[k][a:b].clone() for k in MOMENTS}}
    engine.refresh_compute_weights()
