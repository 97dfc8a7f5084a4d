"""What each pipeline rank holds of the model, as the ZeRO engine groups it: the root unit (embedding,
head) and one unit per block (an MoE block under ep: its dense weights and its experts, two gradient
groups), each cut over tensor parallelism and padded as the runtime pads it. The memory estimate
(memory.py) and the data-parallel traffic (grad_traffic.py) read them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bigtrain.parallel.placement import dense
from bigtrain.plan.layout import Layout
from bigtrain.plan.memo import cached
from bigtrain.plan.model import ModelSpec, Tensor


@dataclass(frozen=True)
class Unit:
    numel: int
    decay_numel: int  # decayed parameters come first in the flat unit
    tensors: int
    # Each tensor's local elements in the unit's order (decayed first) and the whole parameter's
    # padded shape (its grid: Adafactor's statistics): what an optimizer that is not elementwise
    # needs counted (the runtime gives it one piece per parameter, blocks aligned).
    sizes: tuple[int, ...] = ()
    grids: tuple[tuple[int, ...], ...] = ()
    axis: str = "dp_sp"  # the ranks that reduce its gradients and, from ZeRO stage 1, cut it (edp: experts)


def stage_blocks(layers: int, stages: int, split: tuple[int, ...] = ()) -> list[range]:
    """Blocks of each pipeline stage: from ``split``, the first block of stages 1.. (the run's
    parallel.pp_split, or its pp_balance = 'params' cut: ``Layout.split``), else as even as possible
    (the first stages take the extra ones)."""
    if split:
        edges = [0, *split, layers]
        return [range(a, b) for a, b in zip(edges, edges[1:])]
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def replicas(layout: Layout) -> int:
    """The ranks holding replicas of a dense weight, which reduce its gradient and, from ZeRO
    stage 1, cut its unit: the size of its placement's gradient axis (dp x cp x sp; dp_shard x cp x sp
    under HSDP)."""
    return layout.size(gradient_axis_names(layout)[0])


def _grid(t: Tensor, tp: int) -> tuple[int, ...]:
    placement = t.placement(tp)
    grid = list(placement.local_shape(t.shape))
    for cut in placement.shards:
        grid[cut.dim] = cut.padded_size
    return tuple(grid)


def _sharded(tensors: list[Tensor], tp: int, axis: str = "dp_sp") -> Unit:
    ordered = sorted(tensors, key=lambda t: not t.decays)  # the runtime's order: decayed first
    sizes = [t.local_numel(tp) for t in ordered]
    return Unit(sum(sizes), sum(s for s, t in zip(sizes, ordered) if t.decays), len(ordered), tuple(sizes),
                tuple(_grid(t, tp) for t in ordered), axis)


def rank_units(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple[Unit | None, list[Unit]]:
    """(root unit or None, block units) held by one tp rank of pipeline rank ``pp_rank``."""
    root, blocks = _rank_units(*units_key(model, layout, pp_rank))
    return root, list(blocks)


def units_key(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple:
    """All that a rank's units depend on: the model, the stages, the tp cut, the experts' degree and
    the names of the two gradient axes (the dense weights', then the experts'); what the memory
    estimate's caches of sums over the units key on."""
    return (model, layout.pp, layout.v, layout.tp, layout.ep, *gradient_axis_names(layout), pp_rank, layout.split)


def gradient_axis_names(layout: Layout) -> tuple[str, str]:
    """The axes a dense weight's and an expert's gradients are reduced (and their ZeRO units cut)
    over: dp_sp and edp, or under HSDP one ZeRO group's, dp_shard_sp and edp_shard."""
    return _axis_names(layout.gradient_axes(), layout.expert_gradient_axes())


@cached(maxsize=64)  # two pairs in all (with and without HSDP), asked per layout
def _axis_names(gradient_axes: tuple[str, tuple[str, ...]], expert_axes: tuple[str, tuple[str, ...]]
                ) -> tuple[str, str]:
    # a dense weight's placement, as ``parallelize`` records it from the mesh's gradient_axes: reduced
    # and cut over dp x cp x sp, or under HSDP over one ZeRO group and then all-reduced across them
    axis, replica_axes = gradient_axes
    return dense(axis, replica_axes=replica_axes).grad_axis, expert_axes[0]


def units_of_key(key: tuple) -> tuple[Unit | None, tuple[Unit, ...]]:
    """:func:`rank_units` of a :func:`units_key` (the blocks as a tuple: shared, not to be changed)."""
    return _rank_units(*key)


# The memory estimate and the data-parallel traffic both ask, for every checked pipeline rank of
# every layout a search weighs: computed once per model and the only layout fields the units depend
# on (the stages, the tp cut, the experts' degree and the names of the gradient axes), so the layouts
# that differ in dp, ZeRO stage, micro-batch, schedule or recomputation share them.
@cached()
def _rank_units(model: ModelSpec, pp: int, v: int, tp: int, ep: int, axis: str, expert_axis: str, pp_rank: int,
                split: tuple[int, ...] = ()) -> tuple[Unit | None, tuple[Unit, ...]]:
    stages = pp * v
    mine = range(pp_rank, stages, pp)
    per_stage = stage_blocks(model.layers, stages, split)
    blocks = sum(len(per_stage[s]) for s in mine)
    root: list[Tensor] = []
    if 0 in mine:
        root += model.embedding_tensors()
    if stages - 1 in mine:
        root += model.head_tensors(separate_copy=pp > 1)
    root_unit = _sharded(root, tp, axis) if root else None
    dense_block = _sharded(model.block_tensors(), tp, axis)
    if not model.experts:
        return root_unit, (dense_block,) * blocks
    # Every MoE block's units are alike (and every dense block's): each kind is cut once.
    if ep == 1:  # the experts reduce over dp x sp like the rest: one unit
        moe_block = (_sharded(model.moe_block_tensors() + model.expert_tensors(), tp, axis),)
    else:  # units.py: a block holding parameters of two gradient groups becomes two units
        moe_block = (_sharded(model.moe_block_tensors(), tp, axis),
                     replace(_sharded(model.expert_tensors(ep), tp), axis=expert_axis))
    units = []
    for i in (i for s in mine for i in per_stage[s]):
        units += moe_block if model.is_moe_block(i) else (dense_block,)
    return root_unit, tuple(units)


def checked_pp_ranks(pp: int, split: tuple[int, ...] = ()) -> list[int]:
    """Pipeline ranks that can be the worst: the first holds the embedding, the most blocks (the
    first stages take the extra ones) and the most micro-batches in flight (peaks never grow with
    the rank in any schedule); the last holds the output layer and the logits. With stages cut
    where ``split`` says, any rank may hold the most blocks: every one."""
    return list(range(pp)) if split else sorted({0, pp - 1})
