"""Plans as data: ``{module-name pattern: style or [styles]}`` applied by :func:`parallelize_module`,
the reference Llama's plan, and the :class:`TensorLayout` applying a plan leaves (how every local
weight is cut from the full one and which gradients are partial, for the placement record; which
loss to use)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.models.moe import MoEFeedForward
from bigtrain.wrappers import replace_module
from bigtrain.parallel.placement import Placements, ShardSpec
from bigtrain.parallel.tied import shared_parameter_names
from bigtrain.parallel.sequence_moe import SequencePartsOverSP, WholeSequenceOverTP
from bigtrain.parallel.tensor.loss import vocab_parallel_loss_sum
from bigtrain.parallel.tensor.styles import (ColumnParallel, PartialGradient, PrepareInput, ReplicatedKVHeads,
                                             RowParallel, Style, TPContext, UlyssesAttention,
                                             VocabParallelEmbedding, VocabParallelOutput)

Plan = dict[str, Style | list[Style]]


def parallelize_module(model: nn.Module, plan: Plan, ctx: TPContext) -> None:
    """Apply each pattern's styles to every module whose qualified name matches it (fnmatch), in
    plan order; a style that returns a wrapper has it put in the module's place. An unmatched
    pattern is an error: a typo must not silently leave a layer whole."""
    modules = dict(model.named_modules())
    for pattern, styles in plan.items():
        matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"parallel plan: pattern '{pattern}' matches no module")
        for name in matched:
            for style in styles if isinstance(styles, list) else [styles]:
                replacement = style.apply(modules[name], ctx)
                if replacement is not None:  # a wrapper, or a row-parallel layer with a bias
                    replace_module(model, name, replacement)
                    modules[name] = replacement


def llama_plan(model: nn.Module, tp: int, sequence_parallel: bool, ulysses: bool) -> Plan:
    """Megatron's layout for the reference Llama (its head counts read from ``model``): attention
    heads and the SwiGLU inner dimension split over tp (column then row), vocabulary-parallel
    embedding and head; key/value heads split when they divide by tp, else replicated."""
    plan: Plan = {}
    if tp > 1:
        attention = model.layers[0].attention
        heads, kv_heads, head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        kv = ColumnParallel() if kv_heads % tp == 0 else ReplicatedKVHeads(heads, kv_heads, head_dim)
        plan.update({
            "tok_embeddings": VocabParallelEmbedding(),
            "layers.*.attention": PrepareInput(),
            "layers.*.attention.wq": ColumnParallel(),
            "layers.*.attention.wk": kv,
            "layers.*.attention.wv": kv,
            "layers.*.attention.wo": RowParallel(),
            "output": VocabParallelOutput(),
        })
        # Dense MLPs only: an MoE block keeps its experts whole on every tp rank (they route the
        # same whole hidden states; docs/moe.md), so it needs no tp region around it.
        dense = [i for i, block in enumerate(model.layers) if not isinstance(block.feed_forward, MoEFeedForward)]
        blocks = ["*"] if len(dense) == len(model.layers) else [str(i) for i in dense]
        for i in blocks:
            plan.update({f"layers.{i}.feed_forward": PrepareInput(),
                         f"layers.{i}.feed_forward.w1": ColumnParallel(),
                         f"layers.{i}.feed_forward.w3": ColumnParallel(),
                         f"layers.{i}.feed_forward.w2": RowParallel()})
        if sequence_parallel:  # norms see a sequence shard: their weight gradients are partial
            plan["*norm"] = PartialGradient()
    if ulysses:
        plan["layers.*.attention.core"] = UlyssesAttention()
    # MoE blocks need whole sequences for capacity and the balance loss (parallel/sequence_moe.py).
    moe = [i for i, block in enumerate(model.layers) if isinstance(block.feed_forward, MoEFeedForward)]
    for i in moe if (tp > 1 and sequence_parallel) or ulysses else []:
        plan[f"layers.{i}.feed_forward"] = [WholeSequenceOverTP(), SequencePartsOverSP()]
    return plan


@dataclass
class TensorLayout:
    """What applying a tensor/sequence-parallel plan leaves besides the modules: how each weight
    is cut and which replicated weights get partial gradients (both written into the placement
    record by :meth:`record`, which everyone else reads), and which loss to use."""

    tp: AxisComm
    sp: AxisComm
    specs: dict[str, ShardSpec] = field(default_factory=dict)  # parameter name -> how it is cut
    partial_grads: list[str] = field(default_factory=list)  # parameter names
    vocab: tuple[int, int] | None = None

    def record(self, placements: Placements) -> None:
        """Write the cuts over tp, and the gradients partial over tp, into ``placements``."""
        for name, spec in self.specs.items():
            if name in placements:
                placements.update(name, placements[name].with_shard(spec))
        for name in self.partial_grads:
            if name in placements:
                placements.update(name, placements[name].with_partial("tp"))

    def placements(self, model: nn.Module) -> Placements:
        """A placement record of ``model`` holding only what this plan did (for code that drives the
        pieces by hand: tests, benchmarks)."""
        placements = Placements.of_model(model, {"tp": self.tp}.__getitem__, model_axes=("tp",))
        self.record(placements)
        return placements

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        if self.vocab is None:
            return None
        return vocab_parallel_loss_sum(logits, targets, self.tp, *self.vocab)


def _check_ties_kept(model: nn.Module, ties: dict[str, str]) -> None:
    """A style replaces the weight it cuts; a weight tied to it through another module is replaced
    with it only when the plan cuts that module too (``TPContext.replaced``). A plan cutting one
    side alone (a vocabulary-parallel head, the embedding left whole) untied them: two weights
    trained apart, silently (a tied GPT-2 at tp 2: the loss 6e-2 off the tied model's)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    broken = [(alias, canonical) for alias, canonical in ties.items()
              if alias in params and canonical in params and params[alias] is not params[canonical]]
    if broken:
        alias, canonical = broken[0]
        raise ValueError(f"tensor-parallel plan: {canonical} and {alias} are one tied weight, but the plan cuts "
                         f"only one of their modules ({canonical.rpartition('.')[0]}, {alias.rpartition('.')[0]}); "
                         f"give both a style that cuts the same rows (VocabParallelEmbedding and "
                         f"VocabParallelOutput), or neither")


def register_partial_grad_hooks(model: nn.Module, placements: Placements) -> None:
    """Sum the gradients that the placement record says are partial over tp (replicated weights
    seeing a sequence shard or part of a projection) before anything else sees them: a tensor hook
    runs before accumulation, so it precedes every engine's post-accumulate hook."""
    params = dict(model.named_parameters())
    tp = placements.comm("tp")
    for name in placements.names_partial_over("tp"):
        if name in params and params[name].requires_grad:  # a frozen weight has no gradient to sum
            params[name].register_hook(lambda g: _summed(g, tp))


def _summed(grad: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    out = grad.clone()
    comm.all_reduce(out, tag="partial_grads")
    return out


def default_plan(model: nn.Module, tp: int, sequence_parallel: bool, ulysses: bool) -> Plan:
    """The plan a model brings: the reference Llama's; any other model must be given one."""
    from bigtrain.models.llama import Llama

    if not isinstance(model, Llama):
        raise ValueError(f"no tensor-parallel plan for a {type(model).__name__}: give TensorParallelPlan(styles="
                         f"{{module pattern: style}}) (see bigtrain.parallel.tensor.plan.llama_plan)")
    return llama_plan(model, tp, sequence_parallel and tp > 1, ulysses)


def parallelize_llama(model: nn.Module, tp: AxisComm, sp: AxisComm, sequence_parallel: bool) -> TensorLayout:
    """Apply the Llama plan on the meta device; returns the layout the rest of the run needs."""
    return apply_plan(model, default_plan(model, tp.size, sequence_parallel, sp.size > 1), tp, sp, sequence_parallel)


def apply_plan(model: nn.Module, plan: Plan, tp: AxisComm, sp: AxisComm, sequence_parallel: bool) -> TensorLayout:
    """Apply ``plan`` on the meta device; returns how each weight was cut (for the placement record)
    and which loss to use."""
    ctx = TPContext(tp=tp, sequence_parallel=sequence_parallel and tp.size > 1, sp=sp)
    ties = shared_parameter_names(model)
    parallelize_module(model, plan, ctx)
    _check_ties_kept(model, ties)
    if ctx.sequence_parallel and not ctx.sequence_entered:
        # PrepareInput's all-gather then concatenated tp copies of the whole sequence, and a
        # RowParallel reduce-scatter handed each rank one copy: the forward right, the MLPs'
        # weight gradients tp times too large, trained silently (a GPT-2's MLPs at tp 2).
        raise ValueError("sequence parallelism: no style of the tensor-parallel plan cuts the sequence into this "
                         "rank's shard; give the embedding VocabParallelEmbedding (its lookup reduce-scatters along "
                         "the sequence) or the first block EnterSequenceShards (bigtrain/parallel/tensor/"
                         "entry_styles.py), or set sequence_parallel=False")
    layout = TensorLayout(tp=tp, sp=sp, vocab=ctx.vocab)
    # Every name of a shared (tied) weight: once pipeline stages split the model, the head's copy is
    # known by its own name only, and must still find how it is cut.
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ctx.specs:
            layout.specs[name] = ctx.specs[id(p)]
        if id(p) in ctx.partial_grads:
            layout.partial_grads.append(name)
    return layout
