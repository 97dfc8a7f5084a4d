"""Cross-entropy over a vocabulary split across tensor-parallel ranks.

Each rank holds logits for its slice of the vocabulary. The softmax needs the max and the sum of
exponentials over the whole vocabulary, and the target's logit lives on one rank: three
all-reduces of one number per token, instead of gathering (tokens x vocabulary) logits anywhere.
Padding columns (a vocabulary padded to divide by tp) are masked out, so they never change the loss;
targets of ``IGNORE_INDEX`` count for nothing, as in the single-device cross-entropy.
"""

from __future__ import annotations

import torch

from bigtrain.core.targets import IGNORE_INDEX
from bigtrain.distributed.comm import AxisComm


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm: AxisComm, first: int, vocab_size: int):
        logits = logits.float()
        local = logits.shape[-1]
        if first + local > vocab_size:  # padding columns of the last shard
            logits = logits.clone()
            logits[:, max(0, vocab_size - first):] = float("-inf")
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, tag="loss")
        exp = (logits - row_max.unsqueeze(-1)).exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total, tag="loss")
        counted = targets != IGNORE_INDEX
        local_target = targets - first
        mine = (local_target >= 0) & (local_target < local) & counted
        index = local_target.clamp(0, local - 1).unsqueeze(-1)
        target_logit = torch.where(mine, logits.gather(-1, index).squeeze(-1) - row_max, 0.0)
        comm.all_reduce(target_logit, tag="loss")
        ctx.save_for_backward(exp / total.unsqueeze(-1), mine, index, counted)
        return torch.where(counted, total.log() - target_logit, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, index, counted = ctx.saved_tensors
        grad_logits = softmax * counted.unsqueeze(-1)
        grad_logits.scatter_add_(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad, None, None, None, None


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, comm: AxisComm, first: int,
                            vocab_size: int) -> torch.Tensor:
    """Summed token cross-entropy; ``logits`` (b, s, local vocab) hold ids first .. first+local-1."""
    flat = logits.flatten(0, 1)
    loss = _VocabParallelCrossEntropySum.apply(flat, targets.flatten(), comm, first, vocab_size)
    return loss
