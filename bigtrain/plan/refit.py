"""A layout that would fit: what ``bigtrain train`` proposes when it refuses a run for its size.

The fit check (``fit.py``) says why a run does not fit; this module, above it (it asks the fit check
again of what it proposes), adds the fix (:func:`size_problems_and_fixes`): it asks the planner's
search for a layout of the same model that does, first on this machine (the same number of ranks, each with the
memory it really gets: on CPU the host's memory shared by the local ranks, on CUDA one device),
and, when none does, on the fewest machines like this one (one rank each, doubling up to
``MACHINES_MAX``). A layout proposed for this machine is checked again by the fit check itself and
by the config's validation, so following the advice never leads to a second refusal.

The search may change the degrees, the ZeRO stage, the pipeline schedule, checkpointing and the
micro-batch; the precision, the optimizer and the activation options stay what the config says.
"""

from __future__ import annotations

import dataclasses
import functools

from bigtrain.config import Config, ConfigError, with_overrides
from bigtrain.plan.fit import runtime_compiles, size_check, size_problems, stage_split

MACHINES_MAX = 1024
CANDIDATES = 24  # fitting layouts (fastest first) tried against the fit check and validation


def _overrides_that_differ(cfg: Config, overrides: list[str]) -> list[str]:
    out = []
    for text in overrides:
        key, value = text[2:].split("=", 1)
        section, name = key.split(".", 1)
        current = getattr(getattr(cfg, section), name)
        current = str(current).lower() if isinstance(current, bool) else str(current)
        if current != value:
            out.append(text)
    return out


def _profile(cuda: bool):
    from bigtrain.plan.hardware import get_profile, local_hardware

    return get_profile(local_hardware() if cuda else "cpu")


def _search(cfg: Config, ranks: int, memory_bytes: int, cuda: bool):
    from bigtrain.plan.layout import Cluster
    from bigtrain.plan.model import ModelSpec
    from bigtrain.plan.search import search

    hardware = dataclasses.replace(_profile(cuda), memory_bytes=memory_bytes)
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len, device="cuda" if cuda else "cpu")
    fixed = {"precision": cfg.precision.mode, "offload": cfg.memory.activation_offload,
             "compression": cfg.memory.activation_compression, "fused_loss": cfg.model.fused_loss,
             "fp8": cfg.precision.fp8, "compiled": runtime_compiles(cfg, "cuda" if cuda else "cpu"),
             "checkpoint_async": getattr(cfg.checkpoint, "async"), "grad_clip": cfg.optim.grad_clip > 0}
    try:
        return search(model, Cluster.build(ranks, hardware), cfg.train.global_batch, fixed=fixed,
                      precision=cfg.precision.mode, retime=0, optimizer=cfg.optim.name,
                      split_of=functools.lru_cache(maxsize=None)(lambda pp, v: stage_split(cfg, pp, v)))
    except ConfigError:  # no valid layout of this many ranks (the batch does not divide, ...)
        return None


def _runnable(cfg: Config, result, local_ranks: int, cuda: bool, runs_as: Config | None = None):
    """The fastest fitting plan the runtime accepts and the fit check passes with ``local_ranks``
    ranks sharing this machine's memory (1: a machine like this one per rank), with its overrides.
    ``runs_as``: the run's own config where ``cfg`` prices it (a family priced as bigtrain's Llama),
    whose validation must accept the overrides too."""
    from bigtrain.validation import validate

    close = None  # the first that fits but close to the limit: proposed only when none fits with room
    for plan in (result.ranked[:CANDIDATES] if result else []):
        overrides = _overrides_that_differ(cfg, plan.layout.to_overrides())
        candidate = with_overrides(cfg, overrides, "the planner's layout")
        try:
            validate(candidate)
            if runs_as is not None:
                validate(with_overrides(runs_as, overrides, "the planner's layout"))
        except ConfigError:
            continue  # a layout the planner models but the runtime does not run
        problems, warnings = size_problems(candidate, local_ranks, cuda)
        if problems:
            continue
        if warnings:  # (llama-1b on a 23.5 GiB host was proposed at 23.5 GiB a rank: 100% of the machine)
            close = close or (plan, overrides)
            continue
        return plan, overrides
    return close or (None, [])


def fitting_layout(cfg: Config, capacity: int, sharing: int, cuda: bool, runs_as: Config | None = None) -> str:
    """One sentence proposing a layout that fits (as ``bigtrain train`` overrides), or saying how
    many machines like this one the model needs; empty when the planner finds neither. ``runs_as``:
    see :func:`_runnable`."""
    ranks = cfg.parallel.world_size
    plural = "s" if ranks > 1 else ""
    plan, overrides = _runnable(cfg, _search(cfg, ranks, capacity // sharing, cuda), sharing, cuda, runs_as)
    if plan:
        return (f"a layout that fits on this machine ({ranks} rank{plural}): {' '.join(overrides) or '(as configured)'} "
                f"(the planner: {plan.layout.describe()}, {plan.memory.total / 2**30:.1f} GiB per rank)")
    # Sharded over every rank (ZeRO-3), the model states alone need this many machines: start there.
    from bigtrain.plan.states import zero_formula_bytes
    from bigtrain.plan.model import ModelSpec

    params = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len).params
    full = sum(zero_formula_bytes(params, 0, 1, cfg.precision.mode, cfg.optim.name).values())
    usable = capacity - _profile(cuda).reserved_bytes
    least = max(2, -(-int(full) // max(1, usable)))
    if least > MACHINES_MAX:
        return (f"sharded over every rank (ZeRO-3) the model states alone need at least {least} machines like this "
                f"one: make the model smaller")
    machines = 1 << (least - 1).bit_length()
    while machines <= MACHINES_MAX:
        plan, overrides = _runnable(cfg, _search(cfg, machines, capacity, cuda), 1, cuda, runs_as)
        if plan:
            where = "GPUs like this one's" if cuda else "machines like this one (one rank each)"
            return (f"no layout of {ranks} rank{plural} fits this machine; on {machines} {where} the planner's "
                    f"layout {plan.layout.describe()} fits ({plan.memory.total / 2**30:.1f} GiB per rank): "
                    f"{' '.join(overrides)}")
        machines *= 2
    return ""


def size_problems_and_fixes(cfg: Config, local_ranks: int = 1, cuda: bool = False,
                            nvme_dir: str | None = None, runs_as: Config | None = None) -> tuple[list[str], list[str]]:
    """``fit.size_problems``, each problem that another layout may solve followed by one that fits
    this machine (or the machines it needs): what preflight tells a user whose run is too large.
    ``runs_as``: the run's own config where ``cfg`` prices it (see :func:`_runnable`)."""
    check = size_check(cfg, local_ranks, cuda, nvme_dir)
    problems = []
    for problem in check.problems:
        layout = fitting_layout(cfg, check.capacity, check.sharing, cuda, runs_as) if problem.layout_helps else ""
        problems.append(f"{problem.text}. {layout[0].upper()}{layout[1:]}" if layout else problem.text)
    return problems, check.warnings
