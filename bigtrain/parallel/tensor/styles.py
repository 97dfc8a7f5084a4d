"""Parallel styles: what a plan entry does to one module of a plain model.

A style is applied on the meta device, before any memory exists: it replaces the module's weight
by a meta parameter of the local shape, records how that local tensor is cut from the full one
(:class:`ShardSpec`, used by init and checkpoints), and adds the communication as forward hooks
made of differentiable collectives, so the module's own code runs unchanged on its shard. A style
whose computation differs from the module's (the vocabulary-parallel lookup) returns a wrapper
(``bigtrain/wrappers.py``) that :func:`~bigtrain.parallel.tensor.plan.parallelize_module` puts in
the module's place; no style replaces a module's ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.fp8.linear import Float8Linear
from bigtrain.models.row_parallel_linear import RowParallelLinear, check_unhooked
from bigtrain.parallel.placement import ShardSpec, even_shard, vocab_pad_to
from bigtrain.parallel.tensor.functional import (all_to_all, copy_to_group, gather_sequence, reduce_from_group,
                                                 scatter_sequence_sum)
from bigtrain.wrappers import ModuleWrapper


@dataclass
class TPContext:
    """What styles share while a plan is applied: the groups and what they record."""

    tp: AxisComm
    sequence_parallel: bool = False
    sp: AxisComm | None = None
    specs: dict[int, ShardSpec] = field(default_factory=dict)  # id(new param) -> spec
    partial_grads: set[int] = field(default_factory=set)  # replicated params whose grads are partial sums
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)  # id(old) -> new (tied weights)
    vocab: tuple[int, int] | None = None  # (first local vocab id, real vocabulary size)
    # A style cut the sequence into this rank's shard (sequence parallelism's entry): without one,
    # PrepareInput gathers tp copies of a whole sequence (see apply_plan's check).
    sequence_entered: bool = False


def _shard_param(module: nn.Module, attr: str, dim: int, ctx: TPContext, pad_to: int = 1) -> ShardSpec:
    old = getattr(module, attr)
    if id(old) in ctx.replaced:  # already sharded through a tied module
        new = ctx.replaced[id(old)]
        setattr(module, attr, new)
        return ctx.specs[id(new)]
    size, parts = old.shape[dim], ctx.tp.size
    spec = even_shard(size, parts, ctx.tp.rank, dim, pad_to)
    if spec.padded_size != size and pad_to == 1:
        raise ValueError(f"{attr} dimension {dim} of size {size} does not divide by tp = {parts}")
    shape = list(old.shape)
    shape[dim] = spec.local_size
    new = nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=old.requires_grad)
    setattr(module, attr, new)
    ctx.specs[id(new)], ctx.replaced[id(old)] = spec, new
    return spec


class Style:
    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module | None:
        """Shard ``module`` and add its communication; returns what the plan puts in its place (a
        wrapper, or a module of another class with the same parameters and names), or None."""
        raise NotImplementedError


class ColumnParallel(Style):
    """Split output features: y_local = x W_local^T. Inputs must be replicated (see PrepareInput)."""

    def __init__(self, pad_to: int = 1):
        self.pad_to = pad_to  # > 1 pads (vocabulary) so the rows split evenly

    def apply(self, module: nn.Linear, ctx: TPContext) -> None:
        _shard_param(module, "weight", 0, ctx, self.pad_to)
        if module.bias is not None:
            _shard_param(module, "bias", 0, ctx, self.pad_to)


class RowParallelFloat8Linear(Float8Linear):
    """:class:`RowParallelLinear` for a float8 layer: its product in float8 (the same recipe and
    backend), its bias left to the :class:`RowParallel` hook, added once after the reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.float8_product(x)

    @classmethod
    def replacing(cls, linear: Float8Linear) -> "RowParallelFloat8Linear":
        check_unhooked(linear)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=linear.recipe,
                      backend=linear.backend)
        new.weight, new.bias = linear.weight, linear.bias
        new.train(linear.training)
        return new


def bias_after_the_sum(linear: nn.Linear) -> nn.Linear:
    """The layer of ``linear``'s class whose forward leaves the bias out, holding its parameters: a
    float8 layer stays float8. A linear of another class is refused rather than replaced by a plain
    one (it would silently stop computing as its class does)."""
    if type(linear) is nn.Linear:
        return RowParallelLinear.replacing(linear)
    if type(linear) is Float8Linear:
        return RowParallelFloat8Linear.replacing(linear)
    raise ValueError(f"RowParallel: a {type(linear).__name__} with a bias has no row-parallel form here (its bias "
                     f"must be added once, after the tensor-parallel sum); give it one in "
                     f"bigtrain/parallel/tensor/styles.py")


class RowParallel(Style):
    """Split input features; partial outputs are summed (all-reduce), or reduce-scattered along
    the sequence under sequence parallelism. A bias is added once, to the sum (Megatron's
    RowParallelLinear): whole on every rank, its gradient the same on each (a partial sum over the
    sequence shards under sequence parallelism, summed like the norms')."""

    def apply(self, module: nn.Linear, ctx: TPContext) -> nn.Module | None:
        replacement = bias_after_the_sum(module) if module.bias is not None else None
        module = replacement or module
        _shard_param(module, "weight", 1, ctx)
        reduce = scatter_sequence_sum if ctx.sequence_parallel else reduce_from_group
        if module.bias is not None:
            module.register_forward_hook(lambda m, args, out: reduce(out, ctx.tp) + m.bias)
            if ctx.sequence_parallel:  # added to this rank's sequence shard only: its gradient is partial
                ctx.partial_grads.add(id(module.bias))
        else:
            module.register_forward_hook(lambda m, args, out: reduce(out, ctx.tp))
        return replacement


class PrepareInput(Style):
    """Make a block's input whole for the column-parallel layers inside it: all-gather the
    sequence (sequence parallel) or mark the entry of a tensor-parallel region (backward all-reduce).
    Done once per sub-block, not once per linear layer."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        def hook(m, args):
            x = gather_sequence(args[0], ctx.tp) if ctx.sequence_parallel else copy_to_group(args[0], ctx.tp)
            return (x,) + tuple(args[1:])

        module.register_forward_pre_hook(hook)


class VocabParallelLookup(ModuleWrapper):
    """An embedding holding the rows ``first .. first + local - 1``: ids outside look up zeros, and
    the partial embeddings are summed over tp (or reduce-scattered along the sequence)."""

    kind = "vocab_parallel"

    def __init__(self, embedding: nn.Embedding, first: int, local: int, ctx: TPContext):
        super().__init__(embedding)
        object.__setattr__(self, "rows", (first, local))  # plain state of this wrapper
        object.__setattr__(self, "ctx", ctx)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first, local = self.rows
        outside = (tokens < first) | (tokens >= first + local)
        rows = F.embedding((tokens - first).masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.ctx.sequence_parallel:
            return scatter_sequence_sum(rows, self.ctx.tp)
        return reduce_from_group(rows, self.ctx.tp)


class VocabParallelEmbedding(Style):
    """Rows split by vocabulary id (padded to divide); the lookup becomes a
    :class:`VocabParallelLookup` in the embedding's place."""

    def apply(self, module: nn.Embedding, ctx: TPContext) -> VocabParallelLookup:
        spec = _shard_param(module, "weight", 0, ctx, pad_to=vocab_pad_to(module.num_embeddings, ctx.tp.size))
        ctx.sequence_entered |= ctx.sequence_parallel  # the lookup reduce-scatters along the sequence
        return VocabParallelLookup(module, spec.offset, spec.local_size, ctx)


class VocabParallelOutput(Style):
    """The output head split over the vocabulary; the loss must be the vocab-parallel one."""

    def apply(self, module: nn.Linear, ctx: TPContext) -> None:
        PrepareInput().apply(module, ctx)
        spec = _shard_param(module, "weight", 0, ctx, pad_to=vocab_pad_to(module.out_features, ctx.tp.size))
        ctx.vocab = (spec.offset, spec.full_size)


class PartialGradient(Style):
    """A replicated weight whose gradient each rank sees only in part (a norm on a sequence shard)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        for p in module.parameters(recurse=False):
            ctx.partial_grads.add(id(p))


class ReplicatedKVHeads(Style):
    """More tensor-parallel ranks than key/value heads: keep the whole projection on every rank and
    use only the head this rank's query heads attend to; gradients are partial sums."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int):
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim

    def apply(self, module: nn.Linear, ctx: TPContext) -> None:
        first_q_head = ctx.tp.rank * self.n_heads // ctx.tp.size
        kv = first_q_head // (self.n_heads // self.n_kv_heads)
        cols = slice(kv * self.head_dim, (kv + 1) * self.head_dim)
        ctx.partial_grads.add(id(module.weight))
        if module.bias is not None:
            ctx.partial_grads.add(id(module.bias))
        # A copy of the head, not a view: attention saves v (and a view would keep every head's
        # output alive with it: kv_heads times the bytes a rank needs)
        module.register_forward_hook(lambda m, args, out: out[..., cols].contiguous())


class UlyssesAttention(Style):
    """Sequence-sharded q, k, v -> head-sharded over the whole sequence (all-to-all), attention,
    and back. Query heads (after tensor parallelism) must divide by sp; key/value heads either
    divide by sp (split) or divide sp (replicated: as :class:`ReplicatedKVHeads` does over tp,
    each sp rank is sent a copy of the one key/value head its query heads attend to)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        sp = ctx.sp

        def before(m, args):
            q, k, v, *rest = args  # rest: the whole sequence's document mask (block-causal), passed on as they are
            return (all_to_all(q, sp, split_dim=2, cat_dim=1),
                    *(all_to_all(replicate_kv_heads(t, sp.size), sp, split_dim=2, cat_dim=1) for t in (k, v)), *rest)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(lambda m, args, out: all_to_all(out, sp, split_dim=1, cat_dim=2))


def replicate_kv_heads(t: torch.Tensor, parts: int) -> torch.Tensor:
    """(batch, seq, kv heads, head dim) with fewer key/value heads than ``parts`` (a divisor of it)
    -> ``parts`` heads, part j holding head j * kv / parts: the group of the query heads that part j
    receives (their heads are a run of h / parts, inside one group of h / kv). Backward sums the
    copies' gradients into their head."""
    heads = t.shape[2]
    if heads % parts == 0:
        return t
    if parts % heads:
        raise ValueError(f"Ulysses: {heads} key/value heads neither divide by sp = {parts} nor divide it")
    return t.repeat_interleave(parts // heads, dim=2)
