"""Hugging Face mixture-of-experts decoders in the ``hf`` family: ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM``.

transformers builds the model; each of its sparse-MoE blocks is then swapped (a child swap) for a
:class:`~bigtrain.models.hf_moe.SparseMoE` holding bigtrain's own
:class:`~bigtrain.models.moe.MoEFeedForward`, set to route as transformers does: softmax in fp32
over all experts, top-k, renormalized over the k (Mixtral always, Qwen3-MoE when
``norm_topk_prob``, Qwen2-MoE likewise), dropless (capacity factor 0), no balance loss in the
objective, the router's linear and the weighting in the input's dtype (``router_dtype = 'input'``);
Qwen2-MoE's shared expert (a SwiGLU of ``shared_expert_intermediate_size`` every token goes
through, scaled by sigmoid(``shared_expert_gate`` x)) is the block's gated shared expert. Expert parallelism,
the tp plan, ZeRO, checkpoints, the planner and the fuzzer then know the block as bigtrain's
Llama's. One MoE implementation, not two: transformers' per-expert loop runs only in the
independent reference (families/hf_reference.py).

Parameter names therefore differ from transformers' for the router and the experts; the
conversion to the names of a Hugging Face checkpoint file is stated once, :func:`stacked_names`,
and every place that speaks those names uses it (initialization by (seed, name), ``model.init_from``,
the export to a folder ``from_pretrained`` reads, the reference's gradients and weights):

    {P}.moe.router.weight  (E, h)         <-  {F}.gate.weight
    {P}.moe.experts.w1     (E x F, h)     <-  {F}.experts.{e}.{gate}.weight   (F, h), rows [eF, (e+1)F)
    {P}.moe.experts.w3     (E x F, h)     <-  {F}.experts.{e}.{up}.weight     (F, h)
    {P}.moe.experts.w2     (E x F, h)     <-  {F}.experts.{e}.{down}.weight   (h, F), transposed
    {P}.moe.shared.w1.weight, w3, w2       <-  {F}.shared_expert.{gate, up, down}_proj.weight   (Qwen2-MoE)
    {P}.moe.shared_gate.weight  (1, h)     <-  {F}.shared_expert_gate.weight

with {F} = ``model.layers.{i}.block_sparse_moe`` and (gate, up, down) = (w1, w3, w2) for Mixtral,
{F} = ``model.layers.{i}.mlp`` and (gate_proj, up_proj, down_proj) for Qwen2-MoE and Qwen3-MoE; {P} is {F} under
transformers 4 and ``model.layers.{i}.mlp`` under transformers 5, which names Mixtral's block so.
transformers 4's model has the file's names; transformers 5's keeps each block's experts in two
3-D tensors, which :func:`file_views` cuts into the file's per-expert matrices (the reference uses
it; transformers 5 reads and writes files with 4's names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from bigtrain.config import Config
from bigtrain.models.hf_moe import SparseMoE
from bigtrain.models.moe import MoEFeedForward

# architecture -> the model_type its config.json carries
MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                     "Qwen3MoeForCausalLM": "qwen3_moe"}
# The config.json fields (beyond the dense ones) that decide the MoE parameters' names and shapes.
MOE_SHAPE_KEYS = ("num_local_experts", "num_experts", "moe_intermediate_size", "decoder_sparse_step",
                  "mlp_only_layers", "shared_expert_intermediate_size")
# The MoE fields the planner reads, as transformers resolves them (defaults filled in).
MOE_DESCRIBED = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias")


@dataclass(frozen=True)
class SparseBlocks:
    """Where a transformers MoE model keeps its sparse blocks and what shape they have."""

    attribute: str  # the decoder layer's child that is the block, in the installed transformers
    file_attribute: str  # its name in checkpoint files (the Hugging Face hub's; transformers 5 reads those too)
    block_class: str  # transformers' class of that child
    projections: tuple[str, str, str]  # one expert's gate, up and down projections (their file names)
    layers: tuple[int, ...]  # the decoder layers holding a sparse block
    experts: int
    top_k: int
    hidden: int  # one expert's inner size
    renormalize: bool  # the top-k weights divided by their sum
    fused: bool  # transformers keeps each block's experts as two 3-D tensors (gate_up_proj, down_proj)
    router_dtype: str  # transformers' rounding of the router and the weighting (MoEFeedForward's modes)
    shared_hidden: int = 0  # Qwen2-MoE's gated shared expert's inner size; 0: none


def transformers_major() -> int:
    import transformers  # optional: only the hf family reaches this, and check_hf requires it

    return int(transformers.__version__.split(".")[0])


def sparse_blocks(conf) -> SparseBlocks | None:
    """The sparse blocks of the model transformers builds from ``conf`` (a PretrainedConfig); None
    for a dense architecture. Qwen3-MoE's rule is its decoder layer's: a layer is sparse unless it
    is in ``mlp_only_layers``, and when (index + 1) is a multiple of ``decoder_sparse_step``.
    transformers 5 differs from 4 in three ways this records: its experts are two 3-D tensors
    (``experts.gate_up_proj`` (E, 2F, h), ``experts.down_proj`` (E, h, F)) where 4 has one module per
    expert, Mixtral's block is the layer's ``mlp`` (4: ``block_sparse_moe``), and Mixtral's weighting
    is fp32 (4 casts the weights to the input's dtype first). Files keep 4's names in both."""
    n = conf.num_hidden_layers
    fused = transformers_major() >= 5
    if conf.model_type == "mixtral":
        return SparseBlocks("mlp" if fused else "block_sparse_moe", "block_sparse_moe", "MixtralSparseMoeBlock",
                            ("w1", "w3", "w2"), tuple(range(n)), conf.num_local_experts, conf.num_experts_per_tok,
                            conf.intermediate_size, True, fused, "input-logits" if fused else "input")
    if conf.model_type in ("qwen2_moe", "qwen3_moe"):  # their decoder layers' rule, their routing alike
        layers = tuple(i for i in range(n) if i not in conf.mlp_only_layers and conf.num_experts > 0
                       and (i + 1) % conf.decoder_sparse_step == 0)
        qwen2 = conf.model_type == "qwen2_moe"
        return SparseBlocks("mlp", "mlp", "Qwen2MoeSparseMoeBlock" if qwen2 else "Qwen3MoeSparseMoeBlock",
                            ("gate_proj", "up_proj", "down_proj"), layers, conf.num_experts, conf.num_experts_per_tok,
                            conf.moe_intermediate_size, bool(conf.norm_topk_prob), fused, "input",
                            conf.shared_expert_intermediate_size if qwen2 else 0)
    return None


def swap_sparse_blocks(causal_lm: nn.Module, blocks: SparseBlocks) -> None:
    """Each of transformers' sparse blocks of ``causal_lm`` (a ``*ForCausalLM``, any device)
    replaced by a :class:`SparseMoE` of the same shape on the same device (its values are set
    later, by name)."""
    for i in blocks.layers:
        layer = causal_lm.model.layers[i]
        theirs = getattr(layer, blocks.attribute)
        if type(theirs).__name__ != blocks.block_class:  # the rule above disagrees with transformers'
            raise ValueError(f"model.layers.{i}.{blocks.attribute} is a {type(theirs).__name__}, not the "
                             f"{blocks.block_class} its config.json describes")
        dim = theirs.gate.weight.shape[1]
        with torch.device(theirs.gate.weight.device):
            moe = MoEFeedForward(dim, blocks.hidden, blocks.experts, blocks.top_k, capacity_factor=0.0,
                                 aux_loss_coef=0.0, shared_expert=blocks.shared_hidden > 0,
                                 renormalize=blocks.renormalize, router_dtype=blocks.router_dtype,
                                 shared_hidden=blocks.shared_hidden, shared_gate=True)
        setattr(layer, blocks.attribute, SparseMoE(moe, with_router_logits=not blocks.fused))


# -- the name conversion ---------------------------------------------------------------------------
def stacked_names(blocks: SparseBlocks) -> dict[str, tuple[tuple[str, ...], bool]]:
    """The conversion, stated once: each of bigtrain's MoE parameters -> (the parameters of a
    checkpoint file it stacks, in row order; whether each is stored transposed)."""
    out = {}
    for i in blocks.layers:
        prefix, file_prefix = f"model.layers.{i}.{blocks.attribute}", f"model.layers.{i}.{blocks.file_attribute}"
        out[f"{prefix}.moe.router.weight"] = ((f"{file_prefix}.gate.weight",), False)
        for ours, theirs in zip(("w1", "w3", "w2"), blocks.projections):
            out[f"{prefix}.moe.experts.{ours}"] = (
                tuple(f"{file_prefix}.experts.{e}.{theirs}.weight" for e in range(blocks.experts)), ours == "w2")
            if blocks.shared_hidden:  # one matrix each, as nn.Linear keeps it on both sides: a rename
                out[f"{prefix}.moe.shared.{ours}.weight"] = ((f"{file_prefix}.shared_expert.{theirs}.weight",), False)
        if blocks.shared_hidden:
            out[f"{prefix}.moe.shared_gate.weight"] = ((f"{file_prefix}.shared_expert_gate.weight",), False)
    return out


def file_views(state: dict[str, torch.Tensor], blocks: SparseBlocks | None) -> dict[str, torch.Tensor]:
    """Tensors under the names of the installed transformers' model (its parameters, or their
    gradients) -> views of them under a checkpoint file's names: the same for transformers 4;
    transformers 5's two 3-D tensors of each block cut per expert (``gate_up_proj[e]``'s first F
    rows are the gate's, the next F the up projection's; ``down_proj[e]`` is the down's) and
    Mixtral's router under its file name. Views: copying into one sets the model's parameter."""
    if blocks is None or not blocks.fused:
        return dict(state)
    out = dict(state)
    gate, up, down = blocks.projections
    rows = blocks.hidden
    for i in blocks.layers:
        prefix, file_prefix = f"model.layers.{i}.{blocks.attribute}", f"model.layers.{i}.{blocks.file_attribute}"
        if f"{prefix}.gate.weight" in out:
            out[f"{file_prefix}.gate.weight"] = out.pop(f"{prefix}.gate.weight")
        gate_up, down_proj = out.pop(f"{prefix}.experts.gate_up_proj", None), out.pop(f"{prefix}.experts.down_proj", None)
        for e in range(blocks.experts):
            if gate_up is not None:
                out[f"{file_prefix}.experts.{e}.{gate}.weight"] = gate_up[e, :rows]
                out[f"{file_prefix}.experts.{e}.{up}.weight"] = gate_up[e, rows:]
            if down_proj is not None:
                out[f"{file_prefix}.experts.{e}.{down}.weight"] = down_proj[e]
    return out


def to_transformers_names(state: dict[str, torch.Tensor], blocks: SparseBlocks | None) -> dict[str, torch.Tensor]:
    """Full tensors under bigtrain's names -> under a checkpoint file's (each stacked bank cut per expert)."""
    if blocks is None:
        return dict(state)
    conversion, out = stacked_names(blocks), {}
    for name, tensor in state.items():
        if name not in conversion:
            out[name] = tensor
            continue
        theirs, transposed = conversion[name]
        for their_name, piece in zip(theirs, tensor.chunk(len(theirs))):
            out[their_name] = piece.t() if transposed else piece
    return out


def from_transformers_names(state: dict[str, torch.Tensor], blocks: SparseBlocks | None) -> dict[str, torch.Tensor]:
    """Full tensors under a checkpoint file's names -> under bigtrain's (each expert's stacked into its bank)."""
    if blocks is None:
        return dict(state)
    conversion = stacked_names(blocks)
    stacked = {n for theirs, _ in conversion.values() for n in theirs}
    out = {name: tensor for name, tensor in state.items() if name not in stacked}
    for ours, (theirs, transposed) in conversion.items():
        if all(n in state for n in theirs):
            out[ours] = torch.cat([state[n].t() if transposed else state[n] for n in theirs])
    return out


ValueOf = Callable[[str, tuple], torch.Tensor]  # (transformers' name, its shape) -> full fp32 value


def by_transformers_names(value_of: ValueOf, blocks: SparseBlocks | None) -> ValueOf:
    """``value_of`` (values by transformers' names) as an init function by bigtrain's names: a
    stacked bank's value is its experts' values by their own names, so a run and the reference
    (transformers' model, initialized by its names) start equal."""
    conversion = stacked_names(blocks) if blocks is not None else {}

    def value(name: str, shape: tuple) -> torch.Tensor:
        if name not in conversion:
            return value_of(name, shape)
        theirs, transposed = conversion[name]
        rows = shape[0] // len(theirs)
        piece = (shape[1], rows) if transposed else (rows, shape[1])
        return torch.cat([value_of(n, piece).t() if transposed else value_of(n, piece) for n in theirs])
    return value


# -- what the family refuses, and the planner's fields -----------------------------------------------
def moe_problems(cfg: Config, conf, where: str) -> list[str]:
    """The settings of an MoE config.json, and the layouts, this family does not train (by name)."""
    blocks = sparse_blocks(conf)
    if blocks is None:
        return []
    problems = []
    if getattr(conf, "output_router_logits", False):
        problems.append(f"output_router_logits = true in {where}: transformers then adds its batch-wide "
                        f"load-balancing loss (router_aux_loss_coef x the balance of every layer's router logits "
                        f"over the whole batch) to the loss, which bigtrain's MoE blocks do not compute; set "
                        f"output_router_logits to false in {where}")
    if getattr(conf, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise = {conf.router_jitter_noise} in {where}: it multiplies each block's "
                        f"input by fresh noise in training, which neither bigtrain's MoE block nor a comparison "
                        f"with one process reproduces; set router_jitter_noise to 0 in {where}")
    if not blocks.layers:
        return problems
    if conf.hidden_act != "silu":  # bigtrain's experts are SwiGLU; transformers' take ACT2FN[hidden_act]
        problems.append(f"hidden_act = '{conf.hidden_act}' in {where}: bigtrain's experts apply SiLU (SwiGLU); "
                        f"set hidden_act to 'silu' in {where} (or train the model with transformers)")
    if conf.model_type == "qwen2_moe" and transformers_major() < 5:
        import transformers

        problems.append(f"Qwen2MoeForCausalLM ({where}) with transformers {transformers.__version__}: its Qwen2-MoE "
                        f"attention is a class of its own, not the attention function bigtrain's layouts attend "
                        f"through (transformers 5 has it); pip install 'transformers>=5'")
    if conf.model_type == "qwen2_moe" and blocks.shared_hidden <= 0:
        problems.append(f"shared_expert_intermediate_size = {blocks.shared_hidden} in {where}: Qwen2-MoE's "
                        f"shared expert needs a positive size; set shared_expert_intermediate_size in {where}")
    if not 1 <= blocks.top_k <= blocks.experts:
        problems.append(f"num_experts_per_tok = {blocks.top_k} in {where}: each token goes to between 1 and the "
                        f"{blocks.experts} experts; set num_experts_per_tok to at most {blocks.experts}")
    if cfg.precision.fp8 != "none":
        problems.append(f"precision.fp8 = '{cfg.precision.fp8}' with the sparse blocks of {where}: float8 takes the "
                        f"decoder layers' nn.Linear modules, i.e. the router but not the stacked experts; set "
                        f"precision.fp8 = 'none'")
    if cfg.memory.activation_compression != "none":
        problems.append(f"memory.activation_compression = '{cfg.memory.activation_compression}' with the sparse "
                        f"blocks of {where}: it takes the decoder layers' nn.Linear modules, not the stacked "
                        f"experts, and leaves routers exact, which the transformers reference (its gate an "
                        f"nn.Linear) does not state; set memory.activation_compression = 'none'")
    p = cfg.parallel
    if p.cp > 1 and p.sp > 1:
        problems.append(f"parallel.cp = {p.cp} x parallel.sp = {p.sp} with the sparse blocks of {where}: an MoE "
                        f"block's part of each sequence would be cut twice (cp's chunk pairs, then Ulysses), which "
                        f"its sequence view does not follow yet; use parallel.sp = 1 (cp alone) or parallel.cp = 1")
    return problems


def planner_moe_fields(fields: dict, architecture: str) -> dict:
    """bigtrain Llama's MoE fields for the config.json's (defaults filled in): experts, top-k,
    each expert's size, every k-th block sparse but the dense ones (Qwen2- and Qwen3-MoE's
    decoder_sparse_step and mlp_only_layers), Qwen2-MoE's gated shared expert."""
    dense = {"moe_experts": 0}
    shared, kept_dense = 0, set()
    if architecture == "MixtralForCausalLM":
        experts, every, hidden = fields["num_local_experts"], 1, fields["intermediate_size"]
    elif architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        experts, every, hidden = fields["num_experts"], fields["decoder_sparse_step"], fields["moe_intermediate_size"]
        kept_dense = {i for i in fields.get("mlp_only_layers") or () if i < fields["num_hidden_layers"]}
        if architecture == "Qwen2MoeForCausalLM":
            shared = fields["shared_expert_intermediate_size"]
    else:
        return dense
    if not experts or all((i + 1) % every or i in kept_dense for i in range(fields["num_hidden_layers"])):
        return dense  # no sparse block at all: a dense model, as transformers builds it
    return {"moe_experts": experts, "moe_top_k": fields["num_experts_per_tok"], "moe_ffn_hidden": hidden,
            "moe_every": every, "moe_dense_layers": ",".join(map(str, sorted(kept_dense))), "moe_capacity_factor": 0.0,
            "moe_aux_loss_coef": 0.0, "moe_router": "softmax", "moe_shared_expert": shared > 0,
            "moe_shared_expert_hidden": shared, "moe_shared_expert_gate": shared > 0}
