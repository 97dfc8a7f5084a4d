"""Where a blocked optimizer's per-block state lives, read from the parameter's placement.

8-bit AdamW keeps one scale per block of ``block`` consecutive elements of the flattened *whole*
parameter. Its per-block state is laid out as a "block grid" (:func:`block_grid`): when the last
dimension is a multiple of the block, ``shape[:-1] + (last / block,)`` (a block never crosses a
row), else the flat ``(ceil(numel / block),)``; both are the same flat order. A parameter's
tensor-parallel cuts then cut the grid too (:func:`block_cuts`): the same dims, the last one's
sizes divided by the block; a grid that is flat can only be cut along dim 0, and only where each
part is a whole number of blocks. Any other cut would put one block on two ranks: it is refused
(validation refuses it before launch, naming ``optim.block_size``).
"""

from __future__ import annotations

import math

from bigtrain.parallel.placement import Placement, Placements, ShardSpec


def rows_aligned(shape: tuple[int, ...], block: int) -> bool:
    return len(shape) >= 1 and shape[-1] % block == 0


def block_grid(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The per-block state's shape for a (whole or local) parameter of ``shape``."""
    if rows_aligned(shape, block):
        return tuple(shape[:-1]) + (shape[-1] // block,)
    return (-(-math.prod(shape) // block),)


def block_cuts(name: str, placement: Placement, local_shape: tuple[int, ...], block: int) -> tuple[ShardSpec, ...]:
    """The parameter's cuts, applied to its block grid; ValueError where a block would straddle ranks."""
    cuts = placement.shards
    if not cuts:
        return ()
    full = placement.full_shape(local_shape)
    last = len(local_shape) - 1
    if rows_aligned(full, block) and rows_aligned(local_shape, block):
        out = []
        for c in cuts:
            if c.dim != last:
                out.append(c)
            elif c.full_size % block or c.padded_size % (block * c.parts):
                break
            else:
                out.append(ShardSpec(c.dim, c.index, c.parts, c.full_size // block, c.padded_size // block, c.axis))
        else:
            return tuple(out)
    local = math.prod(local_shape)
    if len(cuts) == 1 and cuts[0].dim == 0 and local % block == 0:
        c = cuts[0]
        return (ShardSpec(0, c.index, c.parts, -(-math.prod(full) // block), c.parts * local // block, c.axis),)
    raise ValueError(f"{name}: its part {tuple(local_shape)} of {tuple(full)} ({placement.describe()}) would cut a "
                     f"quantization block of {block} elements between ranks; use an optim.block_size that divides "
                     f"each part's rows, or a layout that does not cut this parameter")


def block_placements(placements: Placements, local_shapes: dict[str, tuple[int, ...]], block: int) -> Placements:
    """A placement record for the per-block state of the parameters named in ``local_shapes``."""
    by_name = {n: Placement(shards=block_cuts(n, placements[n], shape, block)) for n, shape in local_shapes.items()}
    return Placements(by_name, placements.comm)
