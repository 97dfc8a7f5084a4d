"""What the zero-bubble split's W keeps of a micro-batch from its I on, per pipeline stage chunk.

I (``parallel/pipeline/split_backward.py``) runs the backward with the graph retained, so every
tensor the forward saved stays until W, and it captures the gradient flowing into each *junction*
(the node where a weight's branch leaves the input path) for W to start from. Those captured output
gradients are held from I to W on top of the saved tensors; the schedule walk
(:meth:`PipelineModel.peak_held_bytes`) adds them at I and drops both at W. Per token, B bytes an
element of the compute dtype, t the tp degree:

* a block: the outputs of the column-parallel linears (q, k, v and the MLP's up projections, split
  over tp), of the two row-parallel ones (wo and the MLP's down projection, whole: their products
  before the reduction) and of the two norms' weight products (sequence shards under Megatron SP);
  an MoE block's feed-forward: the router's logits, each routed row's expert outputs and the shared
  expert's (whole on every tp rank, as their saved tensors). A checkpointed or compiled block is
  differentiated whole in I (``WholeBackward``): nothing.
* the last stage: the final norm's weight product and the head's output, d logits (this rank's
  vocabulary rows), unless the fused loss computes the head's gradients in I.
* the first stage has no input path: its W is the whole backward, from the stage's output gradient
  (B h a token, a sequence shard under Megatron SP), which it keeps from I on.

Checked against the executor's measurement (``PipelineExecutor.peak_activation_bytes``): a zb-h1
layout in tests/test_plan.py's MEASURED; by hand also bf16, tp 2 with and without Megatron SP, full
recomputation, the fused loss and MoE blocks, each within 0.1% of the measured peak.
"""

from __future__ import annotations

from bigtrain.plan.activations import checkpointed_block_indices
from bigtrain.plan.expert_load import expert_load
from bigtrain.plan.gemm import compiles_block
from bigtrain.plan.layout import BYTES, Layout
from bigtrain.plan.model import ModelSpec, local_vocab
from bigtrain.plan.units import stage_blocks


def block_deferred_per_token(model: ModelSpec, layout: Layout, moe: bool, routed_rows: float) -> float:
    """Bytes per token of one block's captured output gradients (module docstring)."""
    nbytes, h, t = BYTES[layout.precision], model.hidden, layout.tp
    norm = h / t if layout.tp_sp else h
    column = model.attention_dim + 2 * model.kv_dim  # q, k, v
    ffn = 0.0
    if not moe:
        column += (2 if model.mlp == "swiglu" else 1) * model.ffn_hidden
        ffn = h  # the down projection's output
    else:
        ffn = model.experts + routed_rows * (2 * model.expert_ffn + h)
        if model.shared_ffn:
            ffn += 2 * model.shared_ffn + h + (1 if model.shared_expert_gate else 0)
    return nbytes * (column / t + h + ffn + 2 * norm)


def deferred_chunk_bytes(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple[float, ...]:
    """Per stage chunk of ``pp_rank`` (stages ``pp_rank``, ``pp_rank + pp``, ...), one micro-batch: the
    output gradients W keeps from I on (module docstring)."""
    nbytes, h, t = BYTES[layout.precision], model.hidden, layout.tp
    stages = layout.pp * layout.v
    tokens = layout.micro_batch * model.seq // layout.seq_shards
    blocks = stage_blocks(model.layers, stages, layout.split)
    whole = checkpointed_block_indices(model.layers, layout.recompute, layout.every)
    if compiles_block(model, layout):
        whole = set(range(model.layers))
    rows = expert_load(model, layout.ep, layout.seq_shards).priced if model.experts else 0.0
    per_kind = {moe: block_deferred_per_token(model, layout, moe, rows or model.top_k) for moe in (False, True)}
    out = []
    for s in range(pp_rank, stages, layout.pp):
        if s == 0 and stages > 1:  # no input path: W is the whole backward from the output gradient
            out.append(tokens * nbytes * (h / t if layout.tp_sp else h))
            continue
        per_token = sum(per_kind[bool(model.experts) and model.is_moe_block(i)] for i in blocks[s] if i not in whole)
        if s == stages - 1:
            per_token += nbytes * (h / t if layout.tp_sp else h)  # the final norm's weight product
            if not layout.fused_loss:
                per_token += nbytes * local_vocab(model.vocab, t)  # d logits
        out.append(tokens * per_token)
    return tuple(out)
