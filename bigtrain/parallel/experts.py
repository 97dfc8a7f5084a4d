"""Expert parallelism: each MoE block's experts cut over the mesh's ``ep`` axis, tokens moved to
their experts' rank by all-to-all and back.

``apply_expert_parallel`` runs on the meta model after tensor parallelism and before the pipeline
split. For each :class:`~bigtrain.models.moe.MoEFeedForward` it keeps the contiguous run of
``E / ep`` experts at this rank's ep coordinate, records the cut in the placement record (shard
over ``ep`` along dim 0, replicated over ``edp`` and ``tp``, gradient partial over ``edp`` only:
the ranks of one ep group together saw every token their experts got), and swaps in
:class:`AllToAllDispatch`. Routing, capacity and the weighted combine stay in the block and
never see a rank, so every layout routes as one process does.

The dispatch, per block and micro-batch (torchtitan's and Megatron's all-to-all dispatcher):
1. the block sorts its kept routings by expert: rows for ep rank r are contiguous;
2. per-expert counts go to every rank (``all_to_all`` of E integers: the one host sync);
3. ``all_to_all`` of the rows with uneven splits (dispatch); the received rows, grouped by source
   rank then expert, are permuted to expert-major order, run through the local experts, and
   permuted back;
4. ``all_to_all`` with the splits swapped (combine). Backward runs the two exchanges the other way.
Traffic per block and micro-batch, dropless: 4 exchanges (dispatch and combine, forward and
backward) of ``tokens x top_k x dim`` elements each, (ep-1)/ep of them leaving the rank when the
routing is balanced (docs/moe.md).
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.moe import Experts, LocalExperts, moe_blocks
from bigtrain.parallel.parallel_plan import ExpertPlan
from bigtrain.parallel.placement import Placement, Placements, ShardSpec

DISPATCH_TAG, COMBINE_TAG, COUNTS_TAG = "moe_dispatch", "moe_combine", "moe_counts"


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all: backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: AxisComm, out_splits: list[int], in_splits: list[int], tag: str):
        ctx.comm, ctx.out_splits, ctx.in_splits, ctx.tag = comm, out_splits, in_splits, tag
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), tag=tag, output_splits=out_splits, input_splits=in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(out, grad.contiguous(), tag=f"{ctx.tag}_backward", output_splits=ctx.in_splits,
                            input_splits=ctx.out_splits)
        return out, None, None, None, None


class AllToAllDispatch(nn.Module):
    """Rows sorted by (global) expert -> the ep rank holding each expert, through it (``grouped_mm``:
    in one grouped GEMM), and back. A child module in the MoE block's ``dispatcher`` place."""

    def __init__(self, comm: AxisComm, num_experts: int, grouped_mm: bool = False):
        super().__init__()
        self.comm, self.num_experts, self.grouped_mm = comm, num_experts, grouped_mm
        self.local = num_experts // comm.size

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        ep, local = self.comm.size, self.local
        received_counts = torch.empty_like(counts)  # [source rank, my local expert]
        self.comm.all_to_all(received_counts, counts.contiguous(), tag=COUNTS_TAG)
        send = counts.view(ep, local).sum(1).tolist()
        received_counts = received_counts.view(ep, local)
        recv = received_counts.sum(1).tolist()
        rows = _AllToAll.apply(x, self.comm, recv, send, DISPATCH_TAG)
        # Received rows come grouped by source, then expert; the experts want them by expert.
        expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = experts(rows[by_expert], received_counts.sum(0).tolist(), self.grouped_mm)
        back = out[torch.argsort(by_expert)]  # the inverse permutation
        return _AllToAll.apply(back, self.comm, send, recv, COMBINE_TAG)


def expert_placement(spec: ShardSpec, data_axis: str = "edp", replica_axes: tuple[str, ...] = ()) -> Placement:
    """A run of experts: cut over ep, whole and equal on the ranks of edp (data parallel across
    ep groups) and of tp (every tp rank routes the same whole hidden states). Under HSDP edp is
    ``data_axis`` (edp_shard, inside one replica group) and the ``replica_axes`` (dp_replicate)
    across them (``Mesh.expert_gradient_axes``)."""
    return Placement(shards=(spec,), replicate=(data_axis, *replica_axes, "tp"), partial=(data_axis, *replica_axes))


def apply_expert_parallel(model: nn.Module, mesh: Mesh, plan: ExpertPlan = ExpertPlan(),
                          placements: Placements | None = None) -> int:
    """Cut every MoE block's experts over ``ep`` (on the meta model) and record it; returns the
    number of MoE blocks. With one ep rank only ``plan.grouped_mm`` applies."""
    comm = mesh.comm("ep")
    blocks = moe_blocks(model)
    for name, block in blocks:
        if comm.size == 1:
            block.dispatcher = LocalExperts(plan.grouped_mm)
            continue
        experts = block.experts
        if experts.num_experts % comm.size:
            raise ValueError(f"{name}: {experts.num_experts} experts do not divide over ep = {comm.size}")
        local = experts.num_experts // comm.size
        with torch.device(experts.w1.device):
            cut = Experts(local, experts.dim, experts.hidden)
        block.experts = cut
        block.dispatcher = AllToAllDispatch(comm, experts.num_experts, plan.grouped_mm)
        if placements is not None:
            rows = experts.num_experts * experts.hidden
            spec = ShardSpec(dim=0, index=comm.rank, parts=comm.size, full_size=rows, padded_size=rows, axis="ep")
            placement = expert_placement(spec, *mesh.expert_gradient_axes())
            for weight in ("w1", "w2", "w3"):
                placements.update(f"{name}.experts.{weight}", placement)
    return len(blocks)
