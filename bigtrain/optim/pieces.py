"""Where a tensor an optimizer updates sits inside its whole parameter, for optimizers that need
the parameter's shape (``needs = "shapes"``: Adafactor's row and column statistics).

An engine hands such an optimizer pieces of parameters: a tensor-parallel rank holds a block of
rows or columns (:class:`~bigtrain.parallel.placement.ShardSpec` cuts), and a ZeRO rank holds a
flat range of that block. A :class:`ParamPiece` says which elements of the whole parameter a piece
holds and which groups hold the rest, so sums over the whole parameter (statistics, norms) are
this rank's partial sums added over those groups. Row and column indices are computed on the
fly from the flat range, never stored (they would cost more than the state they index).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bigtrain.distributed.comm import AxisComm
    from bigtrain.parallel.placement import ShardSpec


@dataclass(frozen=True)
class ParamPiece:
    """Elements ``[start, start + numel)`` of this rank's (tensor-parallel) part of a parameter."""

    local_shape: tuple[int, ...]  # this rank's part after the cuts (padding included)
    start: int = 0
    numel: int | None = None  # None: all of the local part
    cuts: tuple["ShardSpec", ...] = ()
    # The groups over which the rest of the parameter is spread (a cut's axis, the ZeRO axis):
    # a sum over the whole parameter is this piece's sum summed over each of them.
    comms: tuple["AxisComm", ...] = ()

    @property
    def size(self) -> int:
        return prod(self.local_shape) - self.start if self.numel is None else self.numel

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The whole parameter's shape, padded as the cuts pad it (index space of the statistics)."""
        shape = list(self.local_shape)
        for c in self.cuts:
            shape[c.dim] = c.padded_size
        return tuple(shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole parameter's true shape (what means divide by)."""
        shape = list(self.local_shape)
        for c in self.cuts:
            shape[c.dim] = c.full_size
        return tuple(shape)

    @property
    def whole(self) -> bool:
        """The piece is the whole parameter: no index arithmetic needed."""
        return not self.cuts and self.start == 0 and self.size == prod(self.local_shape)

    def global_coords(self) -> list[torch.Tensor]:
        """Per dimension, the coordinate in the (padded) whole parameter of each element of the piece."""
        flat = torch.arange(self.start, self.start + self.size)
        coords = []
        for extent in reversed(self.local_shape):
            coords.append(flat % extent)
            flat = flat // extent
        coords.reverse()
        for c in self.cuts:
            coords[c.dim] = coords[c.dim] + c.offset
        return coords

    def row_col_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For a parameter of 2+ dims factored over its last two: each element's row (over all
        leading dims) and column (over the dims before the last two, and the last)."""
        coords = self.global_coords()
        grid = self.grid_shape
        row = torch.zeros_like(coords[0])
        for extent, c in zip(grid[:-1], coords[:-1]):
            row = row * extent + c
        col = torch.zeros_like(coords[0])
        for extent, c in zip(grid[:-2] + grid[-1:], coords[:-2] + coords[-1:]):
            col = col * extent + c
        return row, col

    def flat_index(self) -> torch.Tensor:
        """Each element's index in the (padded) whole parameter, flattened."""
        coords = self.global_coords()
        index = torch.zeros_like(coords[0])
        for extent, c in zip(self.grid_shape, coords):
            index = index * extent + c
        return index


def whole(t: torch.Tensor) -> ParamPiece:
    return ParamPiece(tuple(t.shape))


def sum_over(tensors: list[torch.Tensor], comms_of: list[tuple["AxisComm", ...]], tag: str) -> None:
    """Add each tensor up over its groups, in place: one all-reduce per distinct group (of the
    tensors that share it, concatenated), in an order every rank of the group agrees on."""
    by_comm: dict[int, tuple["AxisComm", list[torch.Tensor]]] = {}
    for t, comms in zip(tensors, comms_of):
        for comm in comms:
            if comm.size > 1:
                by_comm.setdefault(id(comm), (comm, []))[1].append(t)
    for comm, ts in sorted(by_comm.values(), key=lambda item: item[0].axis):
        flat = torch.cat([t.reshape(-1) for t in ts])
        comm.all_reduce(flat, tag=tag)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
