"""Styles for models whose blocks are called with keyword arguments and whose sequence-wide inputs
(rotary tables, the causal mask) are computed from the embedding's output (Hugging Face decoders).

Megatron's sequence parallelism cuts the sequence at the embedding (its lookup reduce-scatters).
A Hugging Face model reads the sequence length off the embedding's output to make positions,
rotary tables and the mask, so there the embedding must return the whole sequence: its lookup sums
over tp (:class:`WholeSequenceEmbedding`), and the first block takes this rank's shard
(:class:`EnterSequenceShards`); from there on the usual styles apply (the blocks' sub-blocks
gather the sequence, row-parallel outputs reduce-scatter it, the head gathers it).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from bigtrain.parallel.tensor.functional import copy_to_group, gather_sequence, split_sequence
from bigtrain.parallel.tensor.styles import Style, TPContext, VocabParallelEmbedding, VocabParallelLookup


class PrepareKeywordInput(Style):
    """:class:`~bigtrain.parallel.tensor.styles.PrepareInput` for a module called as
    ``module(hidden_states=x, ...)`` (or with ``x`` first): the same gather, or entry into the
    tensor-parallel region, applied to that argument."""

    def __init__(self, keyword: str = "hidden_states"):
        self.keyword = keyword

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        def prepare(x):
            return gather_sequence(x, ctx.tp) if ctx.sequence_parallel else copy_to_group(x, ctx.tp)

        def hook(m, args, kwargs):
            if self.keyword in kwargs:
                return args, {**kwargs, self.keyword: prepare(kwargs[self.keyword])}
            if not args:
                raise TypeError(f"{type(m).__name__} was called without '{self.keyword}' or a first argument")
            return (prepare(args[0]),) + tuple(args[1:]), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)


class WholeSequenceEmbedding(VocabParallelEmbedding):
    """Rows split by vocabulary id; the partial lookups are summed over tp into the whole sequence
    on every rank, with or without sequence parallelism (see the module's docstring)."""

    def apply(self, module: nn.Embedding, ctx: TPContext) -> VocabParallelLookup:
        entered = ctx.sequence_entered
        lookup = super().apply(module, ctx)
        ctx.sequence_entered = entered  # this lookup returns the whole sequence: it cuts nothing
        object.__setattr__(lookup, "ctx", replace(ctx, sequence_parallel=False))  # all-reduce, never cut
        return lookup


class EnterSequenceShards(Style):
    """The whole sequence (the same on every tp rank) -> this rank's shard, at the input of the
    first block under sequence parallelism; the gradient is all-gathered back."""

    def apply(self, module: nn.Module, ctx: TPContext) -> None:
        if not ctx.sequence_parallel:
            return
        ctx.sequence_entered = True

        def hook(m, args, kwargs):
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": split_sequence(kwargs["hidden_states"], ctx.tp)}
            return (split_sequence(args[0], ctx.tp),) + tuple(args[1:]), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
