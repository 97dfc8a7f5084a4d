"""Step time of data parallelism and ZeRO: each unit's gradient reduction over its own group, the
weight gathers, HSDP's replica all-reduce, a weight tied across the pipeline and the optimizer step,
each exposed as far as the compute beside it does not hide it (:mod:`bigtrain.plan.cost`'s
conventions; the collectives a step makes are :mod:`bigtrain.plan.grad_traffic`'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigtrain.plan.grad_traffic import (UnitCollective, busiest_rank_units, reduces_every_micro_batch, step_collectives,
                                        tied_copy_collectives)
from bigtrain.plan.layout import Cluster, Layout
from bigtrain.plan.links import Link, link_of
from bigtrain.plan.memo import by_layout_fields
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.tiers import host_step, reduce_bytes

if TYPE_CHECKING:
    from bigtrain.plan.cost import StageCosts

OPTIMIZER_BYTES_PER_PARAM = {"mixed": 32, "fp32": 28}  # read+write master, moments, grad, weight
# Before the update the engine reads every fp32 gradient of the rank for the global norm (optim/clip.py
# square_sums, whatever optim.grad_clip) and, with clipping on, scales them in place (read + write)
# on a step whose norm exceeds optim.grad_clip: the planner cannot tell which steps do, and prices
# the step that clips (a bound: 8 bytes a parameter more than a step under the clip).
GRAD_NORM_BYTES_PER_PARAM = 4
GRAD_CLIP_BYTES_PER_PARAM = 8


def _largest_rank_units(model: ModelSpec, layout: Layout) -> list[int]:
    """The ZeRO units' sizes on the pipeline rank holding the most parameters."""
    root, blocks = busiest_rank_units(model, layout)
    return [u.numel for u in ([root] if root else []) + blocks]


def data_parallel_costs(model: ModelSpec, layout: Layout, cluster: Cluster, costs: "StageCosts",
                        micro_batches: int) -> dict[str, float]:
    """Exposed seconds of gradient reduction, weight gathers and the optimizer step, each unit's
    collectives over its own group (:mod:`bigtrain.plan.grad_traffic`: an expert unit's over edp)."""
    traffic = _data_parallel_traffic(model, layout, cluster)
    m = micro_batches
    overlap = cluster.hardware.comm_overlap
    window_f = overlap * (costs.compute_f + costs.comm_f)
    window_b = overlap * (costs.compute_b + costs.comm_b)
    out = {"dp_grad_sync": 0.0, "zero_param_gather": 0.0}
    tail = traffic["tail"]  # the unit reduced as the backward ends
    if layout.zero == 0:
        out["dp_grad_sync"] = max(tail, traffic["all_reduce"] - window_b)
    else:
        # ZeRO reduces unit by unit, each a collective of its own: each pays the link's latency
        # (negligible on NCCL; on Gloo after compute, what decides a small model's step).
        per_unit = traffic["per_unit"]
        last = max(tail, per_unit - window_b)  # the step's last micro-batch: its end waits for it
        if layout.zero == 3 or host_step(layout):
            # Stage 3: the next micro-batch's forward gathers over the same group, queued behind the
            # last units' reduce-scatters (one communicator, one stream): the tail every micro-batch.
            # Offload: every micro-batch's reduced gradient waits for a device bucket (tiers.py).
            out["dp_grad_sync"] = m * last
        elif layout.zero == 2:
            # Stage 2 reduces every micro-batch, but waits for a unit's reduction only at its next
            # (the fold, a micro-batch later: grad_sync.py): the tail of the earlier micro-batches runs
            # beside the next forward, which has no collective on that group. Only what neither
            # window carries is exposed there; the last micro-batch's tail is waited for at the step.
            out["dp_grad_sync"] = last + (m - 1) * max(0.0, per_unit - window_b - window_f)
        else:  # stage 1: once a step, on the last micro-batch (the others accumulate locally)
            out["dp_grad_sync"] = last
        if layout.gradient_axes()[1]:
            # HSDP's second level: each unit's reduced shard (an expert unit's as edp_shard cut it)
            # all-reduced across the dp_replicate groups, on that axis's own link (inter-node once a
            # group fills a node). The runtime starts each asynchronously once the unit's
            # reduce-scatter is done and waits for it at the fold (parallel/zero/grad_sync.py): it
            # hides behind the backward as the reduction does (on a link of its own, so beside it,
            # not after it), except the last unit's. The fold of an earlier micro-batch's is the
            # unit's next reduction, a micro-batch later, and nothing else uses that link: only what
            # the link cannot carry within a backward's window is left of those; the last unit's
            # waits once a step.
            excess = max(0.0, traffic["replica_sync"] - window_b)
            reducing = m if reduces_every_micro_batch(layout) else 1
            out["dp_replica_sync"] = max(traffic["replica_tail"], excess) + (reducing - 1) * excess
    gather_tail = traffic["gather_tail"]
    if layout.zero in (1, 2):  # the updated weights, gathered in the training precision after the step
        gather = traffic["gather"]
        if cluster.engine.param_gather_overlap:  # under the next step's first forward, bucket by bucket
            gather = max(gather_tail, gather - window_f)
        out["zero_param_gather"] = gather
    elif layout.zero == 3:
        # every backward gathers every unit; the forwards after a step's first skip those still
        # gathered (grad_traffic.py): the forward's share of the calls beyond the backward's m
        if layout.reshard_after_forward:
            forward, backward = _zero3_forward_gathers(model, layout, cluster, m), traffic["gather"]
            out["zero_param_gather"] = m * (max(gather_tail, forward - window_f)
                                            + max(gather_tail, backward - window_b))
        else:  # each unit gathered once a micro-batch, in the forward, and held through its backward
            out["zero_param_gather"] = m * max(gather_tail, traffic["gather"] - window_f)
    out["optimizer_step"] = traffic["optimizer_step"]
    # A weight tied across the pipeline: its two copies' gradients all-reduced over the first and
    # last pipeline ranks after the reduction, synchronously (exposed)
    pp_link = link_of(cluster, layout, ("pp",))
    tied = sum(pp_link.collective(c.op, c.payload, c.ranks) for c in tied_copy_collectives(model, layout))
    if tied:
        out["tied_copy_sync"] = tied
    return out


# What a step's data-parallel collectives cost before the compute beside them hides any, one call of
# each (how many calls a step makes is the caller's): read off the busiest rank's units, the ZeRO
# stage, the groups' sizes and links, not the micro-batch, recomputation or the activation options.
_NOT_DATA_PARALLEL = ("micro_batch", "recompute", "every", "schedule", "tp_sp", "offload", "compression",
                      "fused_loss", "fp8", "compiled", "cp_mode")


@by_layout_fields(*_NOT_DATA_PARALLEL)
def _data_parallel_traffic(model: ModelSpec, layout: Layout, cluster: Cluster) -> dict[str, float]:
    hybrid = layout.gradient_axes()[1] != ()  # HSDP: that group is one of dp_replicate ZeRO groups
    link, collectives = _data_parallel_collectives(model, layout, cluster, 1)  # the calls a step do not count here
    across = set(layout.gradient_axes()[1])
    reductions = [c for c in collectives if c.tag == "grads" and c.axis not in across]
    gathers = [c for c in collectives if c.tag == "params"]

    def one_call(c: UnitCollective) -> float:
        return link.collective(c.op, c.payload, c.ranks)

    out = {"tail": max((one_call(c) for c in reductions), default=0.0)}
    if layout.zero == 0:
        out["all_reduce"] = _per_group(link, reductions, "all_reduce")
    else:
        out["per_unit"] = sum(one_call(c) for c in reductions)
        if hybrid:
            replica = [c for c in collectives if c.tag == "grads" and c.axis in across]
            link_across = link_of(cluster, layout, ("dp_replicate",))
            out["replica_sync"] = sum(link_across.collective(c.op, c.payload, c.ranks) for c in replica)
            out["replica_tail"] = max(link_across.collective(c.op, c.payload, c.ranks) for c in replica)
    out["gather_tail"] = max((one_call(c) for c in gathers), default=0.0)
    if layout.zero in (1, 2, 3):
        out["gather"] = _per_group(link, gathers, "all_gather")
    root, blocks = busiest_rank_units(model, layout)
    shard = sum(u.numel / (layout.size(u.axis) if layout.zero >= 1 else 1) for u in ([root] if root else []) + blocks)
    per_param = (OPTIMIZER_BYTES_PER_PARAM["fp32" if layout.precision == "fp32" else "mixed"] + GRAD_NORM_BYTES_PER_PARAM
                 + (GRAD_CLIP_BYTES_PER_PARAM if layout.grad_clip else 0))
    # With offload.optimizer the step runs on the host instead (offload_costs).
    on_device = not host_step(layout)
    out["optimizer_step"] = shard * per_param / cluster.hardware.hbm_bandwidth if on_device else 0.0
    return out


@by_layout_fields(*_NOT_DATA_PARALLEL)
def _zero3_forward_gathers(model: ModelSpec, layout: Layout, cluster: Cluster, micro_batches: int) -> float:
    """ZeRO-3's gathers in the forwards of a step of ``micro_batches``, as a share of one call each:
    the calls beyond the backward's one a micro-batch (grad_traffic.py)."""
    m = micro_batches
    link, collectives = _data_parallel_collectives(model, layout, cluster, m)
    return _per_group(link, [c for c in collectives if c.tag == "params"], "all_gather", lambda c: (c.calls - m) / m)


def _data_parallel_collectives(model: ModelSpec, layout: Layout, cluster: Cluster, micro_batches: int
                               ) -> tuple[Link, list[UnitCollective]]:
    """The link of the ZeRO group and :func:`step_collectives` of a step of ``micro_batches``."""
    hybrid = layout.gradient_axes()[1] != ()
    # The experts' edp ranks span the dense group's ranks (ep is its inner factor): the same link.
    link = link_of(cluster, layout, ("sp", "cp", "dp_shard") if hybrid else ("sp", "cp", "dp"))
    grad_bytes = cluster.engine.grad_reduce_bytes or reduce_bytes(layout.precision)  # the runtime: fp32 in fp16
    return link, step_collectives(model, layout, micro_batches, grad_bytes)


def _per_group(link: Link, chosen: list[UnitCollective], op: str, share=lambda c: 1) -> float:
    """One collective per group of everything ``chosen`` holds there (bucketed)."""
    groups: dict[tuple[str, int], float] = {}
    for c in chosen:
        groups[(c.axis, c.ranks)] = groups.get((c.axis, c.ranks), 0.0) + c.payload * share(c)
    return sum(link.collective(op, payload, ranks) for (_, ranks), payload in groups.items())
