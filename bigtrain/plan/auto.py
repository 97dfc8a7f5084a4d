"""``bigtrain train --parallel auto``: the planner picks the layout of a run before it launches."""

from __future__ import annotations

import dataclasses
import functools
import os

from bigtrain.config import Config, ConfigError, with_overrides
from bigtrain.families import family_of
from bigtrain.families.own import none_for, own_step_unpriced
from bigtrain.plan.fit import runtime_compiles, stage_split
from bigtrain.plan.hardware import get_profile, host_share, load_profile, local_hardware, sharing_cores
from bigtrain.plan.layout import Cluster
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.search import SearchResult, readable_rate, search
from bigtrain.validation import validate

def ranks_per_machine(world_size: int) -> int:
    """The ranks on each machine: ``LOCAL_WORLD_SIZE`` under a launcher that sets it (torchrun's
    ``--nproc-per-node``), else all ``world_size`` (bigtrain's launcher starts them on this machine)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and 0 < int(local) <= world_size and world_size % int(local) == 0 else world_size


def auto_overrides(cfg: Config, world_size: int, hardware: str | None = None,
                   hardware_file: str | None = None) -> tuple[list[str], str]:
    """Overrides that set the fastest layout that fits ``world_size`` ranks, and a line saying why.

    The precision stays what the config says; the planner chooses degrees, ZeRO stage, sequence
    parallelism, micro-batch size and checkpointing. ``hardware_file``: a profile of this machine
    (``bigtrain bench --calibrate --output``) instead of the preset."""
    # A family described by its own file (a Hugging Face config.json) is priced as bigtrain's Llama
    # of its shapes (Family.planner_config), as preflight's size check prices it: not the preset's
    # model.* fields, which such a family does not read.
    family = family_of(cfg)
    planner_config = family.planner_config
    if family.own_step is not None:  # its own step and data: no decoder of its shapes prices it
        raise ConfigError(own_step_unpriced(family, "--parallel auto"))
    if planner_config is None and not family.llama_fallbacks:
        raise ConfigError(none_for(family, "planner_config", "--parallel auto (the planner prices a model as "
                                   "bigtrain's Llama of its shapes)", "choose the layout by hand (parallel.dp, ...)"))
    here = local_hardware()
    profile = get_profile(hardware or here) if hardware_file is None else load_profile(hardware_file)
    local = ranks_per_machine(world_size)
    if hardware in (None, "cpu") and here == "cpu":  # this machine's CPU ranks
        # CPU ranks of one host share its cores: planned at one core each, 4 ranks on 2 cores were
        # predicted 2.8x faster than they ran.
        profile = sharing_cores(profile, host_share(local))
    # Machines of as many ranks as the launcher starts on each, not the profile's gpus_per_node
    # (8 for the GPU presets): 2 machines of 4 were planned as one machine of 8, every
    # collective at the intra-machine bandwidth.
    cluster = Cluster.build(world_size, profile, gpus_per_node=local)
    # The activation options are the user's to choose: the search keeps them as configured, and
    # compile.enabled as the run will resolve it on its device (train.device, else the profile's).
    device = "cpu" if cfg.train.device == "cpu" else profile.device
    # (model.attention = 'auto' as well: flex on CUDA, sdpa's dense mask on a CPU)
    model = ModelSpec.from_model_config((planner_config(cfg) if planner_config else cfg).model, cfg.data.seq_len,
                                        device=device)
    fixed = {"precision": cfg.precision.mode, "offload": cfg.memory.activation_offload,
             "compression": cfg.memory.activation_compression, "fused_loss": cfg.model.fused_loss,
             "fp8": cfg.precision.fp8, "compiled": runtime_compiles(cfg, device),
             # ZeRO-3's gathers as configured: the layout's overrides set them, and the search does not vary them
             "reshard_after_forward": cfg.parallel.reshard_after_forward, "prefetch": cfg.parallel.prefetch,
             "checkpoint_async": getattr(cfg.checkpoint, "async"),  # its snapshot's host memory
             "grad_clip": cfg.optim.grad_clip > 0}  # the step's clip pass (plan/dp_cost.py)
    # Each pipeline cut where the run will make it (parallel.pp_split, or pp_balance = 'params'), not evenly.
    split_of = functools.lru_cache(maxsize=None)(lambda pp, v: stage_split(cfg, pp, v))
    try:
        result = search(model, cluster, cfg.train.global_batch, fixed=fixed, precision=cfg.precision.mode,
                        split_of=split_of)
    except ConfigError as e:  # no layout is valid: the planner's reasons, in train's field names
        raise ConfigError([f"--parallel auto --world-size {world_size}: no layout is valid: "
                           + p.replace("--global-batch =", "train.global_batch =") for p in e.problems]
                          + _batch_hint(cfg.train.global_batch, world_size, e.problems)) from None
    if result.best is None:
        closest = result.closest
        lack = f"; closest: {closest.layout.describe()} needs {closest.memory.total / 2**30:.1f} GiB" if closest else ""
        raise ConfigError(f"--parallel auto: no layout of {world_size} rank(s) fits this model{lack}; "
                          f"add ranks or lower train.micro_batch / data.seq_len")
    best = result.best
    if planner_config is not None:  # the fastest fitting layout the family's own rules accept
        best = next((plan for plan in result.ranked if _accepted(cfg, plan.layout.to_overrides())), None)
        if best is None:
            raise ConfigError(f"--parallel auto: no layout of {world_size} rank(s) that fits this model is one "
                              f"model.family = '{cfg.model.family}' runs; choose the layout by hand")
    machines = f"{cluster.nodes} machines of {local}" if cluster.nodes > 1 else f"{world_size}"
    why = (f"--parallel auto: {best.layout.describe()} on {machines} x {cluster.hardware.name}, "
           f"predicted {readable_rate(best.tokens_per_s)} tokens/s ({len(result.ranked)} layouts fit)")
    return best.layout.to_overrides(), why


def _accepted(cfg: Config, overrides: list[str]) -> bool:
    """Whether the run's own validation accepts ``cfg`` with the planner's layout ``overrides``."""
    return not validation_problems(with_overrides(cfg, overrides, "the planner's layout"))


def validation_problems(cfg: Config) -> list[str]:
    try:
        validate(cfg)
    except ConfigError as e:
        return list(e.problems)
    return []


def runnable_plans(cfg: Config, result: SearchResult) -> SearchResult:
    """``result`` with only the ranked layouts the run's own validation accepts besides what it
    says of ``cfg`` already (a family priced as bigtrain's Llama runs fewer layouts than the
    planner models: a Hugging Face decoder has no interleaved stages, for one)."""
    own = set(validation_problems(cfg))
    kept = [plan for plan in result.ranked if set(validation_problems(
        with_overrides(cfg, plan.layout.to_overrides(), "the planner's layout"))) <= own]
    return dataclasses.replace(result, ranked=kept)


def _batch_hint(global_batch: int, world_size: int, problems: list[str]) -> list[str]:
    """The fix when the batch does not split over the ranks: the sizes near it that do."""
    if not any(p.startswith("--global-batch =") for p in problems):
        return []
    lower = global_batch // world_size * world_size
    sizes = " or ".join(str(n) for n in (lower, lower + world_size) if n > 0)
    return [f"set train.global_batch to a multiple of the world size ({sizes}), or choose a --world-size that "
            f"divides train.global_batch = {global_batch}"]
