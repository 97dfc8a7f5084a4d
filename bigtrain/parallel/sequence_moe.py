"""MoE blocks where the sequence is cut: Megatron sequence parallelism (over tp), Ulysses (over sp)
and context parallelism (over cp).

An MoE block's capacity and balance loss are defined per whole sequence (:mod:`bigtrain.models.moe`),
so a block holding a part of each sequence must see the rest, in one of two ways:

- Over tp (Megatron sequence parallelism), :class:`WholeSequenceOverTP`: the block's input is
  all-gathered along the sequence and its output cut back to this rank's part. Without sequence
  parallelism every tp rank already runs the block whole on the same tokens (its experts are not
  split over tp); this keeps exactly that, so the weights stay replicated over tp with equal
  gradients, and backward mirrors it (the output gradient all-gathered, the input gradient cut).
  Cost: one all-gather of the block's input forward and one of its output gradient backward.
- Over sp (Ulysses), :class:`SequencePartsOverSP`: each sp rank routes only its own tokens through
  the experts (sp ranks are replicas of the dense weights whose gradients are summed, so nothing
  may be computed twice) and the block's sequence view adds the other parts' statistics: one
  all-gather of (batch, top_k, experts) counts places each routing in its expert's whole-sequence
  queue (capacity), one all-reduce of (batch, 2 x experts) sums gives the balance loss's fractions
  and mean probabilities. That all-reduce's backward is the identity: each rank's balance-loss
  gradient reaches its own tokens' router scores, so the loss counts once.
- Over cp, :class:`ChunkPairsOverCP`: as over sp, but each rank's part is two chunks of the sequence
  that are not next to each other (the causal balance), so its queue offsets are per chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.parallel.tensor.functional import gather_sequence_replicated, reduce_from_group, split_sequence
from bigtrain.parallel.tensor.styles import Style, TPContext


class WholeSequenceOverTP(Style):
    """An MoE block under Megatron sequence parallelism runs on the whole sequence on every tp rank."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        if not ctx.sequence_parallel:
            return
        tp = ctx.tp
        module.register_forward_pre_hook(lambda m, args: (gather_sequence_replicated(args[0], tp), *args[1:]))
        module.register_forward_hook(lambda m, args, out: split_sequence(out, tp))


class SequenceParts(nn.Module):
    """An MoE block's view when it holds part ``comm.rank`` of each sequence, the parts equal and in
    the order of the ranks of ``comm`` (Ulysses' sp); see :class:`bigtrain.models.moe.WholeSequences`.
    A module put in the block's ``sequence`` child place (as expert parallelism puts its dispatcher),
    so the plain block carries no attribute set by this package (tests/test_wrappers.py)."""

    def __init__(self, comm: AxisComm):
        super().__init__()
        self.comm = comm

    def length(self, local: int) -> int:
        return local * self.comm.size

    def total(self, t: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(t, self.comm, tag="moe_sequence")

    def queue_offsets(self, routed: torch.Tensor) -> torch.Tensor:
        counts = routed.sum(2)  # (b, k, E): one offset for all of this part's tokens
        n = self.comm.size
        parts = torch.empty((n * counts.shape[0], *counts.shape[1:]), dtype=counts.dtype, device=counts.device)
        self.comm.all_gather(parts, counts.contiguous(), tag="moe_sequence")
        parts = parts.view(n, *counts.shape)
        others = parts.sum(0) - counts  # (b, k, E): the other parts' routings of each choice
        # Queues run choice-major, then token order: ahead of this part's choice-c routings are
        # every part's routings of earlier choices, and the choice-c routings of earlier parts.
        return others.cumsum(1) - others + parts[:self.comm.rank].sum(0)


class ChunkPairsOverCP(SequenceParts):
    """An MoE block's view under context parallelism: cp rank i holds chunks i and 2cp-1-i of the
    2 x cp equal chunks of each sequence, in that order (:mod:`bigtrain.parallel.context`).

    Length and sums are those of :class:`SequenceParts`. Queues differ: the chunks are not in rank
    order, so the routings ahead of a token depend on its chunk. One all-gather of (batch, k, 2, E)
    counts, per chunk, gives each: ahead of chunk c's choice-j routings are every chunk's routings of
    earlier choices and the choice-j routings of chunks before c; this rank's own chunks are
    counted by the block's local queue (its first chunk always comes before its second)."""

    def queue_offsets(self, routed: torch.Tensor) -> torch.Tensor:
        n, rank = self.comm.size, self.comm.rank
        b, k, s, e = routed.shape
        halves = routed.view(b, k, 2, s // 2, e).sum(3)  # (b, k, 2, E): per chunk of this rank
        gathered = torch.empty((n * b, k, 2, e), dtype=halves.dtype, device=halves.device)
        self.comm.all_gather(gathered, halves.contiguous(), tag="moe_sequence")
        by_chunk = torch.zeros((2 * n, b, k, e), dtype=halves.dtype, device=halves.device)
        for r, part in enumerate(gathered.view(n, b, k, 2, e)):  # chunk index of rank r's halves
            by_chunk[r], by_chunk[2 * n - 1 - r] = part[:, :, 0], part[:, :, 1]
        mine = (rank, 2 * n - 1 - rank)
        others = by_chunk.sum(0) - by_chunk[mine[0]] - by_chunk[mine[1]]  # (b, k, E)
        earlier_choices = others.cumsum(1) - others
        offsets = []
        for c in mine:  # the other ranks' chunks before chunk c, same choice
            before = by_chunk[:c].sum(0) - (by_chunk[mine[0]] if mine[0] < c else 0)
            offsets.append((earlier_choices + before).unsqueeze(2).expand(b, k, s // 2, e))
        return torch.cat(offsets, dim=2)  # (b, k, s, E)


class SequencePartsOverSP(Style):
    """Ulysses: an MoE block routes its part of each sequence, with whole-sequence statistics."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        if ctx.sp is not None and ctx.sp.size > 1:
            module.sequence = SequenceParts(ctx.sp)
