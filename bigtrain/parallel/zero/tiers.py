"""What a ZeRO engine holds, by tier: the compute device, host memory, NVMe files.

Measured, not derived from the configuration: every buffer the engine and its offload own is
counted once (by storage) in the tier its tensor lives in (``HostLink.tier_of``: a tensor's device
on a GPU; on a CPU device, whether the host tier made or adopted it), at its current size (a
tensor kept in a file, or a freed ZeRO-3 gather, has no bytes in memory); the files are what the
NVMe store holds. The planner predicts the same three numbers (:mod:`bigtrain.plan.tiers`).
"""

from __future__ import annotations

from typing import Iterator

import torch

TIERS = ("device", "host", "nvme")


def _buffers(engine) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(kind, tensor, the tensor whose place it shares) for every buffer: kinds ``params``,
    ``grads``, ``optimizer`` (masters apart from the compute weights, and the state, which lives
    where its parameter piece does) and ``offload`` (gradient buckets, host buffers, staging)."""
    for unit in engine.units:
        for t in (unit.full, unit.shard_param):
            yield "params", t, t
        if unit.master is not unit.shard_param:
            yield "optimizer", unit.master, unit.master
        for t in (getattr(unit, "full_grad", None), unit.grad_shard):
            yield "grads", t, t
        for _, _, view in unit.pieces:
            for value in list(engine.optimizer.state.get(view, {}).values()):
                yield "optimizer", value, view
    for p in engine.params:
        yield "grads", p.grad, p.grad
    for t in engine.offload.buffers() if engine.offload is not None else []:
        yield "offload", t, t


def _tier(engine, where_from: torch.Tensor) -> str:
    return engine.offload.link.tier_of(where_from) if engine.offload is not None else "device"


def _counted(engine, keep) -> dict[str, int]:
    """Bytes by kind of the distinct storages ``keep(kind, tier)`` selects."""
    seen: dict[int, tuple[str, int]] = {}
    for kind, t, where_from in _buffers(engine):
        if t is None or not torch.is_tensor(t) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage._cdata not in seen and keep(kind, _tier(engine, where_from)):
            seen[storage._cdata] = (kind, storage.nbytes())
    out: dict[str, int] = {}
    for kind, nbytes in seen.values():
        out[kind] = out.get(kind, 0) + nbytes
    return out


def held_bytes(engine) -> dict[str, int]:
    """{"device", "host", "nvme"}: bytes of this rank's model states and offload buffers."""
    out = {tier: sum(_counted(engine, lambda kind, where, tier=tier: where == tier).values())
           for tier in ("device", "host")}
    store = engine.offload.store if engine.offload is not None else None
    out["nvme"] = store.stored_bytes if store is not None else 0
    return out


def state_bytes(engine) -> dict[str, int]:
    """{"params", "grads", "optimizer"} of :func:`held_bytes`'s buffers, by kind: on the device when
    offload keeps a host apart from it (a GPU: the host's are in :func:`held_bytes` alone), else
    everything in memory (the host is the device: the sum is ``device + host``). Offload's own
    buffers count as gradients (the gradient buckets, the delayed update's handed-over gradients)."""
    apart = engine.offload is not None and engine.offload.link.separate
    counted = _counted(engine, lambda kind, where: where == "device" or not apart)
    return {"params": counted.get("params", 0), "grads": counted.get("grads", 0) + counted.get("offload", 0),
            "optimizer": counted.get("optimizer", 0)}
