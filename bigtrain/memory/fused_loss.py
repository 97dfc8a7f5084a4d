"""The output projection and the cross-entropy in one, chunk by chunk: no (tokens x vocabulary) logits.

Forward computes each chunk's logits, keeps only each token's log-sum-exp (4 bytes a token) and adds
the chunk's loss; backward computes each chunk's logits again from the saved hidden states (which
the plain head's linear saves anyway) and turns them into that chunk's gradients at once. The most
held at a time is one chunk's logits and their exponentials, instead of the whole B x T x V fp32
log-softmax the plain loss saves (Liger's fused linear cross-entropy, in plain torch: it also runs
on a CPU). The extra cost is one more head matmul per token (2 V h FLOPs).

Under tensor parallelism the head is split over the vocabulary (``VocabParallelOutput``): each chunk
takes the max, the sum of exponentials and the target's logit over tp (three all-reduces of one
number per token, as ``parallel/tensor/loss.py``), and the hidden-state gradient each rank computes
is its vocabulary slice's part: the head's input hook (``PrepareInput``) sums it over tp in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.core.targets import IGNORE_INDEX
from bigtrain.wrappers import ModuleWrapper, WholeBackward, wrap


class _VocabRange:
    """Which vocabulary ids this rank's head rows hold, and over which group the softmax runs."""

    def __init__(self, comm=None, first: int = 0, vocab_size: int | None = None):
        self.comm, self.first, self.vocab_size = comm, first, vocab_size

    def all_reduce(self, t: torch.Tensor, op=None) -> None:
        if self.comm is not None and self.comm.size > 1:
            kwargs = {"op": op} if op is not None else {}
            self.comm.all_reduce(t, tag="loss", **kwargs)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A chunk's logits in fp32, computed in the head's dtype as the plain head does; padding
        columns (a vocabulary padded to divide by tp) masked out."""
        logits = F.linear(hidden, weight).float()
        if self.vocab_size is not None and self.first + logits.shape[-1] > self.vocab_size:
            logits[:, max(0, self.vocab_size - self.first):] = float("-inf")
        return logits

    def target_index(self, targets: torch.Tensor, local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counted, mine, index): targets the loss counts, those in this rank's slice, their column."""
        counted = targets != IGNORE_INDEX
        local_target = targets - self.first
        mine = (local_target >= 0) & (local_target < local) & counted
        return counted, mine, local_target.clamp(0, local - 1).unsqueeze(-1)


class _FusedLinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, vocab: _VocabRange):
        total = hidden.new_zeros((), dtype=torch.float32)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], chunk):
            logits = vocab.logits(hidden[lo:lo + chunk], weight)
            counted, mine, index = vocab.target_index(targets[lo:lo + chunk], logits.shape[-1])
            row_max = logits.max(dim=-1).values
            vocab.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX)
            target_logit = torch.where(mine, logits.gather(-1, index).squeeze(-1) - row_max, 0.0)
            vocab.all_reduce(target_logit)
            # In place: one chunk of logits is the largest thing held.
            sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
            vocab.all_reduce(sum_exp)
            lse[lo:lo + chunk] = row_max + sum_exp.log()
            total += torch.where(counted, sum_exp.log() - target_logit, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.vocab = chunk, vocab
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[lo:lo + ctx.chunk]
            logits = ctx.vocab.logits(h, weight)
            counted, mine, index = ctx.vocab.target_index(targets[lo:lo + ctx.chunk], logits.shape[-1])
            # d loss / d logits = softmax - onehot(target), for the counted targets only
            probs = logits.sub_(lse[lo:lo + ctx.chunk].unsqueeze(-1)).exp_().mul_(counted.unsqueeze(-1))
            probs.scatter_add_(-1, index, -mine.to(probs.dtype).unsqueeze(-1))
            probs = probs.mul_(grad).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[lo:lo + ctx.chunk] = probs @ weight
            grad_weight.addmm_(probs.t().float(), h.float())
        return grad_hidden, grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None


def fused_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   chunk: int = 1024, comm=None, first: int = 0,
                                   vocab_size: int | None = None) -> torch.Tensor:
    """Summed token cross-entropy of ``hidden @ weight.T`` (fp32) without holding the logits.

    ``hidden`` (..., h) and ``targets`` (...) of the same leading shape; ``weight`` (local vocab, h)
    holds ids ``first .. first + local - 1`` of ``vocab_size`` when split over ``comm`` (tp)."""
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    return _FusedLinearCrossEntropySum.apply(flat, weight, flat_targets, chunk,
                                             _VocabRange(comm, first, vocab_size))


class FusedLossHead(WholeBackward, ModuleWrapper):
    """The output head as a loss: ``head(hidden, targets)`` is the summed cross-entropy of
    ``hidden @ weight.T`` (:func:`fused_linear_cross_entropy_sum`). It takes the linear's place, so
    its hooks (tensor-parallel input, ZeRO-3 gathering, activation offload) run around the loss.
    The model must then end at its final norm (``Llama(..., with_head=False)``): the loss calls the
    head. Its backward computes the logits again from the weight, as a checkpointed block does: the
    zero-bubble split backward then takes its weight gradient in I, while ZeRO-3 still has the
    weight gathered, instead of deferring it to a W that would read a released weight."""

    kind = "fused_loss"

    def __init__(self, head: nn.Linear, chunk: int, tp=None, vocab: tuple[int, int] | None = None):
        # The loss is hidden @ weight.T alone: a head with a bias trained without it, silently (a
        # user's head nn.Linear(dim, vocab), bias=True by default: the loss 3x the plain model's).
        if not isinstance(head, nn.Linear) or head.bias is not None:
            what = "has a bias" if isinstance(head, nn.Linear) else f"is no nn.Linear (a {type(head).__name__})"
            raise ValueError(f"fused loss (ActivationPlan(fused_loss=True), model.fused_loss): the head {what}; "
                             f"the fused cross-entropy computes hidden @ weight.T only. Give the model an "
                             f"nn.Linear head with bias=False, or leave the loss unfused")
        super().__init__(head)
        first, vocab_size = vocab if vocab is not None else (0, None)
        object.__setattr__(self, "loss_args", (chunk, tp, first, vocab_size))  # plain state, not a child

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy_sum(hidden, self.weight, targets, *self.loss_args)


def fuse_head_into_loss(model: nn.Module, chunk: int, tp=None, vocab: tuple[int, int] | None = None,
                        name: str = "output") -> nn.Module:
    """Put the head ``name`` of ``model`` (a Llama's ``output``, a Hugging Face decoder's ``lm_head``)
    inside a :class:`FusedLossHead` (in place) and return it: call it with (final norm output,
    targets) for the summed loss. ``vocab``: (first local id, vocabulary size) under tp."""
    return wrap(model, name, lambda head: FusedLossHead(head, chunk, tp, vocab))
