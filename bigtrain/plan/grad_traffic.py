"""The data-parallel collectives of one training step on the busiest pipeline rank, unit by unit, as
the ZeRO engine issues them (``parallel/zero/grad_sync.py``, ``gather.py``, ``engine.py``): what
``dp_cost.data_parallel_costs`` prices, and what a run's counted bytes (``CommStats``, per axis and
op) are compared with (tests/test_plan_grad_traffic.py).

Each unit's collectives run over its own gradient group, as the placement record says: a dense
weight's over dp x cp x sp (one ZeRO group, dp_shard x cp x sp, under HSDP), an MoE block's experts'
over edp = dp x cp x sp / ep (edp_shard under HSDP), the ranks holding the same experts. A unit is
padded to a multiple of its group from stage 1 on (flat.py).

* gradients (tag ``grads``), in the reduce dtype: stage 0 all-reduces each unit, stages 1-3
  reduce-scatter it; stages 0-1 once a step (the last micro-batch; the others accumulate locally),
  stages 2-3, and any stage whose gradients go to the host (offload), every micro-batch. Under HSDP
  each reduced shard is then all-reduced over dp_replicate as often.
* weights (tag ``params``), in the compute dtype (fp32 at stage 3 in fp32: the shard is the master):
  stages 1-2 all-gather every unit once after the step; stage 3 gathers each unit before its forward
  and again before its backward, every micro-batch, except where a unit is still gathered: a unit is
  freed when the backward reaches the next unit (gather.py ``after_reduce``), so the last two the
  backward reaches, the root and the first block, are still gathered when the next micro-batch's
  forward starts with them, and are gathered m + 1 times a step, not 2m (without a pipeline; with
  one, other micro-batches' passes run in between: 2m, a bound). With reshard_after_forward off a
  unit gathered for the forward stays gathered until its backward has reduced it: m gathers a step
  (counted: the root and the first block too).
"""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.plan.layout import BYTES, Layout
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.tiers import host_step
from bigtrain.plan.units import Unit, checked_pp_ranks, rank_units

FRACTION = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
            "all_gather": lambda n: (n - 1) / n}  # of the full buffer, bandwidth-optimal (comm.py)


@dataclass(frozen=True)
class UnitCollective:
    op: str  # all_reduce | reduce_scatter | all_gather
    axis: str  # the group, as the placement record and Layout.size name it (dp_sp, edp, dp_replicate, ...)
    ranks: int
    payload: int  # bytes of the whole buffer (a reduce-scatter's input, an all-gather's output)
    calls: int  # a step
    tag: str  # grads | params
    expert: bool  # a unit of experts (edp), not of dense weights

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends a step."""
        return self.calls * self.payload * FRACTION[self.op](self.ranks) if self.ranks > 1 else 0.0


def busiest_rank_units(model: ModelSpec, layout: Layout) -> tuple[Unit | None, list[Unit]]:
    """(root unit or None, block units) of the pipeline rank holding the most parameters."""
    ranks = [rank_units(model, layout, r) for r in checked_pp_ranks(layout.pp, layout.split)]
    return max(ranks, key=lambda rb: (sum(u.numel for u in _all(rb)), max(u.numel for u in _all(rb))))


def _all(root_and_blocks: tuple[Unit | None, list[Unit]]) -> list[Unit]:
    root, blocks = root_and_blocks
    return ([root] if root else []) + blocks


def reduces_every_micro_batch(layout: Layout) -> bool:
    """Stages 2-3 keep only the gradient shard, and offload sends every micro-batch's gradient to the
    host: both reduce every micro-batch; stages 0-1 on the device accumulate and reduce once a step."""
    return layout.zero >= 2 or host_step(layout)


def step_collectives(model: ModelSpec, layout: Layout, micro_batches: int, grad_bytes: int) -> list[UnitCollective]:
    """Every data-parallel collective of a step on the busiest rank, one entry per unit and kind, in
    the units' order (root first); ``grad_bytes``: the reduce dtype's bytes."""
    nbytes = BYTES[layout.precision]
    reducing = micro_batches if reduces_every_micro_batch(layout) else 1
    across = layout.gradient_axes()[1]  # HSDP: the reduced shards are all-reduced over dp_replicate
    out = []
    root, blocks = busiest_rank_units(model, layout)
    units = ([root] if root else []) + blocks
    # ZeRO-3 without a pipeline: the units the backward reaches last stay gathered into the next
    # forward: the root and the first block's (an MoE block under ep: its dense weights and its experts)
    first = 2 if blocks and model.is_moe_block(0) and layout.ep > 1 else 1
    kept = set(range(1 + first)) if root is not None and layout.pp == 1 else set()
    for index, unit in enumerate(units):
        axis = unit.axis
        ranks, expert = layout.size(axis), axis.startswith("edp")
        if layout.zero == 0:
            out.append(UnitCollective("all_reduce", axis, ranks, unit.numel * grad_bytes, reducing, "grads", expert))
            continue
        padded = -(-unit.numel // ranks) * ranks
        out.append(UnitCollective("reduce_scatter", axis, ranks, padded * grad_bytes, reducing, "grads", expert))
        for replica_axis in across:
            out.append(UnitCollective("all_reduce", replica_axis, layout.size(replica_axis),
                                      padded // ranks * grad_bytes, reducing, "grads", expert))
        if layout.zero in (1, 2):
            out.append(UnitCollective("all_gather", axis, ranks, padded * nbytes, 1, "params", expert))
        elif layout.zero == 3:
            weight = nbytes if layout.precision != "fp32" else 4
            if layout.reshard_after_forward:
                calls = micro_batches + 1 if index in kept else 2 * micro_batches
            else:  # gathered once a micro-batch, in its forward, and held into its backward
                calls = micro_batches
            out.append(UnitCollective("all_gather", axis, ranks, padded * weight, calls, "params", expert))
    return out


def tied_copy_collectives(model: ModelSpec, layout: Layout) -> list[UnitCollective]:
    """A weight tied across the pipeline (the embedding and a tied output layer, on its first and
    last ranks): each end keeps a copy, and after the data-parallel reduction the two ends all-reduce
    their gradient pieces over ``pp_ends`` (parallel/tied.py), once a step, in fp32 (the gradient
    buffers' dtype whatever the compute dtype): the whole weight at stage 0, the rank's ZeRO shard of
    it from stage 1 (the copy is a unit alone: build.py)."""
    if not model.tie_embeddings or layout.pp == 1:
        return []
    weight = next(t for t in model.embedding_tensors() if t.name == "tok_embeddings")
    numel = weight.local_numel(layout.tp)
    shards = layout.size(layout.gradient_axes()[0]) if layout.zero >= 1 else 1
    return [UnitCollective("all_reduce", "pp_ends", 2, 4 * -(-numel // shards), 1, "tied_grads", False)]

