"""What :func:`bigtrain.parallel.build.parallelize` does to a model, as small plan objects, one per step.

A user's script builds them directly; the Trainer builds them from its Config
(:func:`bigtrain.from_config.parallel_plan`), the only place a Config meets ``bigtrain.parallel``.
Each plan is what one public step takes, so a step can also be called on its own:

    apply_tensor_parallel(model, mesh, TensorParallelPlan, placements)
    apply_expert_parallel(model, mesh, ExpertPlan, placements)
    apply_float8(model, Float8Plan, device)                  # the blocks' linears in float8 (first)
    apply_activation_memory(model, ActivationPlan, layout)   # recomputation, offload, int8, fused head
    apply_compile(model, loss_fn)                             # CompilePlan: regional torch.compile
    build_pipeline(model, mesh, PipelinePlan, placements)
    apply_data_parallel / apply_zero(model, mesh, EnginePlan, optim, init_fn, placements, ...)

The optimizer's own settings (``optim.name``, lr, betas, weight decay: what an optimizer's build
function reads) travel as the config section they are, :class:`bigtrain.config.OptimConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from bigtrain.core.documents import DocumentBoundaries
from bigtrain.precision import Precision

if TYPE_CHECKING:
    from bigtrain.config import OptimConfig
    from bigtrain.parallel.tensor.plan import Plan


@dataclass(frozen=True)
class TensorParallelPlan:
    """Tensor parallelism over the mesh's ``tp`` axis, Ulysses over ``sp`` (each applied when its
    axis has more than one rank). ``styles``: ``{module-name pattern: style}``; None takes the
    model's own plan (the reference Llama's Megatron layout)."""

    styles: "Plan | None" = None
    sequence_parallel: bool = False  # Megatron sequence parallelism on the tp axis
    cp_mode: str = "ring"  # attention over the cp axis (bigtrain/parallel/context.py): 'ring', 'all-to-all', 'hybrid'
    # How the model's attention turns context-parallel, (model, cp comm, cp_mode) -> the names of what
    # changed, by the model family (Family.context_parallel); None: bigtrain's Llama's attention cores.
    context_attention: Callable | None = None


@dataclass(frozen=True)
class ExpertPlan:
    """Mixture-of-experts blocks' experts over the mesh's ``ep`` axis (cut when it has more than one
    rank); ``grouped_mm``: run each rank's experts with ``torch._grouped_mm`` (one kernel) rather
    than a loop over them."""

    grouped_mm: bool = False


@dataclass(frozen=True)
class ActivationPlan:
    """What the model keeps for backward (bigtrain/memory/activations.py, docs/activations.md)."""

    policy: str = "none"  # recomputation: 'none', 'full', 'every' k-th block, or 'selective'
    every: int = 1
    selective_attention: bool = False  # with 'selective': recompute the attention core too
    offload: bool = False  # saved tensors to host memory, prefetched one module ahead in backward
    offload_min_bytes: int = 0  # smaller saved tensors stay where they are
    compression: str = "none"  # 'int8': linear layers' saved inputs as int8 with per-row scales
    fused_loss: bool = False  # the head and the cross-entropy in chunks of tokens, never all logits
    fused_loss_chunk: int = 1024
    # The container of the model's blocks (what recomputation wraps), by the model family: model ->
    # its nn.ModuleList; None: the model's ``layers`` (the reference Llama's).
    blocks: Callable | None = None
    head: str = "output"  # the model's output projection (a dotted attribute path): what the fused loss wraps

    def __post_init__(self):
        # The Config is validated before launch (bigtrain/validation.py); a plan built in Python is
        # checked here: an unknown compression was silently no compression (full-size saved inputs,
        # the memory the plan counted on never saved), and a zero step a range() error at the first step.
        problems = []
        if self.policy not in ACTIVATION_POLICIES:
            problems.append(f"policy={self.policy!r}: must be one of {', '.join(map(repr, ACTIVATION_POLICIES))}")
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression={self.compression!r}: must be one of {', '.join(map(repr, COMPRESSIONS))}")
        for name in ("every", "fused_loss_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r}: must be a whole number >= 1")
        if not isinstance(self.offload_min_bytes, int) or self.offload_min_bytes < 0:
            problems.append(f"offload_min_bytes={self.offload_min_bytes!r}: must be a whole number >= 0")
        if problems:
            raise ValueError(f"ActivationPlan: {'; '.join(problems)}")


ACTIVATION_POLICIES = ("none", "full", "every", "selective")  # bigtrain.validation.CHECKPOINTING_POLICIES
COMPRESSIONS = ("none", "int8")  # memory.activation_compression's values


@dataclass(frozen=True)
class Float8Plan:
    """The blocks' linear layers in float8 (bigtrain/fp8, docs/precision.md): ``scaling`` 'none',
    'tensorwise' or 'rowwise'; ``emulate``: quantize and multiply in the compute dtype instead of
    float8 kernels (which need CUDA capability >= 8.9)."""

    scaling: str = "none"
    emulate: bool = False
    blocks: Callable | None = None  # the container of the blocks whose linears turn float8 (None: ``layers``)


@dataclass(frozen=True)
class CompilePlan:
    """Regional ``torch.compile`` of the blocks, the final norm and the plain loss
    (bigtrain/parallel/compile.py, docs/compile.md)."""

    enabled: bool = False
    final_norm: str | None = "norm"  # the dotted name of the final norm, a region of its own when the model has one


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline stages over the mesh's ``pp`` axis (applied when it has more than one rank)."""

    microbatches: int = 1  # per step and pipeline (the gradient-accumulation steps)
    schedule: str = "1f1b"
    virtual: int = 1  # stages per rank (the 'interleaved' schedule)
    balance: str = "layers"  # without split_points: balance by 'layers' or 'params'
    split_points: tuple[int, ...] | None = None  # first layer of stages 1..pp*v-1
    # The model family's split into stages, (model, stages, balance, split_points) -> stages; None:
    # the reference Llama's or an nn.Sequential's (bigtrain.parallel.pipeline.partition.split_model).
    split: Callable | None = None


@dataclass(frozen=True)
class LossScaling:
    """fp16's dynamic loss scale (see :class:`bigtrain.precision.DynamicLossScaler`)."""

    init_scale: float = 2.0**16
    growth_interval: int = 1000
    backoff: float = 0.5


@dataclass(frozen=True)
class EnginePlan:
    """Who owns the weights, gradients and optimizer state: the replicated engine (``zero = 0`` in
    fp32) or the ZeRO engine (stages 0-3, any precision), over each weight's data-parallel group."""

    zero: int = 0
    precision: Precision = field(default_factory=lambda: Precision(torch.float32, torch.float32))
    loss_scaling: LossScaling = LossScaling()  # used in fp16 only
    reshard_after_forward: bool = True  # ZeRO-3
    prefetch: bool = True  # ZeRO-3
    bucket_mb: float = 25.0  # the replicated engine's all-reduce buckets
    local_sgd_every: int = 1  # > 1: replicas step alone, parameters averaged every K steps (local SGD)
    offload: "OffloadPlan" = field(default_factory=lambda: _no_offload())  # ZeRO-Offload / -Infinity tiers

    @property
    def replicated(self) -> bool:
        return self.zero == 0 and not self.precision.mixed


def _no_offload():
    from bigtrain.parallel.zero.offload import OffloadPlan

    return OffloadPlan()


@dataclass(frozen=True)
class ParallelPlan:
    """Everything :func:`parallelize` needs besides the model and the mesh."""

    optim: "OptimConfig"
    tensor: TensorParallelPlan = TensorParallelPlan()
    experts: ExpertPlan = ExpertPlan()
    activations: ActivationPlan = ActivationPlan()
    pipeline: PipelinePlan = PipelinePlan()
    engine: EnginePlan = EnginePlan()
    float8: Float8Plan = Float8Plan()
    compile: CompilePlan = CompilePlan()
    seed: int = 0  # of the model's initial values (which depend on the name and the seed only)
    # Block-causal attention (model.attn_mask): the ids that delimit documents; None: causal. The
    # model is then called with each micro-batch's ``documents`` (and ``positions``): its forward takes them.
    documents: DocumentBoundaries | None = None
