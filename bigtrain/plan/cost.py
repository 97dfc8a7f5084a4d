"""Step time: compute from FLOPs, each axis's traffic over the link it crosses, the pipeline.

Conventions (docs/planner.md has the derivations):

* Model FLOPs per token 6N + 12 L a s, a = heads x head_dim (``ModelSpec.model_flops_per_token``,
  which says why a and not h); hardware FLOPs add one more forward of every checkpointed block
  (2 N_block + 4 a s per token). MFU divides model
  FLOPs, HFU hardware FLOPs, by the step time and the peak of the precision used.
* Compute runs at ``peak x achievable_fraction`` of the hardware profile. The output projection's
  FLOPs are spread evenly over the pipeline stages.
* Ranks are placed tp innermost, then sp, dp, pp (the mesh's order): an axis whose group spans
  ``stride x size > gpus_per_node`` ranks crosses nodes and runs at the inter-node bandwidth.
  A collective over n ranks moving a buffer of S bytes takes latency (1 + log2 n) plus
  2 (n-1)/n S / bw (ring all-reduce), (n-1)/n S / bw (all-gather, reduce-scatter, all-to-all)
  or S / bw (point to point).
* zb-h1 splits each backward into I and W (``parallel/pipeline/split_backward.py``). W is the
  weight-gradient part of the backward of the layers it defers: ``weight_grad_fraction`` (a
  measured property of the hardware profile, see ``weight_grad.py``) of their backward. Checkpointed
  blocks are not deferred (their dW runs in I), so recomputation shrinks W; nor are compiled ones
  (``layout.compiled``: a compiled region's one backward computes dX and dW together), so a
  compiled dense Llama's W is the head's alone (:func:`blocks_with_weight_grads_in_i`).
* Exposed vs overlapped: tensor-parallel and Ulysses collectives sit on the critical path of
  every layer (exposed, as in Megatron without communication overlap). Pipeline transfers are
  the simulator's transfer cost. Gradient reduction, each unit over its own group (an expert
  unit's over edp: ``grad_traffic.py``; stage 0-1: once per step on the last micro-batch; stage
  2-3: every micro-batch) hides behind the profile's ``comm_overlap`` of the backward it runs
  under, except the last unit's collective (HSDP's replica all-reduce too, on its own link), which
  the step's end waits for; at stage 2 an earlier micro-batch's is waited for only at the unit's
  next reduction, so the next forward hides it too; at stage 3 that forward's gathers queue behind
  it, exposed every micro-batch. ZeRO-3's gathers hide behind the forward/backward
  the same way. Stage 1-2's all-gather of updated weights after the step is exposed (the runtime
  does it synchronously), and so is the memory-bound AdamW step.
* Offload (``offload_costs``): PCIe transfers, the host's gradient folds, the host optimizer step
  and NVMe reads and writes at the profile's ``host_bandwidth``, ``host_memory_bandwidth`` and
  ``nvme_bandwidth``; the gradients' way to the host overlaps each micro-batch's backward, the step
  is exposed after the backward unless the delayed update hides it behind the next step's compute.
* Activation options (``memory/``): selective recomputation is elementwise and memory-bound: the
  tensors it drops are written and read once more at ``hbm_bandwidth``; the fused loss adds one
  more output projection (2 V h FLOPs per token). Offload moves every micro-batch's saved bytes out and back
  over the host link (``host_bandwidth``), overlapped with that micro-batch's compute up to
  ``OVERLAP``; int8 compression is memory-bound traffic (quantize in forward, dequantize in
  backward) at ``hbm_bandwidth``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bigtrain.plan.activations import block_activations, checkpointed_block_indices
from bigtrain.plan.dp_cost import data_parallel_costs
from bigtrain.plan.expert_load import exchange_payload, expert_load
from bigtrain.plan.layout import BYTES, Cluster, Layout
from bigtrain.plan.links import MESH_AXES, Link, link_of
from bigtrain.plan.memo import by_layout_fields
from bigtrain.plan.memory import chunk_activation_bytes
from bigtrain.plan.states import unit_state_bytes
from bigtrain.plan.model import ModelSpec, kv_heads_held
from bigtrain.plan.pipeline import PipelineModel
from bigtrain.plan.tiers import host_step, reduce_bytes
from bigtrain.plan.units import checked_pp_ranks, rank_units

# Share of a compute window that hides a host transfer or the host step launched during it
# (assumption; collectives use the profile's measured ``comm_overlap`` instead).
OVERLAP = 0.9


@dataclass
class StepTime:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    micro_batches: int
    pipeline_source: str
    breakdown: dict[str, float] = field(default_factory=dict)

    def achieved_flops_per_gpu(self, gpus: int, hardware: bool = False) -> float:
        flops = self.hardware_flops_per_step if hardware else self.model_flops_per_step
        return flops / (self.step_time_s * gpus)

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "hfu": self.hfu, "model_flops_per_step": self.model_flops_per_step,
                "hardware_flops_per_step": self.hardware_flops_per_step, "micro_batches": self.micro_batches,
                "pipeline": self.pipeline_source, "breakdown": dict(self.breakdown)}


# -- per micro-batch stage costs -------------------------------------------------------------------------
@dataclass(frozen=True)
class StageCosts:
    compute_f: float  # seconds of FLOPs, one micro-batch, this rank's share of the layers
    compute_b: float  # backward, recompute included
    compute_w: float  # the part of compute_b a split backward (zb-h1) defers to W
    comm_f: float  # exposed tp/sp collectives in the forward
    comm_b: float
    p2p: float  # one pipeline transfer
    moe_comm: float = 0.0  # the experts' all-to-all, forward and backward (part of comm_f and comm_b)
    ring_comm: float = 0.0  # cp's ring, exposed, forward and backward (part of comm_f and comm_b)


# Nor do a stage's compute and its tp / sp / cp / ep / pp transfers read the ZeRO stage, the
# schedule or the offload tiers: the layouts that differ only there share them.
@by_layout_fields("zero", "schedule", "v", "offload_optimizer", "offload_params", "offload_masters",
                  "delayed_update")
def stage_costs(model: ModelSpec, layout: Layout, cluster: Cluster) -> StageCosts:
    hw, nbytes = cluster.hardware, BYTES[layout.precision]
    rate = hw.sustained_flops(layout.precision)
    tokens = layout.micro_batch * model.seq
    layers = model.layers / layout.pp
    recomputed = len(checkpointed_block_indices(model.layers, layout.recompute, layout.every)) / layout.pp
    split = layout.tp * layout.seq_shards  # each of these ranks does 1/split of the stage's FLOPs
    head = 2 * model.vocab * model.hidden / layout.pp
    forward = tokens * (layers * model.block_forward_flops_per_token() + head)
    backward = 2 * forward + tokens * (model.recompute_flops_per_token(recomputed)
                                       + activation_recompute_flops_per_token(model, layout) / layout.pp)
    # W defers the weight gradients of the layers whose dW I does not compute (split_backward.py).
    in_i = blocks_with_weight_grads_in_i(model, layout, layers, recomputed)
    head_deferred = 0.0 if layout.fused_loss else head  # the fused loss head's dW runs in I (WholeBackward)
    deferred_backward = 2 * tokens * ((layers - in_i) * model.block_forward_flops_per_token() + head_deferred)
    weight_grad = hw.weight_grad_fraction * deferred_backward
    local_tokens = tokens / layout.seq_shards
    tp_link, sp_link = link_of(cluster, layout, ("tp",)), link_of(cluster, layout, ("sp",))
    cp_link = link_of(cluster, layout, ("cp",))
    # Megatron: two all-reduces (or all-gather + reduce-scatter with SP, the same volume) per layer
    # in each direction, the embedding's and the output layer's, and the recomputed layers' (tp_collectives).
    tp_op = tp_link.collective("all_reduce", local_tokens * model.hidden * nbytes, layout.tp)
    # Ulysses: q, k, v to head-sharded layout and the output back, per layer and direction (q and
    # the output span the query heads' width, heads x head_dim). Key/value heads fewer than the
    # ranks are replicated to one a rank before they are sent (replicate_kv_heads), as are those
    # fewer than tp (one a tp rank).
    def qkv(ranks: int) -> float:
        kv_heads = max(kv_heads_held(model.kv_heads, layout.tp), ranks)
        return local_tokens * (model.attention_dim / layout.tp + 2 * kv_heads * model.head_dim) * nbytes

    out_bytes = local_tokens * model.attention_dim * nbytes / layout.tp
    sp_op = sp_link.collective("all_to_all", qkv(layout.sp), layout.sp) + \
        sp_link.collective("all_to_all", out_bytes, layout.sp)
    if layout.cp > 1 and layout.ring == 1:  # cp's all-to-all: the same exchange over the cp ranks
        sp_op += cp_link.collective("all_to_all", qkv(layout.cp), layout.cp) + \
            cp_link.collective("all_to_all", out_bytes, layout.cp)
    tp_forward, tp_backward = tp_collectives(layout, layers, recomputed, model.moe_layers / layout.pp)
    tp_f, tp_b = tp_forward * tp_op, tp_backward * tp_op
    sp_f, sp_b = layers * sp_op, (layers + recomputed) * sp_op
    ring_f, ring_b = ring_seconds(model, layout, cp_link, local_tokens, layers, recomputed)
    checkpointed = checkpointed_block_indices(model.layers, layout.recompute, layout.every)
    moe_recomputed = sum(model.is_moe_block(i) for i in checkpointed) / max(model.moe_layers, 1)
    moe_f, moe_b = expert_all_to_all(model, layout, cluster, moe_recomputed)
    boundary = local_tokens * model.hidden * nbytes / (layout.tp if layout.tp_sp else 1)
    p2p = link_of(cluster, layout, ("pp",)).collective("p2p", boundary, layout.pp)

    def seconds(flops: float) -> float:
        return flops / split / rate

    if hw.gemm_fraction > 0:  # shape-aware: each op from its shapes (gemm.py)
        from bigtrain.plan.gemm import shape_aware_compute

        extra = seconds(tokens * activation_recompute_flops_per_token(model, layout) / layout.pp)
        f, b, w = shape_aware_compute(model, layout, hw, layers, recomputed, in_i)
        b += extra
    else:
        f, b, w = seconds(forward), seconds(backward), seconds(weight_grad)
        # An MoE block's router and experts run whole on every tp rank (docs/moe.md): their FLOPs
        # are shared by the sequence shards only, not by tp (as gemm.linear_shapes prices them).
        whole = tokens * tp_whole_flops_per_token(model)  # one MoE block
        moe_recomputed_blocks = sum(model.is_moe_block(i) for i in checkpointed_block_indices(
            model.layers, layout.recompute, layout.every)) / layout.pp
        whole_f = whole * model.moe_layers / layout.pp
        whole_b = 2 * whole_f + whole * moe_recomputed_blocks
        # zb-h1's W: the weight gradients of the MoE blocks not recomputed (a recomputed one's run in I)
        whole_w = hw.weight_grad_fraction * 2 * whole * (model.moe_layers / layout.pp - moe_recomputed_blocks)
        unshared = (1 / layout.seq_shards - 1 / split) / rate
        f, b, w = f + whole_f * unshared, b + whole_b * unshared, w + whole_w * unshared

    def exposed(comm: float, compute: float) -> float:  # what the compute beside it does not hide
        return max(comm - hw.comm_overlap * compute, (1 - hw.comm_overlap) * comm)

    if cluster.engine.tp_comm_overlap:  # chunked under the GEMMs; the pipeline's tail stays exposed
        tp_f, tp_b = exposed(tp_f, f), exposed(tp_b, b)
    # The ring sends each hop while the block pair before it computes (ring_attention.py).
    ring_f, ring_b = exposed(ring_f, f), exposed(ring_b, b)
    return StageCosts(f, b, w, tp_f + sp_f + moe_f + ring_f, tp_b + sp_b + moe_b + ring_b, p2p, moe_f + moe_b,
                      ring_f + ring_b)


def tp_whole_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of one MoE block's router, top_k experts and shared expert: the part
    of the block every tp rank runs whole (0 without experts)."""
    if not model.experts:
        return 0.0
    ffn = sum(t.numel for t in model.moe_block_tensors() if t.name.startswith("feed_forward.") and t.decays)
    return 2 * (ffn + model.top_k * 3 * model.expert_ffn * model.hidden)


def tp_collectives(layout: Layout, layers: float, recomputed: float, moe_layers: float = 0.0) -> tuple[float, float]:
    """A pipeline rank's tensor-parallel collectives of one micro-batch, in all-reduces of its
    tokens' hidden states (an all-gather and a reduce-scatter under Megatron SP move one's bytes):
    (forward, backward), as a run counts them (tests/test_plan_grad_traffic.py). Per block two each
    way (attention's and the MLP's output summed; their inputs' gradients summed in backward); the
    vocabulary-parallel embedding's output in the forward and the output layer's input gradient in
    the backward (spread over the stages, as the output layer's FLOPs are); a recomputed block's
    forward stops at its last saved tensor (torch's non-reentrant checkpoint), w2's input, before
    the MLP's output sum: one all-reduce, or under SP two all-gathers and attention's reduce-scatter.
    An MoE block (``moe_layers`` of the ``layers``) runs its experts whole on every tp rank, outside
    any tp region (docs/moe.md): attention's one sum each way, and under SP the all-gather of its
    input (forward) and of its output's gradient (backward) that give it the whole sequence
    (parallel/sequence_moe.py): half an all-reduce's bytes each way (a recomputed MoE block's
    forward: attention's all-gather and reduce-scatter and that all-gather, as a dense block's)."""
    ends = 1 / layout.pp
    recompute = 1.5 if layout.tp_sp else 1.0
    blocks = 2 * layers - moe_layers + (0.5 * moe_layers if layout.tp_sp else 0.0)
    return blocks + ends, blocks + ends + recompute * recomputed


def blocks_with_weight_grads_in_i(model: ModelSpec, layout: Layout, layers: float, recomputed: float) -> float:
    """Of a pipeline rank's ``layers`` blocks, those whose weight gradients zb-h1's I computes with
    the input's (split_backward.py: the parameters inside a ``WholeBackward`` wrapper are eager): the
    ``recomputed`` (checkpointed) ones, and under ``layout.compiled`` every dense Llama block, one
    compiled region (parallel/compile.py). With int8 compression a block is compiled child by child
    around its int8 linears, whose dW W defers as eager; a model with experts keeps the eager rule
    (its attention's dW runs in I, its experts' in W: not split here)."""
    whole = layout.compiled and model.mlp == "swiglu" and not model.experts and layout.compression != "int8"
    return layers if whole else recomputed


def ring_seconds(model: ModelSpec, layout: Layout, link: Link, local_tokens: float, layers: float,
                 recomputed: float) -> tuple[float, float]:
    """Seconds of the cp ring's transfers, one micro-batch, before overlap: (forward, backward).
    Per layer, forward: cp - 1 hops, each sending this rank's keys and values (its tp share) to the
    next rank; backward: the keys and values again (cp - 1 hops) and their gradients, which go on
    home after the last (cp hops); a recomputed layer's forward once more. The keys and values
    travel in the compute dtype, their gradients in fp32 whatever it is (the ring accumulates them
    wide, ring_attention.py). Under hybrid each sp rank's ring passes its cp rank's whole part for
    its share of the heads. A rank passes whole key/value heads: its share of them, or one copy where
    there are fewer than tp (or tp x sp) ranks to share them (tensor-parallel and Ulysses
    replication). The bytes are those tests/test_context_parallel.py counts."""
    if layout.ring == 1:
        return 0.0, 0.0
    kv_heads = kv_heads_held(model.kv_heads, layout.tp, layout.sp)
    elements = local_tokens * layout.sp * 2 * kv_heads * model.head_dim
    cp = layout.ring
    hop = link.collective("p2p", elements * BYTES[layout.precision], cp)
    grad_hop = link.collective("p2p", elements * max(4, BYTES[layout.precision]), cp)
    return layers * (cp - 1) * hop, (layers + recomputed) * (cp - 1) * hop + layers * cp * grad_hop


def expert_all_to_all(model: ModelSpec, layout: Layout, cluster: Cluster, recomputed_share: float = 0.0
                      ) -> tuple[float, float]:
    """Exposed seconds of one micro-batch's expert all-to-alls on a pipeline rank: (forward,
    backward). Per MoE layer, dispatch and combine each move the rank's tokens' top_k copies of
    the hidden state (its part of each sequence under Ulysses or cp), (ep-1)/ep of them leaving the
    rank (tests/test_expert_parallel.py measures it), at an even split of the routings (a skewed
    step's busiest rank takes longer: plan/expert_load.py);
    backward runs both again, and a recomputed layer's forward once more (``recomputed_share``: of
    the MoE layers, those checkpointed; with every = 2 and moe_every = 2 none of them). The ep ranks are
    adjacent inside dp x sp, tp apart: they cross nodes when tp x ep exceeds a node."""
    if not model.experts or layout.ep == 1:
        return 0.0, 0.0
    hw = cluster.hardware
    crosses = layout.tp * layout.ep > cluster.gpus_per_node
    link = Link(hw.inter_node_bandwidth, hw.inter_node_latency_s) if crosses else \
        Link(hw.intra_node_bandwidth, hw.intra_node_latency_s)
    # A rank routes its own sequence shard (Ulysses x cp; Megatron SP gathers the tp shards, so tp
    # does not divide it): exchange_payload's tokens (tests/test_plan_moe.py).
    dispatch, combine = exchange_payload(model, layout, expert_load(model, layout.ep, layout.seq_shards).even)
    layer = link.collective("all_to_all", dispatch, layout.ep) + link.collective("all_to_all", combine, layout.ep)
    layers = model.moe_layers / layout.pp
    return layers * layer, layers * layer * (1 + recomputed_share)


def activation_recompute_flops_per_token(model: ModelSpec, layout: Layout) -> float:
    """Extra FLOPs per token of the fused loss (whole model); selective recomputation's are
    elementwise (see :func:`activation_option_costs`)."""
    flops = 0.0
    if layout.fused_loss:
        flops += 2 * model.vocab * model.hidden  # each chunk's logits again in backward
    return flops


def activation_option_costs(model: ModelSpec, layout: Layout, cluster: Cluster, costs: StageCosts,
                            micro_batches: int) -> dict[str, float]:
    """Seconds per step of selective recomputation (memory-bound), activation offload (what compute
    does not hide) and int8 compression (memory-bound), on the busiest rank."""
    out = {}
    hw = cluster.hardware
    tokens = layout.micro_batch * model.seq / (layout.seq_shards * layout.tp)
    if layout.recompute == "selective":  # the norms' internals and silu's output, made again
        # (compiled: what the compiler recomputes beyond a compiled block's own: the norms' outputs, the product)
        dropped = (block_activations(model, layout.precision, compiled=layout.compiled).per_token()
                   - block_activations(model, layout.precision, "selective", compiled=layout.compiled).per_token())
        out["selective_recompute"] = micro_batches * 2 * dropped * tokens * model.layers / layout.pp / hw.hbm_bandwidth
    if layout.offload:
        moved = max(chunk_activation_bytes(model, layout, r) for r in checked_pp_ranks(layout.pp, layout.split))
        window = OVERLAP * (costs.compute_f + costs.compute_b)
        out["activation_offload"] = micro_batches * max(0.0, 2 * moved / hw.host_bandwidth - window)
    if layout.compression == "int8":
        nbytes = BYTES[layout.precision]
        traffic = 2 * (nbytes + 1) * int8_compressed_width(model) * tokens * model.layers / layout.pp
        out["activation_compression"] = micro_batches * traffic / hw.hbm_bandwidth
    return out


def int8_compressed_width(model: ModelSpec) -> float:
    """Values per token and block (averaged over the blocks) that int8 compression quantizes: the
    inputs of the blocks' nn.Linear layers, one copy per input tensor (memory/compression.py): the
    two norms' outputs, wo's and w2's inputs. An MoE block's experts are no nn.Linear and its router
    is left exact (memory/activations.py), so it compresses the attention's two, and the second norm's
    output and w2's input only for a shared expert (its own SwiGLU size)."""
    dense = 2 * model.hidden + model.attention_dim + model.ffn_hidden
    if not model.experts:
        return dense
    moe = model.hidden + model.attention_dim + (model.hidden + model.shared_ffn if model.shared_expert else 0)
    return (model.moe_layers * moe + (model.layers - model.moe_layers) * dense) / model.layers


# -- the step's boundary -----------------------------------------------------------------------------
# The trainer's small synchronous all-reduces over every rank at each step's end: the loss for the
# metrics (twice: over the pipeline and the replicas), the gradient norm with the overflow flag, and
# the signal agreement (train.py, preemption.py). Each waits for the slowest rank: on NCCL a few
# microseconds, on Gloo a millisecond or two where a layer's compute came before (calibrate_comm.py).
BOUNDARY_COLLECTIVES = 4


def step_boundary_costs(layout: Layout, cluster: Cluster) -> float:
    """Exposed seconds per step of the boundary's tiny collectives over the whole world."""
    return BOUNDARY_COLLECTIVES * link_of(cluster, layout, MESH_AXES).collective("all_reduce", 8, layout.gpus)


# -- offload -------------------------------------------------------------------------------------------
def offload_costs(model: ModelSpec, layout: Layout, cluster: Cluster, costs: StageCosts,
                  micro_batches: int) -> dict[str, float]:
    """Exposed seconds per step of the offload tiers on the busiest rank (with the runtime's GPU path,
    :mod:`bigtrain.plan.tiers`).

    Gradients (``offload_gradients``): every micro-batch's reduced shard (R bytes an element, the
    reduce dtype) goes down over PCIe (``host_bandwidth``) and is added into its fp32 accumulator on
    the host (the first copied, R + 4 bytes an element; the others read and write it, R + 8), at
    ``host_memory_bandwidth``, while the backward goes on: exposed where the slower of the two
    exceeds ``OVERLAP`` of the micro-batch's backward.
    The host step (``offload_optimizer``): the norm reads the accumulators (4 bytes), AdamW streams
    the masters and state in and out and reads the gradient (``host_memory_bandwidth``), the updated
    weights are cast into the staging ring (B) and go up over PCIe; with ``nvme`` the masters and
    state (the state alone with ``offload_masters = cpu``) are read and written once
    (``nvme_bandwidth``) and, at ZeRO 2-3, each micro-batch's fold
    reads and writes the accumulator's file and the step reads it twice. All of it follows the
    backward, exposed, unless ``delayed_update``: then it hides behind the next step's compute up
    to ``OVERLAP``.
    ``offload.params``: ZeRO-3's shard goes up (``cpu``) or is read from its file (``nvme``) before
    each gather (forward and backward of every micro-batch), ahead with the gathers' prefetch,
    hidden up to ``OVERLAP`` of the compute; with ``nvme`` it is written after the step."""
    if not host_step(layout):
        return {}
    hw, nbytes, reduce = cluster.hardware, BYTES[layout.precision], reduce_bytes(layout.precision)
    window = OVERLAP * micro_batches * (costs.compute_f + costs.compute_b)
    worst = {}
    for r in checked_pp_ranks(layout.pp, layout.split):
        root, blocks = rank_units(model, layout, r)
        units = ([root] if root else []) + blocks
        states = unit_state_bytes(units, layout)
        shard = sum(-(-u.numel // (layout.size(u.axis) if layout.zero >= 1 else 1)) for u in units)
        files = layout.offload_optimizer == "nvme" and layout.zero >= 2
        out = {}
        down = reduce * shard / hw.host_bandwidth
        folds = ((reduce + 4) + (micro_batches - 1) * (reduce + 8)) * shard / hw.host_memory_bandwidth
        if files:  # each fold reads the accumulator's file and writes it back (the first only writes)
            folds += (2 * micro_batches - 1) * 4 * shard / hw.nvme_bandwidth
        per_micro_batch = max(down, folds / micro_batches)
        out["offload_gradients"] = micro_batches * max(0.0, per_micro_batch - OVERLAP * costs.compute_b)
        masters_and_state = states["optimizer"] + (0 if layout.precision != "fp32" else 4 * shard)
        seconds = nbytes * shard / hw.host_bandwidth
        seconds += (2 * masters_and_state + (4 + 4 + nbytes) * shard) / hw.host_memory_bandwidth
        if layout.offload_optimizer == "nvme":  # the masters stay in host memory with offload_masters = cpu
            in_files = masters_and_state - (4 * shard if layout.offload_masters == "cpu" else 0)
            seconds += (2 * in_files + (2 * 4 * shard if files else 0)) / hw.nvme_bandwidth
        out["offload_optimizer"] = max(0.0, seconds - window) if layout.delayed_update else seconds
        if layout.offload_params != "none":
            per_gather = nbytes * shard / (hw.nvme_bandwidth if layout.offload_params == "nvme" else hw.host_bandwidth)
            written = nbytes * shard / hw.nvme_bandwidth if layout.offload_params == "nvme" else 0.0
            out["offload_params"] = max(0.0, 2 * micro_batches * per_gather - window) + written
        if sum(out.values()) >= sum(worst.values()):
            worst = out
    return worst


# -- the step --------------------------------------------------------------------------------------
def step_time(model: ModelSpec, layout: Layout, cluster: Cluster, global_batch: int,
              pipeline: PipelineModel | None = None) -> StepTime:
    pipeline = pipeline or PipelineModel()
    m = layout.micro_batches(global_batch)
    costs = stage_costs(model, layout, cluster)
    f, b = costs.compute_f + costs.comm_f, costs.compute_b + costs.comm_b
    weight_grad = costs.compute_w if layout.schedule == "zb-h1" else 0.0
    terms = pipeline.terms(layout.schedule, layout.pp, m, layout.v, f, b, weight_grad, costs.p2p)
    extra = data_parallel_costs(model, layout, cluster, costs, m)
    extra["step_boundary"] = step_boundary_costs(layout, cluster)
    extra.update(activation_option_costs(model, layout, cluster, costs, m))
    extra.update(offload_costs(model, layout, cluster, costs, m))
    total = terms.makespan + sum(extra.values())
    tokens = global_batch * model.seq
    model_flops = tokens * model.model_flops_per_token()
    recomputed = len(checkpointed_block_indices(model.layers, layout.recompute, layout.every))
    hardware_flops = model_flops + tokens * (model.recompute_flops_per_token(recomputed)
                                             + activation_recompute_flops_per_token(model, layout))
    peak = cluster.hardware.peak_flops(layout.precision) * cluster.gpus
    breakdown = {"compute": m * (costs.compute_f + costs.compute_b),
                 "tp_sp_comm": m * (costs.comm_f + costs.comm_b - costs.moe_comm - costs.ring_comm),
                 **({"moe_all_to_all": m * costs.moe_comm} if costs.moe_comm else {}),
                 **({"cp_ring": m * costs.ring_comm} if costs.ring_comm else {}),
                 "pipeline_bubble": terms.bubble, **extra}
    return StepTime(total, tokens / total, model_flops / (total * peak), hardware_flops / (total * peak),
                    model_flops, hardware_flops, m, terms.source, breakdown)
