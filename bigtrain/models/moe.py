"""Mixture of experts for the reference Llama: a router, a bank of SwiGLU experts, and the MoE block.

Plain single-device PyTorch, like the rest of the model: ``MoEFeedForward`` routes its tokens,
applies the capacity rule, sorts the kept routings by expert and hands them to its ``dispatcher``.
The model's own dispatcher (:class:`LocalExperts`, a child module) runs them through the local
experts, one plain loop over experts or one grouped GEMM; expert parallelism
(:mod:`bigtrain.parallel.experts`) puts in its place a dispatcher that moves them to the rank
holding their expert by all-to-all and back. Routing, capacity and the combine never change with the layout, which is what makes
a layout comparable with one process.

The rules (docs/moe.md):
- router in fp32 whatever the compute dtype: 'softmax' takes the top-k softmax scores (renormalized
  over the k chosen when k > 1, as Mixtral; raw for k = 1, as Switch); 'sigmoid-bias' selects the
  top-k of sigmoid(score) + bias and weights by the sigmoid scores renormalized over the k chosen
  (raw for k = 1: renormalized, the one weight would be 1 and the router would get no gradient);
  the bias moves outside the gradient after each applied step (:func:`update_router_biases`);
  it is model state: a persistent buffer, in checkpoints under its module name.
- capacity, per sequence (the group): C = ceil(factor x seq_len x top_k / E) routings per expert;
  every first choice ranks before every second choice, then earlier tokens first; routings past
  C are dropped (the token keeps its residual). Factor 0 is dropless.
- load-balancing loss (Switch), per sequence: E sum_e f_e P_e with f_e the fraction of the
  sequence's top-k routings (before drops) that chose e and P_e its mean router probability;
  its contribution to the objective is coef x aux_scale x sum over sequences (aux_scale is
  1 / global batch under the trainer, :func:`set_aux_loss_scale`), added to the gradient by
  :class:`_AddAuxGradient` so the training loop needs no second loss.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.models.feed_forward import FeedForward
from bigtrain.models.widen import at_least_fp32

ROUTERS = ("softmax", "sigmoid-bias")
ROUTER_DTYPES = ("fp32", "input", "input-logits")
BIAS_UPDATE_RATE = 1e-3  # aux-loss-free balancing's step (DeepSeek-V3, torchtitan)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts, stored 2-D so checkpoint chunks stay rectangles: rows
    [e F, (e+1) F) of ``w1`` / ``w3`` / ``w2`` are expert e's (F, dim) matrices (``w2`` transposed).
    Expert parallelism keeps a contiguous run of experts: a cut along dim 0."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(num_experts * hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts * hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts * hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int], grouped_mm: bool = False) -> torch.Tensor:
        """``x``: rows sorted by expert, ``counts[e]`` of them for expert e; returns the same rows'
        outputs. ``grouped_mm``: one ``torch._grouped_mm`` instead of the loop over experts."""
        if grouped_mm:
            return self._grouped(x, counts)
        out, first = [], 0
        for e, n in enumerate(counts):
            w1, w3, w2 = (w[e * self.hidden:(e + 1) * self.hidden] for w in (self.w1, self.w3, self.w2))
            rows = x[first:first + n]
            out.append((F.silu(rows @ w1.t()) * (rows @ w3.t())) @ w2)
            first += n
        return torch.cat(out) if out else x[:0]

    def _grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        e = len(counts)
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        w1, w3, w2 = (w.view(e, self.hidden, self.dim) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * \
            torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)


class WholeSequences(nn.Module):
    """The model's own view of a block's tokens: whole sequences, which capacity and the balance
    loss are defined over. Ulysses leaves a block one part of each sequence:
    :mod:`bigtrain.parallel.sequence_moe` swaps in a view that adds the other parts' statistics,
    so the block routes its own tokens and still keeps and balances as one process does. A child
    module (no parameters or buffers: state dicts are unchanged), as the ``dispatcher`` is: the
    parallel step replaces a child of the block, never sets a plain attribute on it."""

    def length(self, local: int) -> int:
        """The whole sequence's length, from this part's."""
        return local

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (per sequence) summed over the sequence's parts; backward: each part its own share."""
        return t

    def queue_offsets(self, routed: torch.Tensor) -> torch.Tensor | None:
        """``routed`` (batch, k, local seq, E): this part's routings, one-hot per choice, token and
        expert -> the routings of the other parts ahead of each of this part's tokens in each
        (choice, expert) queue, (batch, k, E) when the same for all its tokens or (batch, k, local
        seq, E); None: there are none."""
        return None


class LocalExperts(nn.Module):
    """The model's own dispatcher: every expert is here; the rows go straight through them
    (``grouped_mm``: in one grouped GEMM)."""

    def __init__(self, grouped_mm: bool = False):
        super().__init__()
        self.grouped_mm = grouped_mm

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        return experts(x, counts.tolist(), self.grouped_mm)


class _AddAuxGradient(torch.autograd.Function):
    """Identity on ``out``; in backward, also d(aux)/d(aux) = 1: the aux loss joins the objective
    without the loop adding it to the loss (Megatron's MoEAuxLossAutoScaler). fp32 / bf16 only:
    an fp16 loss scale would not reach it (validation rejects the pair)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), device=grad.device, dtype=ctx.aux_dtype)


class MoEStats:
    """What one MoE block saw since the last reset, summed over forwards (detached, this rank only)."""

    def __init__(self, num_experts: int):
        # On the CPU whatever the default device (the model is built on meta); moved where first added to.
        self.load = torch.zeros(num_experts, dtype=torch.float64, device="cpu")  # routings per expert, before drops
        self.dropped = torch.zeros((), dtype=torch.float64, device="cpu")  # routings past capacity
        self.aux = torch.zeros((), dtype=torch.float64, device="cpu")  # sum over sequences of the balance loss
        self.sequences = 0

    def add(self, load: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor, sequences: int) -> None:
        self.load = self.load.to(load.device) + load.double()
        self.dropped = self.dropped.to(load.device) + dropped.double()
        self.aux = self.aux.to(load.device) + aux.double()
        self.sequences += sequences


class MoEFeedForward(nn.Module):
    """(batch, seq, dim) -> (batch, seq, dim): each token through its top-k experts, weighted."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float = 0.0,
                 aux_loss_coef: float = 0.0, router: str = "softmax", shared_expert: bool = False,
                 renormalize: bool | None = None, router_dtype: str = "fp32", shared_hidden: int | None = None,
                 shared_gate: bool = False):
        """``renormalize``: the top-k weights divided by their sum; None: when k > 1 (the rule above),
        True: always (Mixtral's), False: never (Qwen3-MoE's ``norm_topk_prob = false``).
        ``router_dtype``: 'fp32' (the rule above) or transformers' arithmetic for its Mixtral and
        Qwen3-MoE: 'input', the router's logits from the linear in the input's dtype (softmax still
        in fp32) and the weights cast to the input's dtype before weighting the experts' outputs;
        'input-logits' (transformers 5's Mixtral), those logits and fp32 weights, the weighted
        outputs rounded to the input's dtype. Each gives the same numbers as 'fp32' when the input
        is fp32 (families/hf_moe.py).
        ``shared_hidden``: the shared expert's inner size (None: ``hidden``); ``shared_gate``: its
        output scaled per token by sigmoid(shared_gate(x)), a learned (1, dim) row (Qwen2-MoE's)."""
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router {router!r}: must be one of {ROUTERS}")
        if router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype {router_dtype!r}: must be one of {ROUTER_DTYPES}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and the {num_experts} experts")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.aux_loss_coef, self.router_kind = aux_loss_coef, router
        self.renormalize = top_k > 1 if renormalize is None else renormalize
        self.router_dtype = router_dtype
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)
        self.shared = FeedForward(dim, shared_hidden or hidden) if shared_expert else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_expert and shared_gate else None
        self.dispatcher = LocalExperts()
        self.sequence = WholeSequences()  # what part of each sequence the block holds (Ulysses, cp: a child swapped in)
        self.aux_scale: float | None = None  # per sequence; None: 1 / the sequences of each forward
        # sigmoid-bias: model state outside the gradient (a persistent buffer: checkpointed by name,
        # whole on every rank that holds the block); fp32 zeros from init_router_biases.
        if router == "sigmoid-bias":
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias: torch.Tensor | None = None
        self.stats = MoEStats(num_experts)

    def capacity(self, seq_len: int) -> int | None:
        if self.capacity_factor <= 0:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(b * s, dim)
        scores, chosen, weights = self._route(tokens)  # (N, E) fp32, (N, k), (N, k) fp32
        keep = self._within_capacity(chosen.view(b, s, self.top_k)).reshape(-1)
        flat_expert = chosen.reshape(-1)[keep]
        flat_token = torch.arange(b * s, device=x.device).repeat_interleave(self.top_k)[keep]
        flat_weight = weights.reshape(-1)[keep]
        order = torch.argsort(flat_expert, stable=True)  # by expert; within one, by token and choice
        token_of_row = flat_token[order]
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        rows = self.dispatcher(tokens[token_of_row], counts, self.experts)
        if self.router_dtype == "input":  # transformers' rounding: weights cast, product in the input dtype
            weighted = rows * flat_weight[order, None].to(rows.dtype)
        else:
            weighted = (at_least_fp32(rows) * flat_weight[order, None]).to(x.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of_row, weighted)
        if self.shared is not None:
            # The gate first: it reads the tokens as the shared expert's w1 and w3 do, next to them,
            # so int8 compression keeps one copy of them for all three (memory/compression.py).
            gate = torch.sigmoid(self.shared_gate(tokens)) if self.shared_gate is not None else None
            shared = self.shared(tokens)
            out = out + (gate * shared if gate is not None else shared)
        aux = self._balance_loss(scores.view(b, s, -1), chosen.view(b, s, -1))
        load = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        self.stats.add(load.detach(), (~keep).sum().detach(), aux.detach(), b)
        if self.aux_loss_coef > 0 and self.router_kind == "softmax" and torch.is_grad_enabled():
            scale = self.aux_scale if self.aux_scale is not None else 1.0 / b
            out = _AddAuxGradient.apply(out, aux * (self.aux_loss_coef * scale))
        return out.view(b, s, dim)

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # fp32 whatever the compute dtype: bf16 scores tie and flip the top-k between layouts.
        if self.router_dtype != "fp32":  # transformers' rounding: the logits in the input's dtype
            logits = F.linear(tokens, self.router.weight).float()
        else:
            logits = F.linear(at_least_fp32(tokens), at_least_fp32(self.router.weight))
        if self.router_kind == "softmax":
            scores = logits.softmax(-1)
            weights, chosen = scores.topk(self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
            return scores, chosen, weights
        scores = torch.sigmoid(logits)
        _, chosen = (scores.detach() + at_least_fp32(self.expert_bias)).topk(self.top_k, dim=-1)
        weights = scores.gather(-1, chosen)
        if self.renormalize:  # for k = 1 renormalizing would make every weight 1: the router would learn nothing
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights

    def _within_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        """(batch, seq, k) -> bool (batch, seq, k): routings inside their expert's capacity in their
        sequence, first choices before second ones, then in token order."""
        b, s, k = chosen.shape
        cap = self.capacity(self.sequence.length(s))
        if cap is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        by_priority = chosen.transpose(1, 2).reshape(b, k * s)  # choice-major
        onehot = F.one_hot(by_priority, self.num_experts)
        position = ((onehot.cumsum(1) - 1) * onehot).sum(-1)  # place in its expert's queue (among this part's)
        per_choice = onehot.view(b, k, s, self.num_experts)
        ahead = self.sequence.queue_offsets(per_choice)
        if ahead is not None:  # the other parts' routings ahead in the same queue
            ahead = ahead.unsqueeze(2) if ahead.dim() == 3 else ahead  # one offset for all this part's tokens
            position = position + (per_choice * ahead).sum(-1).view(b, k * s)
        return (position < cap).view(b, k, s).transpose(1, 2)

    def _balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Sum over sequences of E sum_e f_e P_e (scores: (b, s, E) probabilities, chosen (b, s, k))."""
        b, s, k = chosen.shape
        e, whole = self.num_experts, self.sequence.length(s)
        # One sum over the sequence's parts for both: routings per expert and router probabilities.
        summed = self.sequence.total(torch.cat([F.one_hot(chosen, e).sum((1, 2)).to(scores.dtype), scores.sum(1)], -1))
        fraction = summed[:, :e] / (whole * k)  # (b, E), no gradient
        mean_prob = summed[:, e:] / whole  # (b, E)
        return (fraction * mean_prob).sum() * self.num_experts


@contextmanager
def routing_statistics_set_aside(model: nn.Module):
    """MoE blocks count their routings in every forward: inside, those of ``model``'s blocks go to a
    scratch record (an evaluation's), and the training record is back after."""
    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    kept = [block.stats for block in blocks]
    for block in blocks:
        block.stats = MoEStats(block.num_experts)
    try:
        yield
    finally:
        for block, stats in zip(blocks, kept):
            block.stats = stats


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Each sequence's balance loss counts ``scale`` (1 / global batch: the mean over the batch,
    whatever the micro-batches and ranks that see its sequences)."""
    for _, block in moe_blocks(model):
        block.aux_scale = scale


def init_router_biases(model: nn.Module, device: torch.device | str | None = None) -> None:
    """Every sigmoid-bias router's bias zeroed, fp32, on ``device`` (default: where it is): after
    ``to_empty`` (which leaves it unset, or on meta under ZeRO) or a cast to a compute dtype (a bf16
    bias would round the 1e-3 steps away). A checkpoint's values are loaded after this."""
    for _, block in moe_blocks(model):
        if block.expert_bias is not None:
            where = block.expert_bias.device if device is None else torch.device(device)
            block.expert_bias = torch.zeros(block.num_experts, device=where)


@torch.no_grad()
def update_router_biases(model: nn.Module, comm=None, move_biases: bool = True) -> dict[str, dict]:
    """After a step: sum each block's statistics over ``comm`` (the data-parallel ranks, which hold
    the same router and see different tokens; None: this process saw them all), move the
    sigmoid-bias routers' biases towards the under-loaded experts (unless ``move_biases`` is False:
    a step the NaN policy skipped leaves all model state as it was), reset the statistics; returns
    {block name: {"load": [...], "dropped": n, "aux": mean per sequence}} for the metrics."""
    out = {}
    for name, block in moe_blocks(model):
        st = block.stats
        packed = torch.cat([st.load, st.dropped.view(1), st.aux.view(1),
                            torch.tensor([float(st.sequences)], dtype=torch.float64, device=st.load.device)])
        if comm is not None:
            comm.all_reduce(packed, tag="moe_metrics")
        load, dropped, aux, sequences = packed[:-3], packed[-3], packed[-2], packed[-1]
        if move_biases and block.expert_bias is not None and float(load.sum()) > 0:
            bias = block.expert_bias
            bias += BIAS_UPDATE_RATE * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
        out[name] = {"load": [int(v) for v in load.tolist()], "dropped": int(dropped),
                     "aux": float(aux) / max(1.0, float(sequences))}
        block.stats = MoEStats(block.num_experts)
    return out
