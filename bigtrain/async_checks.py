"""Asynchronous training against the rest of a config, before any process starts: local SGD over dp
(``parallel.dp_sync``) and the pipelines without a flush (PipeDream, PipeDream-2BW).

Imports no torch (as :mod:`bigtrain.validation`). What is built and why each rule holds: docs/async.md.
"""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.field_checks import one_of

DP_SYNC = ("sync", "local-sgd")


def check_async(cfg: Config) -> list[str]:
    """Asynchronous training (docs/async.md): local SGD over dp, and the pipelines without a flush."""
    p, problems = cfg.parallel, []
    problems += one_of("parallel.dp_sync", p.dp_sync, DP_SYNC)
    if p.local_sgd_every < 1:
        problems.append(f"parallel.local_sgd_every = {p.local_sgd_every}: must be >= 1 (steps between averages)")
    elif p.dp_sync == "sync" and p.local_sgd_every != 1:
        problems.append(f"parallel.local_sgd_every = {p.local_sgd_every} applies to parallel.dp_sync = 'local-sgd'; "
                        f"set parallel.dp_sync = 'local-sgd' or leave parallel.local_sgd_every = 1")
    if p.dp_sync == "local-sgd":
        problems += _async_needs_plain_replicas(cfg, "parallel.dp_sync = 'local-sgd'", ("tp", "pp", "sp", "ep"))
        every, k = cfg.checkpoint.every, p.local_sgd_every
        if every and k > 1 and every % k:
            problems.append(f"checkpoint.every = {every} with parallel.local_sgd_every = {k}: a checkpoint between "
                            f"averages would hold one replica's parameters; use checkpoint.every = "
                            f"{max(k, every // k * k)} (a multiple of {k})")
        steps = cfg.train.steps
        if cfg.checkpoint.save_final and k > 1 and steps % k:
            problems.append(f"train.steps = {steps} with parallel.local_sgd_every = {k} and checkpoint.save_final: "
                            f"the last step is not an average, and the final checkpoint would hold pieces of each "
                            f"replica's parameters; use train.steps = {max(k, steps // k * k)} or "
                            f"{(steps // k + 1) * k} (a multiple of {k})")
    kind = p.pp_schedule
    if kind in ("pipedream-2bw", "pipedream"):
        what = f"parallel.pp_schedule = '{kind}'"
        if p.pp < 2:
            problems.append(f"{what} needs parallel.pp >= 2 (with one stage there is no pipeline to keep full); "
                            f"use parallel.pp = 2 or parallel.pp_schedule = '1f1b'")
        problems += _async_needs_plain_replicas(cfg, what, ("dp", "tp", "sp", "ep"))
        t = cfg.train
        micro = t.global_batch // max(1, p.dp * t.micro_batch) if t.micro_batch > 0 else 0
        if kind == "pipedream-2bw" and p.pp >= 2 and 0 < micro < p.pp - 1:
            # Found by the layout fuzzer (seed 20261308 sample 43: pp = 4, 2 micro-batches): the first
            # stage starts step s + 2's forwards before step s's update, which makes their version,
            # was posted. Measured: pp 4 with 2 micro-batches and pp 3 with 1 fail; pp 4 with 3, pp 3
            # with 2 and pp 2 with 1 agree with the delayed reference.
            problems.append(f"{what} with {micro} micro-batch{'es' if micro > 1 else ''} a step and parallel.pp = "
                            f"{p.pp}: 2BW keeps two weight versions, which holds when a step has at least pp - 1 = "
                            f"{p.pp - 1} micro-batches; use train.global_batch >= "
                            f"{(p.pp - 1) * p.dp * t.micro_batch} or parallel.pp <= {micro + 1}")
        if cfg.memory.checkpointing != "none":
            problems.append(f"memory.checkpointing = '{cfg.memory.checkpointing}' with {what}: recomputation in "
                            f"backward would read the live weights, not the micro-batch's stashed version; use "
                            f"memory.checkpointing = 'none'")
        if cfg.model.fused_loss:
            problems.append(f"model.fused_loss with {what}: the fused head reads its weight again in backward, "
                            f"the live one rather than the stashed version; use model.fused_loss = false")
        if cfg.model.moe_experts and cfg.model.moe_router == "sigmoid-bias":
            # Found by the layout fuzzer: the balancing bias moves at the step boundary, but upstream
            # stages ran the next step's first forwards before it, with the old bias; the bias is
            # model state the weight versions do not stash (gradient norm 2e-5 to 9e-5 off the
            # delayed reference, expert gradients 7e-2).
            problems.append(f"model.moe_router = 'sigmoid-bias' with {what}: its balancing bias is updated at the "
                            f"step boundary, after upstream stages began the next step's forwards with the old "
                            f"bias (not versioned with the weights); use model.moe_router = 'softmax'")
    if p.pp_vertical_sync and kind != "pipedream":
        problems.append(f"parallel.pp_vertical_sync applies to parallel.pp_schedule = 'pipedream' (got '{kind}'); "
                        f"set it false, or use parallel.pp_schedule = 'pipedream'")
    return problems


def _async_needs_plain_replicas(cfg: Config, what: str, axes: tuple[str, ...]) -> list[str]:
    """The asynchronous modes run on the replicated fp32 engine, on the axes they were proved on."""
    p, problems = cfg.parallel, []
    if p.zero != 0:
        problems.append(f"parallel.zero = {p.zero} with {what}: it keeps whole fp32 weights per rank (ZeRO shards "
                        f"them over replicas that step together); use parallel.zero = 0")
    if cfg.precision.mode != "fp32":
        problems.append(f"precision.mode = '{cfg.precision.mode}' with {what}: only fp32 is supported; use "
                        f"precision.mode = 'fp32'")
    for axis in axes:
        if getattr(p, axis) > 1:
            problems.append(f"parallel.{axis} = {getattr(p, axis)} with {what}: not supported; use parallel.{axis} = 1")
    return problems


def resume_caveat(cfg: Config, saved: dict, checkpoint: str) -> str | None:
    """What a resume of an asynchronous run does not bring back (docs/async.md), said once by rank 0
    at the resume: such a run trains on, but not along the trajectory the uninterrupted run would
    have taken. ``saved``: the checkpoint's recorded config (the run that wrote it)."""
    caveats = []
    written = saved.get("parallel", {})
    if (written.get("dp_sync", "sync") == "local-sgd" and written.get("local_sgd_every", 1) > 1
            and written.get("dp", 1) > 1):
        # The checkpoint's weights are an average, but each replica kept its own Adam moments and the
        # checkpoint holds a piece of each replica's: every replica resumes from the same pieced state.
        caveats.append(f"it was written by local SGD (parallel.dp_sync = 'local-sgd', local_sgd_every = "
                       f"{written['local_sgd_every']}, parallel.dp = {written['dp']}), whose replicas each keep "
                       f"their own optimizer moments: the checkpoint holds pieces of them, and every replica "
                       f"resumes from those pieces (docs/async.md, 'Local SGD')")
    # The stash lost is the saved run's: a checkpoint written by a pipeline without flush lacks the
    # weight version(s) its next forwards would have read. A synchronous save resumed into such a
    # pipeline loses nothing (it had no stash; the new pipeline starts empty, as at step 0).
    saved_kind, kind = written.get("pp_schedule", "1f1b"), cfg.parallel.pp_schedule
    if saved_kind in ("pipedream-2bw", "pipedream"):
        instead = ("the pipeline restarts empty and the first step after the resume computes with the newest "
                   "weights, as step 0 does" if kind in ("pipedream-2bw", "pipedream") else
                   f"the resumed run (parallel.pp_schedule = '{kind}') computes every step with the newest weights")
        caveats.append(f"it was written by parallel.pp_schedule = '{saved_kind}', which keeps a stashed weight "
                       f"version that no checkpoint holds: {instead} (docs/async.md, 'Limits')")
    if not caveats:
        return None
    return (f"resuming from {checkpoint}: the run goes on, but not along the trajectory of the uninterrupted run: "
            + "; and ".join(caveats))
