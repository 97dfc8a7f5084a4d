"""One ZeRO unit: a group of parameters laid end to end in a flat buffer and cut into equal shards.

The flat length is padded to a multiple of the group size, so every rank's shard has the same
length (Gloo cannot all-gather uneven tensors) and a shard may start or end inside a parameter.
Each parameter of the model becomes a view into the unit's full compute buffer; ZeRO-3 frees that
buffer by shrinking its storage to zero bytes and gathers it again into the same storage, so the
views, the autograd graph's saved references to them and the module structure all stay valid.

Inside a unit, parameters with weight decay come first, so the optimizer sees at most two pieces
of each shard (decayed and not) and can use plain per-group hyper-parameters.

``align`` (an optimizer's block size, :meth:`OptimizerSpec.alignment`): every parameter starts at a
multiple of it and the shards are a multiple of it long, so every cut falls on a block boundary
counted from the parameter's first element (the gaps between parameters are padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the unit's flat space."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    decay: bool


def _decays(param: nn.Parameter) -> bool:
    return param.ndim >= 2


class FlatUnit:
    """Layout and buffers of one unit on one rank (``shards`` ranks share its state)."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], shards: int, shard_rank: int,
                 align: int = 1):
        ordered = sorted(named_params, key=lambda item: not _decays(item[1]))  # stable: decayed first
        self.name, self.shards, self.shard_rank, self.align = name, shards, shard_rank, align
        self.params = [p for _, p in ordered]
        self.slots, offset = [], 0
        for pname, p in ordered:
            offset = -(-offset // align) * align
            self.slots.append(Slot(pname, offset, p.numel(), tuple(p.shape), _decays(p)))
            offset += p.numel()
        self.numel = offset
        self.padded_numel = -(-offset // (shards * align)) * shards * align
        self.shard_numel = self.padded_numel // shards
        self.shard_start = shard_rank * self.shard_numel
        decayed = [s for s in self.slots if s.decay]
        self.decay_end = decayed[-1].offset + decayed[-1].numel if decayed else 0
        self.full: torch.Tensor | None = None  # compute-dtype flat parameters (padded)

    # -- layout ------------------------------------------------------------------------------
    def shard_pieces(self) -> list[tuple[int, int, bool]]:
        """(start, end, decay) ranges of this rank's shard, in shard-local offsets, split at the
        boundary between decayed and non-decayed parameters (padding counts as non-decayed)."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        pieces = []
        if lo < self.decay_end:
            pieces.append((0, min(hi, self.decay_end) - lo, True))
        if hi > max(lo, self.decay_end):
            pieces.append((max(lo, self.decay_end) - lo, hi - lo, False))
        return pieces

    def shard_slot_ranges(self) -> list[tuple[Slot, int, int]]:
        """(slot, start, end) for each parameter overlapping this rank's shard, shard-local offsets."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        out = []
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                out.append((slot, a - lo, b - lo))
        return out

    def slot_grad_piece(self, name: str) -> tuple[torch.Tensor, int]:
        """(the part of ``grad_shard`` holding parameter ``name``, index in the parameter of its first
        element); empty when this rank's shard does not overlap the parameter."""
        for slot, a, b in self.shard_slot_ranges():
            if slot.name == name:
                return self.grad_shard[a:b], self.shard_start + a - slot.offset
        return self.grad_shard[:0], 0

    def shard_of(self, full_flat: torch.Tensor) -> torch.Tensor:
        return full_flat[self.shard_start:self.shard_start + self.shard_numel]

    def flatten(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
        """Lay full per-parameter tensors out as this unit's padded flat vector."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for slot in self.slots:
            flat[slot.offset:slot.offset + slot.numel].copy_(tensors[slot.name].reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a full (padded) flat vector."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots}

    def shard_from_full_values(self, value_of, dtype: torch.dtype, device) -> torch.Tensor:
        """This rank's shard built from ``value_of(name) -> full tensor``, touching only the
        parameters that overlap the shard (one full parameter at a time, never the whole unit)."""
        shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        for slot, a, b in self.shard_slot_ranges():
            first = self.shard_start + a - slot.offset
            shard[a:b].copy_(value_of(slot.name).reshape(-1)[first:first + b - a])
        return shard

    # -- the full compute buffer ---------------------------------------------------------------
    def bind(self, full: torch.Tensor) -> dict[int, nn.Parameter]:
        """New parameters that are views of ``full`` (the padded compute buffer); returns
        ``{id(old parameter): new parameter}`` for the caller to swap into the model (a meta
        parameter cannot simply be given CPU data)."""
        self.full = full
        swapped = {}
        for i, (p, slot) in enumerate(zip(self.params, self.slots)):
            new = nn.Parameter(full[slot.offset:slot.offset + slot.numel].view(slot.shape), requires_grad=True)
            swapped[id(p)] = new
            self.params[i] = new
        return swapped

    @property
    def gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def free_full(self) -> None:
        """Release the full buffer's memory; the parameter views stay, pointing at no bytes."""
        self.full.untyped_storage().resize_(0)

    def allocate_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())

    def flat_grads(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' gradients laid out flat (zeros where a parameter got none), in ``dtype``
        (into ``out``, of ``padded_numel`` elements, when given)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.full.device) if out is None else out.zero_()
        for p, slot in zip(self.params, self.slots):
            if p.grad is not None:
                flat[slot.offset:slot.offset + slot.numel].copy_(p.grad.reshape(-1))
        return flat
