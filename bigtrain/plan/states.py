"""Model states per rank without offload: weights, gradients and the optimizer's state.

Model states follow the runtime byte for byte (engine.py, flat.py, units.py, replicated.py):
one ZeRO unit per transformer block plus a root unit (embedding, final norm, output), each
padded to a multiple of the ranks holding replicas (dp, times sp under Ulysses) from stage 1 on; with P the unit's padded elements, N the
shards, B the compute dtype's bytes, a "piece" the decayed / non-decayed part of a shard, and the
optimizer's declared state (``bigtrain.optim``) of E bytes per element and T bytes per tensor it is
given (AdamW: E = 8, two fp32 moments; T = 4, its step count):

    fp32, stage 0 (replicated engine): params 4P, grads 4P (bucket views), optimizer E P + T per tensor
    stage 0-2: params B P; stage 3: the shard, B P/N (mixed) or 4 P/N (fp32: it is the master)
    stage 0-1: grads 4P;   stage 2-3: grads 4P/N (fp32 whatever the compute dtype, see engine.py)
    optimizer: (4 master if mixed + E) P/N + T per piece

:func:`zero_formula_bytes` is the ZeRO paper's formula (no padding), for quick bounds.
(Offload's tiers: :mod:`bigtrain.plan.tiers`; the rest of a rank's memory: :mod:`bigtrain.plan.memory`.)
"""

from __future__ import annotations

from collections import Counter

from bigtrain.optim import get_optimizer
from bigtrain.plan.layout import BYTES, Layout
from bigtrain.plan.memo import cached
from bigtrain.plan.tiers import piecewise_shard_bytes, shard_pieces
from bigtrain.plan.units import Unit, gradient_axis_names, replicas, units_of_key


def unit_state_bytes(units: list[Unit], layout: Layout, optimizer: str = "adamw", block: int = 256
                     ) -> dict[str, int]:
    """:func:`state_bytes` of each group of units that shares a gradient axis (the experts' edp, or
    edp_shard under HSDP, apart from the dense weights'), summed."""
    return _grouped_state_bytes(units, layout.zero, layout.precision, layout.size, optimizer, block)


def _grouped_state_bytes(units, zero: int, precision: str, size_of, optimizer: str, block: int) -> dict[str, int]:
    out: Counter = Counter()
    for axis in dict.fromkeys(u.axis for u in units):
        out.update(state_bytes([u for u in units if u.axis == axis], zero, precision, size_of(axis), optimizer, block))
    return {k: out[k] for k in ("params", "grads", "optimizer")}


def group_sizes(layout: Layout) -> tuple[tuple[str, int], ...]:
    """The sizes of the two gradient axes a rank's units are reduced over (the dense weights', the
    experts'), by name."""
    return tuple((axis, layout.size(axis)) for axis in gradient_axis_names(layout))


@cached()
def rank_state_bytes(key: tuple, zero: int, precision: str, sizes: tuple[tuple[str, int], ...], optimizer: str,
                      block: int) -> dict[str, int]:
    """:func:`unit_state_bytes` of the units of a :func:`units_key` (a rank's, without offload) cut
    over groups of ``sizes``: computed once for all the layouts that share the units, the ZeRO
    stage, the precision and the groups' sizes (a search weighs each with every micro-batch,
    recomputation and schedule)."""
    root, blocks = units_of_key(key)
    return _grouped_state_bytes(([root] if root else []) + list(blocks), zero, precision, dict(sizes).__getitem__,
                                optimizer, block)


def state_bytes(units: list[Unit], zero: int, precision: str, replicas: int, optimizer: str = "adamw",
                block: int = 256) -> dict[str, int]:
    """Model-state bytes on the worst rank of the ``replicas`` ranks holding these units (dp, times
    sp under Ulysses), as the runtime allocates and measures them, with ``optimizer``'s declared state
    (``block``: ``optim.block_size``, for a blocked optimizer)."""
    nbytes, mixed = BYTES[precision], precision != "fp32"
    spec = get_optimizer(optimizer)
    if not spec.elementwise and all(u.sizes for u in units):
        return _piecewise_state_bytes(units, zero, nbytes, mixed, replicas, spec, spec.alignment_of(block))
    per_element, per_tensor = spec.bytes_per_param, spec.bytes_per_tensor
    numel = sum(u.numel for u in units)
    if zero == 0 and not mixed:  # ReplicatedEngine: the optimizer is given each parameter tensor
        return {"params": 4 * numel, "grads": 4 * numel,
                "optimizer": per_element * numel + per_tensor * sum(u.tensors for u in units)}
    shards = replicas if zero >= 1 else 1
    padded = sum(-(-u.numel // shards) * shards for u in units)
    shard = padded // shards
    if shards <= 1024:
        distinct = Counter(units)  # blocks are alike: count each kind of unit once per rank
        pieces = max(sum(n * shard_pieces(u, shards, r) for u, n in distinct.items()) for r in range(shards))
    else:  # each shard becomes at most two optimizer parameters: a bound is exact enough
        pieces = 2 * len(units)
    return {"params": nbytes * padded if zero < 3 else (nbytes if mixed else 4) * shard,
            "grads": 4 * (padded if zero <= 1 else shard),
            "optimizer": (4 * mixed + per_element) * shard + per_tensor * pieces}


def _piecewise_state_bytes(units: list[Unit], zero: int, nbytes: int, mixed: bool, replicas: int, spec,
                           block: int) -> dict[str, int]:
    if zero == 0 and not mixed:  # ReplicatedEngine: each parameter whole, with its own blocks
        numel = sum(u.numel for u in units)
        per_block = sum(s.nbytes for s in spec.state if s.per == "block")
        optimizer = sum(spec.bytes_per_param * n + per_block * -(-n // block) + spec.bytes_per_tensor
                        + (spec.factored_bytes(g) if spec.factored_bytes else 0)
                        for u in units for n, g in zip(u.sizes, u.grids))
        return {"params": 4 * numel, "grads": 4 * numel, "optimizer": optimizer}
    shards = replicas if zero >= 1 else 1
    distinct = Counter(units)
    padded = sum(n * piecewise_shard_bytes(u, shards, 0, spec, block, mixed)[0] for u, n in distinct.items())
    shard = padded // shards
    worst = max(sum(n * piecewise_shard_bytes(u, shards, r, spec, block, mixed)[1] for u, n in distinct.items())
                for r in range(min(shards, 1024)))
    return {"params": nbytes * padded if zero < 3 else (nbytes if mixed else 4) * shard,
            "grads": 4 * (padded if zero <= 1 else shard), "optimizer": worst}


def checkpoint_snapshot_bytes(units: list[Unit], layout: Layout, optimizer: str = "adamw", block: int = 256) -> int:
    """``checkpoint.async``: the copy of what the rank saves that a save takes before training goes on
    (``owned_chunks(copy=True)``, in host memory, held until the background write is committed, so
    beside a whole step's memory): the fp32 weights of the elements it owns (the masters in mixed
    precision, counted in the optimizer's bytes) and their optimizer state. Each element has one owner:
    its shard's rank from ZeRO stage 1 on (over HSDP's replica groups, an even split of it), among
    the replicas at stage 0 an even split. A bound by at most the padding and a few scalars."""
    states = unit_state_bytes(units, layout, optimizer, block)
    mixed = layout.precision != "fp32"
    # per-tensor state (a step count) is saved per parameter by the owner of its first element, where
    # the rank holds it per piece of its shard: a bound, every parameter's
    scalars = get_optimizer(optimizer).bytes_per_tensor * sum(u.tensors for u in units)
    if layout.zero == 0:  # every replica holds all of it: each writes its share
        weights = 0 if mixed else states["params"]
        return -(-(weights + states["optimizer"]) // (replicas(layout) * layout.dp_replicate)) + scalars
    shards = sum(-(-u.numel // layout.size(u.axis)) for u in units)
    return -(-(states["optimizer"] + (0 if mixed else 4 * shards)) // layout.dp_replicate) + scalars


def zero_formula_bytes(params: float, zero: int, dp: int, precision: str = "bf16", optimizer: str = "adamw"
                       ) -> dict[str, float]:
    """The ZeRO paper's per-rank model states, without padding: 2+2+K bytes per parameter in mixed
    precision (4+4+K' in fp32), the stage deciding which parts are divided by dp. K is the fp32
    master plus the optimizer's state, K' the state alone: 12 and 8 for AdamW."""
    weight = BYTES[precision] if precision != "fp32" else 4
    spec = get_optimizer(optimizer)
    per_block = sum(s.nbytes for s in spec.state if s.per == "block")
    optimizer_bytes = (4 if precision != "fp32" else 0) + spec.bytes_per_param + per_block / spec.alignment_of(256)
    return {"params": weight * params / (dp if zero >= 3 else 1),
            "grads": weight * params / (dp if zero >= 2 else 1),
            "optimizer": optimizer_bytes * params / (dp if zero >= 1 else 1)}
