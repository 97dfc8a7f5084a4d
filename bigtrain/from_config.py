"""The Trainer's adapter: the parallelize plan a Config describes.

The only place where a :class:`bigtrain.config.Config` meets ``bigtrain.parallel``: everything
below it takes its own section or a small plan object (:mod:`bigtrain.parallel.parallel_plan`),
so the same steps run on a user's model without a Config.
"""

from __future__ import annotations

import os

from bigtrain.config import Config
from bigtrain.core.documents import DocumentBoundaries
from bigtrain.data.boundaries import boundary_ids
from bigtrain.parallel.parallel_plan import (ActivationPlan, CompilePlan, EnginePlan, ExpertPlan, Float8Plan,
                                             LossScaling,
                                             ParallelPlan, PipelinePlan, TensorParallelPlan)
from bigtrain.parallel.zero.offload import OffloadPlan
from bigtrain.precision import Precision


def activation_plan(cfg: Config) -> ActivationPlan:
    m = cfg.memory
    return ActivationPlan(m.checkpointing, m.checkpoint_every, m.selective_attention, m.activation_offload,
                          m.offload_min_bytes, m.activation_compression, cfg.model.fused_loss, cfg.model.fused_loss_chunk)


def offload_plan(cfg: Config, run_dir: str | None = None) -> OffloadPlan:
    o = cfg.offload
    # '~' as the other path fields take it (a TOML file's value reaches no shell): unexpanded, the files
    # went to a folder named '~' on the working directory's disk.
    directory = os.path.expanduser(o.nvme_dir) if o.nvme_dir else (f"{run_dir}/offload" if run_dir else "")
    return OffloadPlan(o.optimizer, o.params, directory, o.prefetch_depth, o.delayed_update, o.grad_buckets,
                       masters=o.masters)


def compile_enabled(cfg: Config, device_type: str, family_compiles: bool) -> bool:
    """``compile.enabled`` on a device of this type, for a model whose family compiles its blocks
    (``Family.compiles``) or not (:func:`compiles`)."""
    return compiles(cfg.compile.enabled, device_type, family_compiles)


def compiles(setting: str, device_type: str, family_compiles: bool) -> bool:
    """Whether ``compile.enabled = setting`` compiles on a ``device_type`` device: 'auto' compiles a
    family whose blocks compile (bigtrain's Llama, the Hugging Face decoders) on CUDA only
    (docs/compile.md: on a CPU the compile time outweighs what the shorter steps save over a run of
    usual length). The planner asks the same (plan/fit.py)."""
    return setting == "true" or (setting == "auto" and device_type == "cuda" and family_compiles)


def parallel_plan(cfg: Config, run_dir: str | None = None, device_type: str = "cpu",
                  family_compiles: bool = False) -> ParallelPlan:
    """``family_compiles``: the model's family compiles its blocks (``Family.compiles``), so
    ``compile.enabled = 'auto'`` may compile them."""
    p, precision = cfg.parallel, cfg.precision
    split_points = tuple(p.split_points) if p.split_points is not None else None
    return ParallelPlan(
        optim=cfg.optim,
        tensor=TensorParallelPlan(sequence_parallel=p.sequence_parallel, cp_mode=p.cp_mode),
        experts=ExpertPlan(grouped_mm=p.moe_grouped_mm),
        activations=activation_plan(cfg),
        pipeline=PipelinePlan(cfg.train.grad_accum(p.dp), p.pp_schedule, p.pp_virtual, p.pp_balance, split_points),
        engine=EnginePlan(p.zero, Precision.from_config(precision),
                          LossScaling(precision.loss_scale, precision.scale_growth_interval, precision.scale_backoff),
                          p.reshard_after_forward, p.prefetch, p.bucket_mb,
                          p.local_sgd_every if p.dp_sync == "local-sgd" else 1, offload_plan(cfg, run_dir)),
        float8=Float8Plan(precision.fp8, precision.fp8_emulate),
        compile=CompilePlan(compile_enabled(cfg, device_type, family_compiles)),
        seed=cfg.train.seed,
        documents=document_boundaries(cfg),
    )


def document_boundaries(cfg: Config) -> DocumentBoundaries | None:
    """model.attn_mask = 'block_causal': the corpus's document delimiters (validation refused a
    corpus without one); None: causal attention."""
    if cfg.model.attn_mask != "block_causal":
        return None
    starts, ends = boundary_ids(cfg.data)
    return DocumentBoundaries(starts, ends, cfg.model.reset_positions)
