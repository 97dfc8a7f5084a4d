"""The links a collective runs over: which groups of the mesh cross nodes, and what a collective of
``n`` ranks on a link costs (latency per ``1 + log2 n`` steps, bus bandwidth, each op's share).
The planner's cost model (plan/cost.py) and its traffic per group (plan/grad_traffic.py) price
their collectives with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigtrain.plan.layout import Cluster, Layout

MESH_AXES = ("tp", "sp", "cp", "dp_shard", "dp_replicate", "pp")  # innermost first, as the mesh lays ranks out


def axis_crosses_nodes(layout: Layout, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether the group spanned by ``axes`` (adjacent in the mesh order) spans several nodes;
    ``dp`` is dp_shard (inner: one ZeRO group's ranks are adjacent) x dp_replicate."""
    axes = tuple(part for a in axes for part in (("dp_shard", "dp_replicate") if a == "dp" else (a,)))
    stride = 1
    for axis in MESH_AXES:
        if axis in axes:
            break
        stride *= getattr(layout, axis)
    size = math.prod(getattr(layout, a) for a in axes)
    return size > 1 and stride * size > gpus_per_node


@dataclass(frozen=True)
class Link:
    bandwidth: float  # all-reduce bus bandwidth
    latency: float
    reduce_scatter_efficiency: float = 1.0  # the op's bus bandwidth as a share of all-reduce's
    all_gather_efficiency: float = 1.0

    def collective(self, op: str, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        fraction = {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(op, (n - 1) / n)
        efficiency = {"reduce_scatter": self.reduce_scatter_efficiency,
                      "all_gather": self.all_gather_efficiency}.get(op, 1.0)
        return self.latency * (1 + math.log2(n)) + fraction * nbytes / (self.bandwidth * efficiency)


def link_of(cluster: Cluster, layout: Layout, axes: tuple[str, ...]) -> Link:
    hw = cluster.hardware
    ops = dict(reduce_scatter_efficiency=hw.reduce_scatter_efficiency, all_gather_efficiency=hw.all_gather_efficiency)
    if axis_crosses_nodes(layout, axes, cluster.gpus_per_node):
        return Link(hw.inter_node_bandwidth, hw.inter_node_latency_s, **ops)
    return Link(hw.intra_node_bandwidth, hw.intra_node_latency_s, **ops)
