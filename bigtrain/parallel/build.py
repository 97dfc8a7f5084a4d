"""``parallelize(model, mesh, plan)``: a plain model (built on the meta device) to this rank's part
of it, ready to train; and its steps, each a public function of its own plan object.

The order is the design's: tensor / sequence parallel plans (module structure, still meta) ->
experts over ep (:mod:`bigtrain.parallel.experts`) -> activation checkpointing (and the other
activation-memory wrappers) -> regional compilation (:mod:`bigtrain.parallel.compile`: around
them, inside the engine's hooks) -> pipeline stages -> precision and ZeRO / data parallel, which
materializes only this rank's weights (full replicas, or ZeRO shards over the ranks that hold
replicas of each weight). Each step records what it does to a parameter in the placement record
(:mod:`bigtrain.parallel.placement`), which the later steps and everything after read.
No Config here: the Trainer builds the plan from its Config (:mod:`bigtrain.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn

from bigtrain.distributed.mesh import Mesh
from bigtrain.fp8.linear import apply_float8
from bigtrain.memory.activations import apply_activation_memory, block_list, has_default_blocks
from bigtrain.parallel.compile import apply_compile
from bigtrain.parallel.context import apply_context_parallel
from bigtrain.parallel.experts import apply_expert_parallel
from bigtrain.parallel.parallel_model import ParallelModel, token_loss_sum
from bigtrain.parallel.parallel_plan import ActivationPlan, EnginePlan, ParallelPlan, PipelinePlan, TensorParallelPlan
from bigtrain.parallel.pipeline.partition import PipelineStage, StageGroup, stages_for_rank
from bigtrain.parallel.pipeline.schedules import Schedule, build_schedule
from bigtrain.parallel.placement import Placements
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.tensor.plan import TensorLayout, apply_plan, default_plan, register_partial_grad_hooks
from bigtrain.parallel.tied import TiedCopies, record_tied_copies, shared_parameter_names, to_empty_keeping_ties
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import DynamicLossScaler
from bigtrain.wrappers import transforms_of

__all__ = ["ParallelModel", "Pipeline", "apply_data_parallel", "apply_engine", "apply_expert_parallel",
           "apply_tensor_parallel", "apply_zero",
           "build_pipeline", "parallelize", "token_loss_sum"]

InitFn = Callable[[str, tuple], torch.Tensor]  # (parameter name, full shape) -> full fp32 value


def parallelize(model: nn.Module, mesh: Mesh, plan: ParallelPlan, device: torch.device | str = "cpu",
                init_fn: InitFn | None = None) -> ParallelModel:
    """This rank's part of ``model`` (plain, on the meta device) on ``mesh``, as ``plan`` says.
    ``init_fn``: each parameter's full initial value by name (default: the model's own
    ``initial_value(name, shape, plan.seed)``, as the reference Llama has)."""
    device = torch.device(device)
    given_init_fn = init_fn
    if init_fn is None and not hasattr(model, "initial_value"):
        raise ValueError(f"parallelize: no init_fn, and a {type(model).__name__} has no initial_value(name, shape, "
                         f"seed) method (bigtrain's Llama's): give init_fn=lambda name, shape: <the full fp32 "
                         f"value of that parameter or buffer>")
    init_fn = init_fn or (lambda name, shape: model.initial_value(name, shape, plan.seed))
    float8 = apply_float8(model, plan.float8, device)  # first: the plans below cut and hook the float8 linears
    data_axis, replica_axes = mesh.gradient_axes()  # dp x cp x sp, or HSDP's ZeRO group and its replicas
    # Every weight dense; each step records its change.
    placements = Placements.of_model(model, mesh.comm, data_axis, replica_axes=replica_axes)
    layout = apply_tensor_parallel(model, mesh, plan.tensor, placements)
    apply_context_parallel(model, mesh.comm("cp"), plan.tensor.cp_mode,  # attention over the cut sequence
                           plan.tensor.context_attention)
    apply_expert_parallel(model, mesh, plan.experts, placements)
    ties = shared_parameter_names(model)  # after tensor parallelism, which shards a tied weight once
    activations = apply_activation_memory(model, plan.activations, layout)
    compiled = None
    if plan.compile.enabled:  # the plain loss is compiled too; the vocabulary-parallel one communicates
        plain_loss = activations.head is None and (layout is None or layout.vocab is None)
        split_backward = mesh.comm("pp").size > 1 and plan.pipeline.schedule == "zb-h1"  # keeps the graph
        sixteen_bit = plan.engine.precision.compute in (torch.bfloat16, torch.float16) or float8 is not None
        compiled = apply_compile(model, token_loss_sum if plain_loss else None, keep_graph=split_backward, device=device,
                                 blocks=compiled_blocks(model, plan.activations), sixteen_bit=sixteen_bit,
                                 final_norm=plan.compile.final_norm)
    if float8 is not None:  # the plans above replace some linears (a row-parallel bias): still float8?
        float8.check_kept(model)
    transforms = transforms_of(model)  # before the pipeline split: every rank records the whole model
    pipeline = build_pipeline(model, mesh, plan.pipeline, placements, ties)
    placements, tied = pipeline.placements, TiedCopies.from_placements(pipeline.placements)

    def full_init(name: str, shape: tuple) -> torch.Tensor:
        return init_fn(placements.saved_name(name), shape)  # a tied copy starts as the weight it copies

    # The buffers a constructor computed on the meta device: the engine's to_empty gives them memory,
    # uninitialized (no longer meta), so they are named now.
    meta_buffers = [name for name, b in pipeline.module.named_buffers() if b.is_meta]
    unit_modules = pipeline.unit_modules
    if unit_modules is None and (plan.activations.blocks is not None or has_default_blocks(pipeline.module)):
        # The plan's blocks (a Llama's ``layers`` where it names none, as recomputation takes them),
        # not a guess from the model's structure (default_unit_modules), which makes a one-block
        # model, or blocks in two lists, one unit or the wrong ones.
        unit_modules = [b for b in block_list(pipeline.module, plan.activations).children()
                        if any(True for _ in b.parameters())]
    engine = apply_engine(pipeline.module, mesh, plan, placements.local_init(full_init), placements, device,
                          activations.zero_units(pipeline.module, unit_modules))
    tied.check_layout(engine)
    computed = False
    for module in pipeline.stages.values() or [pipeline.module]:  # after to_empty, which leaves them unset
        if hasattr(module, "init_buffers"):
            module.init_buffers(device)
            computed = True
    problems = []
    if meta_buffers and not computed:  # no method of the model's computes them: init_fn gives them by name
        problems = (buffers_from_init_fn(pipeline.module, meta_buffers, given_init_fn, device)
                    if given_init_fn is not None else [f"{', '.join(meta_buffers)}: no init_fn was given"])
    unset = [name for name, b in pipeline.module.named_buffers() if b.is_meta]
    if unset or problems:  # a buffer nobody computed would train on garbage (or fail far from here)
        raise ValueError(f"buffers of {type(model).__name__} have no values after materialization "
                         f"({'; '.join(problems) or ', '.join(unset) + ': still on the meta device'}): give init_fn "
                         f"their values by name (as for parameters) or the model an init_buffers(device) method")
    register_partial_grad_hooks(pipeline.module, placements)
    compute = plan.engine.precision.compute
    if compute != torch.float32:  # the weights compute in bf16 / fp16: so must a float input meeting them
        for module in pipeline.stages.values() or [pipeline.module]:
            module.register_forward_pre_hook(partial(_float_inputs_to, compute), with_kwargs=True)
    return ParallelModel(pipeline.module, engine, layout, placements, mesh.comm("dp_sp"), mesh.comm("sp"),
                         mesh.comm("pp"), activations.checkpointed, pipeline.stages, pipeline.schedule,
                         tied if tied.names else None, device, activations, float8, transforms, compiled,
                         cp=mesh.comm("cp"), cp_mode=plan.tensor.cp_mode, documents=plan.documents)


def compiled_blocks(model: nn.Module, plan: ActivationPlan) -> nn.Module | None:
    """The container whose children regional compilation compiles one by one: the plan's blocks,
    bigtrain's Llama's ``layers``, or None (``apply_compile`` then takes the model's largest list of
    modules with parameters: a model of one's own need not name its blocks to be compiled)."""
    if plan.blocks is not None or isinstance(getattr(model, "layers", None), nn.Module):
        return block_list(model, plan)
    return None


# -- tensor and sequence parallelism ----------------------------------------------------------------
def apply_tensor_parallel(model: nn.Module, mesh: Mesh, plan: TensorParallelPlan,
                          placements: Placements | None = None) -> TensorLayout | None:
    """Apply ``plan`` (or the model's own) over the mesh's tp and sp axes on the meta device,
    recording each weight's cut and partial gradient in ``placements``; None when both have one rank."""
    tp, sp = mesh.comm("tp"), mesh.comm("sp")
    if tp.size == 1 and sp.size == 1:
        return None
    styles = plan.styles if plan.styles is not None else default_plan(model, tp.size, plan.sequence_parallel,
                                                                        sp.size > 1)
    layout = apply_plan(model, styles, tp, sp, plan.sequence_parallel)
    if placements is not None:
        layout.record(placements)
    return layout


# -- pipeline stages --------------------------------------------------------------------------------
@dataclass
class Pipeline:
    """What this rank holds after the pipeline split (the whole model when pp has one rank)."""

    module: nn.Module  # what the engine owns: the model, this rank's stage, or its stages as a group
    placements: Placements  # of the parameters ``module`` holds
    stages: dict[int, PipelineStage] = field(default_factory=dict)
    schedule: Schedule | None = None
    unit_modules: list[nn.Module] | None = None  # ZeRO units: the blocks (or chunks) of the stages


def build_pipeline(model: nn.Module, mesh: Mesh, plan: PipelinePlan, placements: Placements,
                   ties: dict[str, str] | None = None) -> Pipeline:
    """This pipeline rank's stages of ``model`` and the schedule that runs them; weights tied across
    the split (``ties``: {alias: canonical name}) are recorded as copies over ``pp_ends``, each in
    a ZeRO unit of its own so both ends cut it alike."""
    pp = mesh.comm("pp")
    if pp.size == 1:
        return Pipeline(model, placements)
    stages = stages_for_rank(model, pp.size, pp.rank, plan.virtual, plan.balance,
                             list(plan.split_points) if plan.split_points is not None else None, plan.split)
    schedule = build_schedule(plan.schedule, pp.size, plan.microbatches, plan.virtual)
    if len(stages) == 1:
        module = next(iter(stages.values()))  # the stage is the root unit, its blocks the others
        unit_modules = module.blocks()
    else:  # one engine over all chunks; ZeRO-3 gathers per chunk, the modules the executor calls
        module, unit_modules = StageGroup(stages.values()), list(stages.values())
    placements = placements.restricted_to(module)
    record_tied_copies(module, ties or {}, placements)
    copies = placements.names_partial_over("pp_ends")
    if copies:
        unit_modules = _units_isolating(module, unit_modules, copies)
    return Pipeline(module, placements, stages, schedule, unit_modules)


def _float_inputs_to(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The model's floating-point inputs in the compute dtype (FSDP's ``cast_forward_inputs``): a
    model of one's own taking float features (not token ids) met its bf16 weights with fp32 and
    failed in its first layer (``mat1 and mat2 must have the same dtype``). Token ids and positions
    (integers) pass as they are; a pipeline stage's received activations are in it already."""
    cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def buffers_from_init_fn(model: nn.Module, names: list[str], init_fn: InitFn, device: torch.device) -> list[str]:
    """Give each buffer of ``names`` (ones a module's constructor computed on the meta device,
    whatever the module calls its own init) its full value from ``init_fn`` by name, as parameters
    get theirs (buffers are not sharded). What ``init_fn`` could not give, by name."""
    problems = []
    for name in names:
        buffer = model.get_buffer(name)
        try:
            value = init_fn(name, tuple(buffer.shape))
        except Exception as e:  # noqa: BLE001 - named in the caller's error, with the fix
            problems.append(f"init_fn({name!r}, {tuple(buffer.shape)}) raised {type(e).__name__}: {e}")
            continue
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(device=device, dtype=buffer.dtype)
    return problems


def _units_isolating(model: nn.Module, unit_modules: list[nn.Module], names: list[str]) -> list[nn.Module]:
    """ZeRO units in which each of the weights ``names`` is alone, so that the two copies of a tied
    weight are cut into the same dp shards and can be summed shard by shard (see
    ``TiedCopies.check_layout``). The module holding the weight becomes a unit, placed before the
    unit module that would otherwise take it along (the first chunk of an interleaved rank), or
    last when it would share the root unit (the head beside the final norm; the embedding is alone
    in its stage's root already)."""
    units = list(unit_modules)
    for name in sorted(names):
        param, owner = model.get_parameter(name), model.get_submodule(name.rpartition(".")[0])
        holder = next((i for i, m in enumerate(units) if any(q is param for q in m.parameters())), None)
        if holder is not None:
            units.insert(holder, owner)
        elif any(q is not param for q in _root_parameters(model, units)):
            units.append(owner)
    return units


def _root_parameters(model: nn.Module, unit_modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters no unit module holds: ZeRO's root unit."""
    taken = {id(q) for m in unit_modules for q in m.parameters()}
    return [q for q in model.parameters() if id(q) not in taken]


# -- the engine: precision, ZeRO / data parallel, the optimizer -------------------------------------
def apply_engine(model: nn.Module, mesh: Mesh, plan: ParallelPlan, init_fn: InitFn, placements: Placements,
                 device: torch.device | str = "cpu", unit_modules: list[nn.Module] | None = None
                 ) -> ReplicatedEngine | ZeroEngine:
    """The replicated engine (ZeRO 0 in fp32) or the ZeRO engine, as ``plan.engine`` says."""
    if plan.engine.replicated:
        return apply_data_parallel(model, mesh, plan.engine, plan.optim, init_fn, placements, device)
    return apply_zero(model, mesh, plan.engine, plan.optim, init_fn, placements, device, unit_modules)


def apply_data_parallel(model: nn.Module, mesh: Mesh, plan: EnginePlan, optim, init_fn: InitFn,
                        placements: Placements, device: torch.device | str = "cpu") -> ReplicatedEngine:
    """Materialize ``model`` whole (each weight its rank's part, from ``init_fn``) and replicate it:
    bucketed all-reduce of each gradient over its placement's group, the optimizer on whole weights."""
    to_empty_keeping_ties(model, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_fn(name, tuple(p.shape)))
    return ReplicatedEngine(model, mesh.comm("dp_sp"), optim, plan.bucket_mb, placements, plan.local_sgd_every)


def apply_zero(model: nn.Module, mesh: Mesh, plan: EnginePlan, optim, init_fn: InitFn, placements: Placements,
               device: torch.device | str = "cpu", unit_modules: list[nn.Module] | None = None) -> ZeroEngine:
    """ZeRO stage ``plan.zero`` in ``plan.precision``: each unit (a block; the rest is the root) cut
    over its placement's gradient group, only this rank's shards allocated and initialized."""
    scaler = None
    if plan.precision.compute == torch.float16:
        s = plan.loss_scaling
        scaler = DynamicLossScaler(s.init_scale, s.growth_interval, s.backoff)
    return ZeroEngine(model, mesh.comm("dp_sp"), plan.zero, plan.precision, optim, init_fn=init_fn, device=device,
                      unit_modules=unit_modules, reshard_after_forward=plan.reshard_after_forward,
                      prefetch=plan.prefetch, scaler=scaler, placements=placements, offload=plan.offload)
