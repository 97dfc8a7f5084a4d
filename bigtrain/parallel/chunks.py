"""What a rank holds of a parameter, as rectangular chunks of the full (global) tensor.

Every engine holds each of its parameters as a contiguous range ``[lo, hi)`` of the parameter's
flattened *tp-local* tensor: a ZeRO shard cuts a unit's flat buffer anywhere, so within one
parameter it is such a range; a replica holds ``[0, numel)``. In the 2-D view ``(-1, last_dim)``
of the local tensor (a 1-D tensor is one row) a range is at most three rectangles: a partial first
row, whole rows, a partial last row. Each is contiguous in the range, so its data is a plain slice
of the rank's flat buffer, and the placement's cuts (tensor parallelism's, an expert's over ep)
only shift it: by each ShardSpec's offset along dim 0 or dim 1 of the full tensor, dropping
vocabulary padding rows beyond the real size.

:class:`Piece` is what an engine hands the checkpoint code: for one parameter, the range it holds
and 1-D views of its weight and per-element optimizer state over that range (``tensors``), plus
the per-tensor state (``scalars``) and per-block state (``blocks``, a blocked optimizer's).
:func:`owned_range` splits replicated copies so that every element is written by exactly one rank;
:class:`SavedChunk` is one rectangle as the checkpoint writes it. (Placement geometry, read by the
engines and by :mod:`bigtrain.checkpoint`, which sits above them.)
"""

from __future__ import annotations

from typing import Callable, ContextManager

from dataclasses import dataclass, field

import torch

from bigtrain.parallel.placement import ShardSpec

WEIGHT = "weight"
# With offload.delayed_update the compute weights are one update behind the masters between steps:
# saved apart (``optim/<name>/weight_in_use``) so a resumed run computes its next step as the
# uninterrupted one does. A checkpoint without them resumes with the masters as the weights in use.
WEIGHT_IN_USE = "weight_in_use"


@dataclass
class Piece:
    name: str  # the parameter's name on this rank
    shape: tuple[int, ...]  # its tp-local shape
    lo: int  # the range of its flattened tp-local tensor held here
    hi: int
    tensors: dict[str, torch.Tensor]  # WEIGHT and per-element state names -> 1-D views of length hi - lo
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)  # per-tensor optimizer state
    replicas: int = 1  # ranks holding this same range (a replica group: dp without ZeRO sharding)
    replica: int = 0  # this rank's place among them
    # per-block optimizer state (8-bit AdamW's scales): 1-D views over the blocks of [lo, hi),
    # ``block`` elements each, counted from the parameter's first element (lo is a block boundary)
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)
    block: int = 1

    def block_range(self, lo: int, hi: int) -> tuple[int, int]:
        """The blocks whose first element lies in [lo, hi) (each block is written by one rank)."""
        return -(-lo // self.block), -(-hi // self.block)


@dataclass
class SavedChunk:
    """A rectangle of a full tensor that one rank writes into a checkpoint."""

    fqn: str
    shape: tuple[int, ...]  # the full tensor's
    offsets: tuple[int, ...]
    data: torch.Tensor  # shaped like the chunk
    # Offload's files: ``data`` has its bytes only inside ``readable()`` (its unit read back in from
    # the files), and ``finite`` says whether they are finite (found while they were read for the
    # listing); None: ``data`` is readable as it is.
    readable: Callable[[], ContextManager] | None = None
    finite: bool | None = None


def all_finite(data: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``data`` is finite (a 0-dim bool tensor on its device), read in
    place: its min and max are finite exactly when every element is (both propagate NaN, and an
    infinity is the max or the min). ``isfinite(data).all()`` made a bool copy of each chunk, a
    byte per element, and the freed copies left the heap grown: 14-70 MiB above the training level
    per rank while saving a 102M-parameter ZeRO-3 run at dp=4 (docs/benchmarks.md, checkpoint memory)."""
    if not data.is_floating_point() or data.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=data.device)
    if data.element_size() == 1:  # float8: no min/max kernel; the bool copy is no larger than the data
        return torch.isfinite(data).all()
    low, high = torch.aminmax(data)
    return torch.isfinite(low) & torch.isfinite(high)


@dataclass(frozen=True)
class Chunk:
    start: int  # flat range in the tp-local tensor
    stop: int
    offsets: tuple[int, ...]  # the rectangle in the full tensor
    sizes: tuple[int, ...]


def chunks(lo: int, hi: int, local_shape: tuple[int, ...], shards: tuple[ShardSpec, ...] = ()) -> list[Chunk]:
    """The rectangles of the full tensor that the flat range ``[lo, hi)`` of the local tensor (cut
    from the full one as ``shards``, a placement's, say) covers (at most three), in order;
    vocabulary padding is left out."""
    if len(local_shape) > 2 or len(local_shape) == 0:
        raise NotImplementedError(f"sharded checkpoints handle 1-D and 2-D parameters; got shape {local_shape}")
    if any(s.dim == 1 and s.padded_size != s.full_size for s in shards):
        raise NotImplementedError("padding along dim 1 would make chunks non-contiguous")
    cols = local_shape[-1]
    rows_local = local_shape[0] if len(local_shape) == 2 else 1
    row_shift = col_shift = 0
    real_rows, real_cols = rows_local, cols
    for spec in shards:
        if spec.dim == 0 and len(local_shape) == 2:
            row_shift, real_rows = spec.offset, max(0, min(rows_local, spec.full_size - spec.offset))
        else:  # along the last dimension (a 1-D tensor's only one)
            col_shift, real_cols = spec.offset, max(0, min(cols, spec.full_size - spec.offset))
    out = []

    def add(row: int, nrows: int, c0: int, ncols: int) -> None:
        nrows = min(nrows, real_rows - row)  # padding is nobody's
        ncols = min(ncols, real_cols - c0)
        if nrows <= 0 or ncols <= 0:
            return
        start = row * cols + c0
        stop = start + ncols if nrows == 1 else start + nrows * cols
        if len(local_shape) == 1:
            out.append(Chunk(start, stop, (c0 + col_shift,), (ncols,)))
        else:
            out.append(Chunk(start, stop, (row + row_shift, c0 + col_shift), (nrows, ncols)))

    if lo >= hi:
        return out
    first, last = lo // cols, (hi - 1) // cols
    if first == last:  # one (partial) row
        add(first, 1, lo - first * cols, hi - lo)
        return out
    head = 0
    if lo % cols:
        add(first, 1, lo % cols, cols - lo % cols)
        head = 1
    tail_cols = hi - last * cols
    whole_end = last if tail_cols < cols else last + 1
    add(first + head, whole_end - (first + head), 0, cols)
    if tail_cols < cols:
        add(last, 1, 0, tail_cols)
    return out


def owned_range(piece: Piece) -> tuple[int, int]:
    """The part of ``piece`` this rank writes: all of it, or, where ``replicas`` ranks hold the same
    range, this rank's share of an even split of it (as if sharded over them), so the write is
    still parallel and no element is written twice."""
    if piece.replicas == 1:
        return piece.lo, piece.hi
    step = -(-(piece.hi - piece.lo) // piece.replicas)
    lo = min(piece.hi, piece.lo + piece.replica * step)
    return lo, min(piece.hi, lo + step)
