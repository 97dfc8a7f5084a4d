"""Per-rank memory: model states, saved activations, buffers and an allocator allowance.

Model states (weights, gradients, the optimizer's state) follow the runtime byte for byte:
:mod:`bigtrain.plan.states`.

Activations are the saved tensors of ``activations.py`` for one micro-batch, times the pipeline's
peak in-flight micro-batches on the rank (from the schedule simulator); with activation offload,
two blocks' worth plus the plain loss's log-softmax per micro-batch in flight stay on the device
and the rest is host memory (``detail["host_activations"]``). Buffers are what the
runtime allocates besides (named so tests can compare those they can measure):

    zero_reduce_outputs  one reduce-scatter output per unit (cut over its own group: an expert unit
                         over edp), in the reduce dtype (fp32 under fp16), held until the step
                         (stages 2-3 fold a unit's previous micro-batch in before reducing its next
                         one); bf16 stage 0: the bf16 copy of the fp32 gradients, all-reduced in
                         place; at stages 0-1 only the units with another replica (an expert alone
                         in its edp group keeps its local sum)
    zero_reduce_in_flight  stage 2-3 (and any stage with offload, over more than one replica): the
                         flat gradient of one unit handed to the collective; bf16 stage 1: a unit's
                         bf16 copy of its fp32 gradient
    offload_grad_buckets offload: the device buffers every reduced gradient passes through to the host
    zero3_gathered       stage 3: the root unit (gathered for the whole forward and backward)
                         plus two blocks (the current one and the prefetched one; one without
                         prefetch), every block with reshard_after_forward off
    tp_collective / sp_all_to_all / pp_p2p  one layer's communication buffers (modeled layouts)
    cp_ring              cp's ring: the key/value block held and the next arriving (compute dtype),
                         and the backward's four fp32 gradient blocks (whole key/value heads)
    checkpoint_snapshot  checkpoint.async on a CPU device: the save's copy of the states the rank writes
                         (:func:`checkpoint_snapshot_bytes`; on a GPU it is host memory, in ``host``)
    fused_loss_chunk     the fused loss's one chunk of fp32 logits and exponentials (model.fused_loss)
    fp8_operands         precision.fp8: the largest float8 linear's operand codes during one GEMM
                         (:func:`float8_operand_bytes`); its saved activations: plan/activations.py

Offload (``offload.optimizer`` cpu | nvme, ``offload.params`` cpu | nvme) keeps model states on the
host and in files as the runtime's GPU path does, byte for byte (:mod:`bigtrain.plan.tiers`): the
device keeps what :func:`offloaded_states` returns, the host and the files hold
``detail["host_states"]`` and ``detail["nvme_states"]``; a layout fits when the device, the host
(with the profile's ``host_reserved_bytes``) and the NVMe each hold what they must.

They are added to the end-of-forward activation peak although most live during backward, when
activations are being freed: a conservative bound. The fp32 gradients are counted at that peak too,
except where the runtime frees them between steps (:mod:`bigtrain.parallel.zero.lazy_grads`: ZeRO
0-2 without offload, not fp32 at stages 0-1) and a step is one micro-batch without a pipeline: then
none exist at the end of the forward, and they grow unit by unit while the backward frees
activations (:func:`lazy_grad_moments`): the peak is the largest sum of activations and gradients
held at the end of the forward (no gradients), when the first units' gradients are made (the loss's
and the output layer's activations already freed) and when the last is (one block's activations left). The allocator allowance is the profile's
``fragmentation`` share of all that plus its fixed ``reserved_bytes`` (CUDA context, NCCL and
cuBLAS workspaces); a layout fits when the total is at most the device's memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from bigtrain.parallel.zero.lazy_grads import applies as frees_grads_between_steps
from bigtrain.plan.activations import (block_activations, checkpointed_block_indices, document_mask_bytes,
                                       fused_chunk_bytes, head_activations)
from bigtrain.plan.deferred_grads import deferred_chunk_bytes
from bigtrain.plan.expert_load import expert_load
from bigtrain.plan.gemm import compiles_block, linear_shapes
from bigtrain.plan.hardware import HardwareProfile
from bigtrain.plan.layout import BYTES, Layout
from bigtrain.plan.memo import by_layout_fields, cached
from bigtrain.plan.model import ModelSpec, kv_heads_held
from bigtrain.plan.pipeline import PipelineModel, weight_versions
# state_bytes, zero_formula_bytes: imported from here by callers that predate states.py
from bigtrain.plan.states import (checkpoint_snapshot_bytes, group_sizes, rank_state_bytes, state_bytes,  # noqa: F401
                                  unit_state_bytes, zero_formula_bytes)
from bigtrain.plan.tiers import checkpoint_copy_bytes, host_step, reduce_bytes, tier_detail
# rank_units: imported from here by callers that predate units.py
from bigtrain.plan.units import (Unit, checked_pp_ranks, rank_units, replicas, stage_blocks, units_key,
                                 units_of_key)

MEASURABLE_BUFFERS = ("zero_reduce_outputs", "zero3_gathered")
FUSED_LOSS_CHUNK = 1024  # model.fused_loss_chunk's default: the planner's layouts do not carry it


@dataclass
class RankMemory:
    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: dict[str, int]
    inflight: int
    activation_per_microbatch: int
    allocator: int = 0
    capacity: int = 0
    # Off the device: host memory (offload's states, offloaded activations, the process's own
    # allowance ``host_reserved_bytes``) and NVMe files, against the profile's capacities per GPU.
    host: int = 0
    host_capacity: int = 0
    nvme: int = 0
    nvme_capacity: int = 0
    detail: dict = field(default_factory=dict)
    optimizer_name: str = "adamw"  # whose declared state ``optimizer`` counts
    # Gradients that do not exist at the end of the forward: the (activation bytes, gradient bytes)
    # held together at the moments that can be the peak (:func:`lazy_grad_moments`); None: all of
    # ``grads`` is held through the forward, with all of ``activations``.
    lazy_grads: tuple[tuple[int, int], ...] | None = None

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """States + saved activations + buffers: what tensors hold at the worst moment (the end of
        the forward; with lazy gradients, the start or the end of the backward)."""
        fixed = self.params + self.optimizer + sum(self.buffers.values())
        if self.lazy_grads is None:
            return fixed + self.grads + self.activations
        return fixed + max(activations + grads for activations, grads in self.lazy_grads)

    @property
    def total(self) -> int:
        return self.peak + self.allocator

    @property
    def fits_device(self) -> bool:
        return self.total <= self.capacity

    @property
    def fits(self) -> bool:
        """On the device, in the host's memory and on its NVMe (no fit exceeds any of them)."""
        return self.fits_device and self.host <= self.host_capacity and self.nvme <= self.nvme_capacity

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "model_states": self.model_states, "activations": self.activations,
                "buffers": sum(self.buffers.values()), "buffer_detail": dict(self.buffers),
                "allocator": self.allocator, "total": self.total, "capacity": self.capacity,
                "host": self.host, "host_capacity": self.host_capacity, "nvme": self.nvme,
                "nvme_capacity": self.nvme_capacity,
                "worst_pp_rank": self.pp_rank, "inflight_microbatches": self.inflight,
                "activations_per_microbatch": self.activation_per_microbatch, **self.detail}


# -- activations and buffers ---------------------------------------------------------------------------
def chunk_activation_bytes(model: ModelSpec, layout: Layout, pp_rank: int) -> int:
    """Saved bytes of one micro-batch on the rank's largest stage chunk."""
    return math.ceil(max(blocks + head for blocks, head, _ in _stage_chunks(model, layout, pp_rank)))


def _stage_chunks(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple[tuple[float, float, float], ...]:
    """Per stage chunk of the rank, one micro-batch: (its blocks' saved bytes, the embedding's and
    head's, the largest block's)."""
    return _chunks(model, pp_rank, layout.pp, layout.v, layout.recompute, layout.every, layout.precision,
                   layout.compression, layout.compiled, layout.ep, layout.fused_loss, layout.micro_batch,
                   layout.seq_shards, layout.tp, layout.tp_sp, layout.head_exchange, layout.split, layout.fp8,
                   layout.cp > 1 and layout.cp_mode != "all-to-all")


# Keyed on the layout's fields the saved activations read, so that the layouts of a search that
# differ only in dp, ZeRO stage, schedule kind or offload share them.
@cached()
def _chunks(model: ModelSpec, pp_rank: int, pp: int, v: int, recompute: str, every: int, precision: str,
            compression: str, compiled: bool, ep: int, fused_loss: bool, samples: int, seq_shards: int, tp: int,
            tp_sp: bool, head_exchange: int, split: tuple[int, ...] = (), fp8: str = "none", ring: bool = False
            ) -> tuple[tuple[float, float, float], ...]:
    stages = pp * v
    blocks = stage_blocks(model.layers, stages, split)
    checkpointed = checkpointed_block_indices(model.layers, recompute, every)
    # A model of dense and MoE blocks: each block's own figure (block_activations averages the two
    # over the model, exact only where every block is held alike: not when the blocks a policy
    # checkpoints, or a stage's, are mostly of one kind; every=2 with moe_every=2 keeps the MoE ones)
    rows = expert_load(model, ep, seq_shards).priced if model.experts else 0.0  # an MoE block's experts' rows
    kinds = {kind: block_activations(spec, precision, recompute, compression, compiled=compiled, ep=ep,
                                     routed_rows=rows, fp8=fp8)
             for kind, spec in _block_kinds(model).items()}
    head = head_activations(model, precision, compression, fused_loss, compiled)
    seq = model.seq // seq_shards
    tokens = samples * seq
    mode = dict(tp=tp, tp_sp=tp_sp, ulysses=head_exchange)
    out = []
    for s in range(pp_rank, stages, pp):
        per_block = []
        for i in blocks[s]:
            acts = kinds[len(kinds) > 1 and model.is_moe_block(i)]
            per_block.append(tokens * acts.per_token(checkpointed=i in checkpointed, **mode)
                             + (0 if i in checkpointed else acts.per_block))
        ends = head.bytes(samples, seq, last=s == stages - 1, first=s == 0, **mode)
        # block-causal attention: the chunk's one mask a micro-batch, alive until its first block's backward
        mask = document_mask_bytes(model, samples, precision, ring=ring) if per_block else 0
        out.append((sum(per_block) + mask, ends, max(per_block, default=0.0) + mask))
    return tuple(out)


def _block_kinds(model: ModelSpec) -> dict[bool, ModelSpec]:
    """{False: a model of its dense blocks, True: of its MoE blocks} where it has both; else
    {False: the model} (its one kind of block)."""
    if not model.experts or model.moe_layers in (0, model.layers):
        return {False: model}
    return {False: dataclasses.replace(model, experts=0),
            True: dataclasses.replace(model, moe_every=1, dense_blocks=())}


def offloaded_activation_bytes(model: ModelSpec, layout: Layout, pp_rank: int, inflight: int) -> tuple[int, int]:
    """With activation offload: (saved bytes left on the device, bytes on the host). The device keeps
    two blocks' worth (the one backward is in and the one prefetched; the head's and embedding's
    groups are smaller for the models planned) and, per micro-batch in flight, what no module saves:
    the plain loss's log-softmax (none with the fused loss; compiled, its logits)."""
    chunks = _stage_chunks(model, layout, pp_rank)
    largest = max(b for _, _, b in chunks)
    samples, seq = layout.micro_batch, model.seq // layout.seq_shards
    last = any(s == layout.pp * layout.v - 1 for s in range(pp_rank, layout.pp * layout.v, layout.pp))
    head = head_activations(model, layout.precision, layout.compression, layout.fused_loss, layout.compiled)
    loss = 0.0 if layout.fused_loss or not last else samples * seq * head.loss_per_token(layout.tp)
    host = max(blocks + ends for blocks, ends, _ in chunks) * inflight
    return math.ceil(2 * largest + inflight * loss), math.ceil(host)


def buffer_bytes(model: ModelSpec, layout: Layout, key: tuple, sizes: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """The buffers of a rank whose units are those of ``key`` (:func:`units_key`), over gradient
    groups of ``sizes`` (:func:`group_sizes`)."""
    nbytes, reduce_nbytes = BYTES[layout.precision], reduce_bytes(layout.precision)  # the reduce dtype: fp32 in fp16
    # each unit over its own group (an expert unit over edp: units.py), from ZeRO stage 1 on
    cuts = sizes if layout.zero >= 1 else tuple((axis, 1) for axis, _ in sizes)
    blocks_gathered = None if not layout.reshard_after_forward else 2 if layout.prefetch else 1  # None: every one
    padded_total, padded_largest, shard_total, gathered = _padded_sums(key, cuts, layout.zero == 3, blocks_gathered)
    out: dict[str, int] = {}
    reduced = replicas(layout) > 1  # one replica reduces nothing
    if host_step(layout):  # offload: every micro-batch reduces into the gradient buckets (offload_grad_buckets)
        if reduced:  # the flat gradient of one unit handed to the collective (one replica writes the bucket)
            out["zero_reduce_in_flight"] = reduce_nbytes * padded_largest
    elif layout.zero >= 2:  # every unit's reduce-scatter output (a group of one's too), and one flat gradient
        out["zero_reduce_outputs"] = reduce_nbytes * shard_total
        out["zero_reduce_in_flight"] = reduce_nbytes * padded_largest
    else:
        # Stages 0-1 reduce only the units with another replica (grad_sync.py: a unit alone in its
        # group, an expert under ep = dp, keeps its local sum), from the fp32 buffer: stage 1 into a
        # shard in the reduce dtype, stage 0 in place, through a copy where that dtype is not fp32
        # (bf16; fp16 reduces in fp32, precision.py), a unit's copy handed to the collective at stage 1.
        hybrid = bool(layout.gradient_axes()[1])
        groups = tuple(axis for axis, n in sizes if n > 1 or hybrid)
        total, largest, shards = _reduced_sums(key, cuts, groups)
        if layout.zero == 1 and shards:
            out["zero_reduce_outputs"] = reduce_nbytes * shards
        elif layout.zero == 0 and reduce_nbytes < 4 and total:
            out["zero_reduce_outputs"] = reduce_nbytes * total
        if layout.zero == 1 and reduce_nbytes < 4 and largest:
            out["zero_reduce_in_flight"] = reduce_nbytes * largest
    if layout.zero == 3:
        weight = nbytes if layout.precision != "fp32" else 4
        out["zero3_gathered"] = weight * gathered
    tokens = layout.micro_batch * model.seq // layout.seq_shards
    if layout.tp > 1:
        out["tp_collective"] = 2 * tokens * model.hidden * nbytes
    if layout.head_exchange > 1:  # Ulysses, or cp's all-to-all: q, k, v out and the output back
        out["sp_all_to_all"] = tokens * (2 * model.attention_dim + 2 * model.kv_dim) * nbytes // layout.tp
    if layout.ring > 1:
        # the ring's key/value block held and the next arriving, in the compute dtype, and in its
        # backward four fp32 gradient blocks at once (ring_attention.py: the one arrived, this rank's
        # share, their sum being sent, the next arriving); a block holds whole key/value heads, as
        # cost.ring_seconds passes them (replicated where fewer than tp x sp)
        elements = tokens * layout.sp * 2 * kv_heads_held(model.kv_heads, layout.tp, layout.sp) * model.head_dim
        out["cp_ring"] = elements * (2 * nbytes + 4 * max(4, nbytes))
    if layout.pp > 1:
        out["pp_p2p"] = 2 * tokens * model.hidden * nbytes // (layout.tp if layout.tp_sp else 1)
    if model.experts and layout.ep > 1:  # one MoE layer's dispatch: the rows sent and received
        received = expert_load(model, layout.ep, layout.seq_shards).priced
        out["moe_all_to_all"] = math.ceil(tokens * (model.top_k + received) * model.hidden * nbytes)
    if layout.fused_loss:  # on the last stage; counted on every rank (a bound)
        out["fused_loss_chunk"] = fused_chunk_bytes(model, FUSED_LOSS_CHUNK, layout.tp)
    if layout.fp8 != "none":
        out["fp8_operands"] = float8_operand_bytes(model, layout)
    return out


@cached()
def _padded_sums(key: tuple, sizes: tuple[tuple[str, int], ...], zero3: bool, blocks_gathered: int | None = 2
                 ) -> tuple[int, int, int, int]:
    """Of a rank's units (a :func:`units_key`), each padded to a multiple of its group's ``sizes``:
    (the padded elements, the largest unit's, the shards' elements, and at ZeRO-3 the elements
    gathered at once: the root unit and the ``blocks_gathered`` largest block modules, the current one and the
    prefetched one; every one where ``blocks_gathered`` is None, reshard_after_forward off)."""
    root, blocks = units_of_key(key)
    cut = dict(sizes)

    def padded_numel(u: Unit) -> int:
        return -(-u.numel // cut[u.axis]) * cut[u.axis]

    units = ([root] if root else []) + list(blocks)
    padded = [padded_numel(u) for u in units]
    shard_total = sum(padded_numel(u) // cut[u.axis] for u in units)
    gathered = 0
    if zero3:
        # per block module: an MoE block under ep is two units (its dense weights, its experts over
        # edp), gathered together (gather.py)
        dense_axis = sizes[0][0]
        modules: list[int] = []
        for u in blocks:
            if u.axis != dense_axis and modules:
                modules[-1] += padded_numel(u)
            else:
                modules.append(padded_numel(u))
        root_size = padded_numel(root) if root else 0
        gathered = root_size + sum(sorted(modules, reverse=True)[:blocks_gathered])
    return sum(padded), max(padded, default=0), shard_total, gathered


@cached()
def _reduced_sums(key: tuple, sizes: tuple[tuple[str, int], ...], groups: tuple[str, ...]) -> tuple[int, int, int]:
    """:func:`_padded_sums`' (padded elements, the largest unit's, the shards' elements) of the
    units whose gradient axis is one of ``groups`` (those a stage 0-1 engine reduces)."""
    root, blocks = units_of_key(key)
    cut = dict(sizes)
    padded = [(-(-u.numel // cut[u.axis]) * cut[u.axis], cut[u.axis])
              for u in ([root] if root else []) + list(blocks) if u.axis in groups]
    return sum(p for p, _ in padded), max((p for p, _ in padded), default=0), sum(p // n for p, n in padded)


def float8_operand_bytes(model: ModelSpec, layout: Layout) -> int:
    """What one float8 linear (bigtrain/fp8) allocates during its largest GEMM, the worst linear of a
    block. Forward: x's and W's codes (M K + N K bytes). dX = dY W: dY's codes, and W's in its own
    layout and transposed (M N + 2 N K). dW = dY^T x: dY's and x's codes, each in its own layout and
    transposed (2 (M N + M K)); only float8 codes are transposed (scaling.quantize_transposed). Eager,
    the quantization's division holds a compute-dtype copy of the operand besides (B x the largest
    operand); a compiled graph casts in the kernel that divides. Freed after the GEMM. The saved
    activations are plan/activations.py's (``_float8_items``)."""
    b, tokens = BYTES[layout.precision], layout.micro_batch * model.seq / layout.seq_shards
    kinds = [moe for moe, present in ((False, model.layers > model.moe_layers), (True, model.moe_layers > 0))
             if present]  # dense blocks, MoE blocks
    shapes = [(n, k) for moe in kinds for _, n, k, _, float8 in linear_shapes(model, layout, tokens, moe) if float8]
    eager = 0 if compiles_block(model, layout) else b
    per_gemm = [max(tokens * k + n * k, tokens * n + 2 * n * k, 2 * tokens * (n + k)) + eager * max(tokens * k, n * k,
                tokens * n) for n, k in shapes]
    return math.ceil(max(per_gemm, default=0))


# -- one rank, and the worst one ----------------------------------------------------------------------
def rank_memory(model: ModelSpec, layout: Layout, hardware: HardwareProfile, global_batch: int, pp_rank: int,
                inflight: int, optimizer: str = "adamw", block: int = 256, held_bytes: float | None = None
                ) -> RankMemory:
    """One pipeline rank's memory; ``held_bytes``: the most activation bytes its schedule holds at once
    (:meth:`PipelineModel.peak_held_bytes`), else ``inflight`` times its largest chunk's."""
    key, sizes = units_key(model, layout, pp_rank), group_sizes(layout)
    root, blocks = units_of_key(key)
    units = ([root] if root else []) + list(blocks)
    tiers = (tier_detail(units, layout, optimizer, block, host_is_device=hardware.device == "cpu")
             if host_step(layout) else None)
    if tiers is not None:
        states, moved = offloaded_states(tiers)
    else:
        states = dict(rank_state_bytes(key, layout.zero, layout.precision, sizes, optimizer, block))
        moved = {"host": 0, "nvme": 0}
    per_mb = chunk_activation_bytes(model, layout, pp_rank)
    buffers = buffer_bytes(model, layout, key, sizes)
    if tiers is not None and tiers["device"].get("grad_buckets"):
        buffers["offload_grad_buckets"] = tiers["device"]["grad_buckets"]
    versions = weight_versions(layout.schedule, layout.pp, pp_rank)
    if versions:  # asynchronous pipelines: stashed copies of the rank's weights
        buffers["weight_versions"] = versions * states["params"]
    activations, host = (per_mb * inflight if held_bytes is None else math.ceil(held_bytes)), 0
    if layout.offload:
        activations, host = offloaded_activation_bytes(model, layout, pp_rank, inflight)
    # A checkpoint save of an offload layout holds a few copies (the delayed update's weights in
    # use, one chunk out of the files) between steps, when no offloaded activation is held: the
    # host holds the larger of the two. On a CPU device that memory is the device's.
    copies = checkpoint_copy_bytes(units, layout) if tiers is not None else 0
    on_host = max(host, copies) if hardware.device != "cpu" else host
    # checkpoint.async: the save's snapshot in host memory while the write overlaps the next steps
    # (on a CPU device the host is the device: a buffer beside the step's peak)
    snapshot = checkpoint_snapshot_bytes(units, layout, optimizer, block) if layout.checkpoint_async else 0
    if snapshot and hardware.device == "cpu":
        buffers["checkpoint_snapshot"] = snapshot
    elif snapshot:
        on_host += snapshot
    mem = RankMemory(pp_rank, states["params"], states["grads"], states["optimizer"], activations, buffers,
                     inflight, per_mb, capacity=hardware.memory_bytes,
                     host=moved["host"] + on_host + hardware.host_reserved_bytes, host_capacity=hardware.host_memory_bytes,
                     nvme=moved["nvme"], nvme_capacity=hardware.nvme_bytes)
    mem.detail["host_activations"] = host
    mem.detail["checkpoint_copies"] = copies
    mem.detail["checkpoint_snapshot"] = snapshot
    mem.lazy_grads = lazy_grad_moments(model, layout, global_batch, root, list(blocks), pp_rank, mem.activations,
                                       mem.grads, optimizer, block)
    if mem.lazy_grads is not None:
        mem.detail["lazy_grads"] = [list(moment) for moment in mem.lazy_grads]
    mem.detail["host_states"], mem.detail["nvme_states"] = moved["host"], moved["nvme"]
    if tiers is not None:
        mem.detail["tiers"] = tiers
    mem.allocator = math.ceil(hardware.fragmentation * mem.peak) + hardware.reserved_bytes
    return mem


def lazy_grad_moments(model: ModelSpec, layout: Layout, global_batch: int, root: Unit | None,
                      blocks: list[Unit], pp_rank: int, activations: int, grads: int, optimizer: str = "adamw",
                      block: int = 256) -> tuple[tuple[int, int], ...] | None:
    """:attr:`RankMemory.lazy_grads`, where the runtime frees the fp32 gradients between steps and a
    step is one micro-batch without a pipeline (with more, the gradients of the first are held
    through the forwards of the others); None elsewhere. The (activations, gradients) held at:

    - the end of the forward: every activation, no gradient;
    - stages 0-1, the first gradients: a unit's buffer grows at its first gradient, the root unit's
      at the output layer's (the loss's and the output layer's saved tensors are freed by then:
      all of the head's are left out, as the final norm's are few) and the last block's next;
    - stages 0-1, the last block's: every gradient, and that block's activations at most.
    - stage 2: every reduced shard is folded in after the backward, when no activation is left (the
      reduce-scatter outputs held until then are the ``zero_reduce_outputs`` buffer).
    """
    in_place = layout.zero <= 1 and layout.precision == "fp32"
    if (not frees_grads_between_steps(layout.zero, in_place, host_step(layout)) or layout.pp > 1
            or layout.micro_batches(global_batch) > 1):
        return None
    if layout.zero >= 2:
        return (activations, 0), (0, grads)
    (_, head, largest), = _stage_chunks(model, layout, pp_rank)
    last_block = blocks[-2:] if model.experts and layout.ep > 1 else blocks[-1:]  # its experts: a unit apart
    first = sum(unit_state_bytes([u], layout, optimizer, block)["grads"] for u in ([root] if root else []) + last_block)
    return (activations, 0), (max(0, activations - math.ceil(head)), first), (min(activations, math.ceil(largest)), grads)


def offloaded_states(tiers: dict[str, dict[str, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """(model states left on the device, bytes on the ``host`` and in ``nvme`` files) of an offload
    layout from its :func:`~bigtrain.plan.tiers.tier_detail`, as the runtime holds them (on a CPU
    device the masters and the optimizer's state are the device's too)."""
    held = tiers["device"]
    device = {"params": held.get("params", 0), "grads": held.get("grads", 0),
              "optimizer": held.get("masters", 0) + held.get("state", 0)}
    return device, {tier: sum(tiers[tier].values()) for tier in ("host", "nvme")}


@by_layout_fields("micro_batch", "schedule", "recompute", "every", "tp_sp", "offload", "compression", "fused_loss",
                  "fp8", "compiled", "cp_mode", "offload_masters", "delayed_update")
def device_lower_bound(model: ModelSpec, layout: Layout, hardware: HardwareProfile, optimizer: str = "adamw",
                       block: int = 256) -> int:
    """A bound that :func:`estimate_memory`'s ``total`` never falls below, from the model states alone
    (cached per units, ZeRO stage and group sizes, so a search can skip the rest of a layout that
    cannot fit): on any rank the peak holds at least the states (buffers and activations are never
    negative, and with lazy gradients one of the moments holds all of them) and the total adds the
    allocator's share of the peak and its reserve. 0 (no bound) under offload, whose states the
    device holds only in part."""
    if host_step(layout) or hardware.fragmentation < 0:
        return 0
    sizes = group_sizes(layout)
    states = max(sum(rank_state_bytes(units_key(model, layout, r), layout.zero, layout.precision, sizes, optimizer,
                                       block).values()) for r in checked_pp_ranks(layout.pp, layout.split))
    return states + math.ceil(hardware.fragmentation * states) + hardware.reserved_bytes


def estimate_memory(model: ModelSpec, layout: Layout, hardware: HardwareProfile, global_batch: int,
                    pipeline: PipelineModel | None = None, optimizer: str = "adamw", block: int = 256
                    ) -> RankMemory:
    """The worst rank's memory with ``optimizer`` (a registered ``optim.name``); every tp/sp/dp rank
    of a pipeline rank is alike, up to the optimizer's per-tensor state (AdamW's step counts),
    taken at its worst."""
    pipeline = pipeline or PipelineModel()
    peaks = pipeline.terms(layout.schedule, layout.pp, layout.micro_batches(global_batch), layout.v,
                           1.0, 2.0, 1.0 if layout.schedule == "zb-h1" else 0.0).peak_inflight
    m = layout.micro_batches(global_batch)

    def held_bytes(r: int) -> float | None:  # interleaved: a rank's chunks differ (the last one has the loss)
        split = layout.schedule == "zb-h1" and layout.pp > 1  # W's gradients, held from I on
        if layout.v == 1 and not split:
            return None
        chunks = tuple(blocks + ends for blocks, ends, _ in _stage_chunks(model, layout, r))
        deferred = deferred_chunk_bytes(model, layout, r) if split else ()
        held = pipeline.peak_held_bytes(layout.schedule, layout.pp, m, layout.v, r, chunks, deferred)
        if held is None and split:  # not walked: every micro-batch in flight holding both, a bound
            held = peaks[r] * max(c + d for c, d in zip(chunks, deferred))
        return held

    ranks = [rank_memory(model, layout, hardware, global_batch, r, peaks[r], optimizer, block, held_bytes(r))
             for r in checked_pp_ranks(layout.pp, layout.split)]
    worst = max(ranks, key=lambda m: m.total)
    acts = block_activations(model, layout.precision, layout.recompute, layout.compression, compiled=layout.compiled,
                             fp8=layout.fp8)
    worst.detail.update({"activation_c1": round(acts.c1, 4), "activation_c2": round(acts.c2, 4)})
    if model.experts and model.moe_layers:  # what the activations assume of the routing (expert_load.py)
        load = expert_load(model, layout.ep, layout.seq_shards)
        worst.detail["moe_expert_rows"] = {"priced": load.priced, "even": load.even, "worst": load.worst,
                                           "capacity_bound": load.bounded}
    worst.optimizer_name = optimizer
    return worst


def add_skewed_routing(memory: RankMemory, model: ModelSpec, layout: Layout, hardware: HardwareProfile,
                       global_batch: int, pipeline: PipelineModel | None = None, optimizer: str = "adamw",
                       block: int = 256) -> None:
    """Dropless under ep, where the activations are priced at an even split of the routings: the
    worst rank's memory with a fully skewed router (plan/expert_load.py) beside it, in
    ``memory.detail["moe_expert_rows"]`` (skewed_activations, skewed_total, skewed_fits). Asked for
    the plans a report shows, not for every layout of a search (it is a second estimate)."""
    rows = memory.detail.get("moe_expert_rows")
    if rows is None or rows["worst"] <= rows["priced"]:
        return
    skewed = estimate_memory(dataclasses.replace(model, skewed_routing=True), layout, hardware, global_batch,
                             pipeline, optimizer, block)
    rows.update(skewed_activations=skewed.activations, skewed_total=skewed.total, skewed_fits=skewed.fits)
