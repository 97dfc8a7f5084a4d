"""Measured memory: bytes of parameters, gradients, optimizer state, and activations saved for backward.

CPU torch has no allocator statistics, so states are measured by summing live tensors, counting
each storage once, and activations by watching what autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), excluding parameters and their views.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> int:
    """The identity of the storage behind ``t``: the storage object, not its address, which
    changes when ZeRO-3 frees and re-gathers a parameter buffer in place."""
    if hasattr(t, "to_local"):  # DTensor: account the local shard
        t = t.to_local()
    return t.untyped_storage()._cdata


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a shared storage counts once)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[_storage_key(local)] = local.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # Snapshots (list() of a dict is one step under the GIL): a delayed offloaded update may be
    # adding state on its worker thread meanwhile.
    return [v for state in list(optimizer.state.values()) for v in list(state.values()) if torch.is_tensor(v)]


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of parameters, gradients and optimizer state on this rank."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(optimizer_tensors(optimizer)) if optimizer is not None else 0,
    }


class SavedActivations:
    """Context manager counting the distinct bytes autograd saves for backward, minus parameters.

    ``peak`` is the most held at once across :meth:`reset` boundaries (call reset after each
    micro-batch's backward, when the saved tensors are freed).
    """

    def __init__(self, model: nn.Module | None = None, extra_exclude: Iterable[torch.Tensor] = ()):
        excluded = list(model.parameters()) + list(model.buffers()) if model is not None else []
        excluded += list(extra_exclude)
        self._excluded = {_storage_key(t) for t in excluded if t.device.type != "meta"}
        # key -> (bytes, the storage): holding the storage keeps its key from being reused. A
        # tensor saved by a graph that is dropped during the forward (a router's side computation)
        # is freed there, and a later storage could be allocated with the same C++ address and
        # counted as already seen: 544 bytes short of the planner's figure in one CI run out of many.
        self._seen: dict[int, tuple[int, torch.UntypedStorage]] = {}
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = _storage_key(t)
            if key not in self._excluded and key not in self._seen:
                storage = t.untyped_storage()
                self._seen[key] = (storage.nbytes(), storage)
                self.peak = max(self.peak, self.current)
        return t

    @property
    def current(self) -> int:
        return sum(nbytes for nbytes, _ in self._seen.values())

    def reset(self) -> None:
        self._seen.clear()

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
