"""``bigtrain check``: run a layout and the independent reference side by side, and bisect.

Every rank trains the layout step by step; after each step the first rank compares the global loss,
the gradient norm and every updated weight with the reference (:mod:`bigtrain.check.reference`).
At the first step where anything differs beyond the precision's tolerance it narrows it down, in
the order a bug propagates: the first module (in forward order) whose output differs, the first
parameter (in backward order) whose reduced gradient differs, then the first parameter whose
updated value differs, each with the ranks that hold it and the size of the difference.

The layout's outputs, gradients and weights are gathered to the first rank every step: this is a
tool for small configurations (shrink the model, keep the layout), not for a 7B run.

A DLRM (a family with a step of its own) goes through the same loop: the Trainer taking its step
(:class:`~bigtrain.recsys.train.DlrmStep`) and its reference
(:class:`~bigtrain.check.reference_dlrm.DlrmReference`) answer the same calls, its tables are
compared whole after every step, its dense gradients before the update (the tables have none:
their sparse optimizer takes the pooled gradients), and its outputs are the bottom MLP's, the pooled lookup's
and the top MLP's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from bigtrain.check.fp16_boundary import overflow_boundary
from bigtrain.check.exact import SINGLE_TENSORS, ExactTwin, judge_against_exact
from bigtrain.check.compare import (Tolerance, assemble, gradients_difference, relative_error, scalar_error,
                                   tolerance_for)
from bigtrain.check.reference import (COMPUTE_DTYPES, ReferenceRun, ReferenceStep, captured_module,
                                      config_gradient_delay, replay_to_checkpoint)
from bigtrain.check.reference_dlrm import OWN_STEP_REFERENCES
from bigtrain.check.reference_own import OwnReference, captured_of
from bigtrain.check.report import CheckReport, Finding
from bigtrain.check.routing import SENSITIVITY_FACTOR, model_state, routing_parted, rounding_sensitivity
from bigtrain.check.replay import replayed_step, starts_fresh, stepped_parameters, updates_explained
from bigtrain.config import Config
from bigtrain.distributed.mesh import AXES, Mesh
from bigtrain.families import family_of
from bigtrain.families.own import none_for, owns_slots
from bigtrain.parallel.compile import CompileFallbackWarning
from bigtrain.parallel.pipeline.schedules import ASYNC_KINDS
from bigtrain.train import Trainer
from bigtrain.train_step import StepResult


class OutputProbe:
    """Records the outputs of the compared modules on this rank during forward. Recomputation
    inside backward (activation checkpointing) is not a new output: it is skipped."""

    def __init__(self, modules: list[tuple[str, nn.Module]], captured: Callable[[str], bool] = captured_module):
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.handles = [m.register_forward_hook(lambda mod, args, out, name=name: self._record(name, out))
                        for name, m in modules if captured(name)]

    def _record(self, name: str, out) -> None:
        if torch._C._current_graph_task_id() != -1 or not torch.is_tensor(out):
            return  # a tuple (a block of one's own may return one): the reference compares none either
        self.outputs.setdefault(name, []).append(out.detach().float().cpu().clone())

    def take(self) -> dict[str, torch.Tensor]:
        """This step's outputs (micro-batches in order, along the batch), and forget them."""
        out = {name: torch.cat(parts) for name, parts in self.outputs.items()}
        self.outputs = {}
        return out


def _modules(trainer: Trainer) -> list[tuple[str, nn.Module]]:
    """This rank's modules whose outputs can be compared, by the record of what wrapped them: not a
    fused head (its output is the loss, not logits), and nothing inside a compiled region (a hook
    there would be traced into the compiled graph; the region's own output is compared)."""
    transforms = getattr(trainer.parallel, "transforms", {})  # a DLRM's parallel model records none
    compiled = [name + "." for name, kinds in transforms.items() if "compile" in kinds]
    return [(name, m) for name, m in trainer.model.named_modules()
            if "fused_loss" not in transforms.get(name, ()) and not name.startswith(tuple(compiled))]


def _compare_scalars(result: StepResult, ref: ReferenceStep) -> list[Finding]:
    found = []
    if result.skipped != ref.skipped:
        found.append(Finding("skipped", "", float("inf"), detail=f"layout {result.skipped}, reference {ref.skipped}"))
    for kind, mine, theirs in (("loss", result.loss, ref.loss), ("grad_norm", result.grad_norm, ref.grad_norm)):
        found.append(Finding(kind, "", scalar_error(mine, theirs), detail=f"layout {mine:.7g}, reference {theirs:.7g}"))
    return found


def _compare_tensors(kind: str, names: list[str], mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                     owners: dict[str, list[int]], aliases: dict[str, str]) -> list[Finding]:
    """Compare ``names`` of the reference, and every copy of a tied weight the layout holds under
    another name (the output head's copy on the last pipeline stage) with the same reference."""
    found = []
    copies = {name: [name] + [a for a, c in aliases.items() if c == name and a in mine] for name in names}
    for name in names:
        if name not in mine:
            if kind == "weight":
                found.append(Finding("missing", name, float("inf"), detail="the layout has no such parameter"))
            continue
        found += [Finding(kind, held, relative_error(mine[held], ref[name]), owners.get(held, []))
                  for held in copies[name]]
    return found


def _compare_outputs(shared: list[dict], ref: ReferenceStep, sizes: dict[str, int]) -> list[Finding]:
    found = []
    for name, expected in ref.outputs.items():  # forward order: hooks fired in that order
        pieces = [(s["coords"], s["outputs"][name]) for s in shared if name in s["outputs"]]
        full = assemble(pieces, expected.shape, sizes) if pieces else None
        if full is not None:  # else not comparable in this layout; gradients and weights still are
            found.append(Finding("forward", name, relative_error(full, expected),
                                 [s["rank"] for s in shared if name in s["outputs"]]))
    return found


def _owners(shared: list[dict], key: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in shared:
        for name in s[key]:
            out.setdefault(name, []).append(s["rank"])
    return out


def _layout_and_reference(cfg: Config, mesh: Mesh, run_dir: str | Path, device: torch.device | str):
    """(the trainer of ``cfg``'s model on this rank, a factory of its reference on a device, the
    predicate naming the modules whose outputs are compared). A family of one's own without a
    reference of its own gets the generic one (bigtrain/check/reference_own.py)."""
    family = family_of(cfg)
    trainer = Trainer(cfg, Path(run_dir), mesh, device)
    if family.own_step is not None:  # a step of its own, and the reference written for it
        if family.reference is not None:  # a family of one's own's (outputs compared where it says)
            return trainer, family.reference, family.captured or _no_module
        reference, captured = OWN_STEP_REFERENCES[family.own_step]
        return trainer, reference, captured
    if family.reference is None and owns_slots(family):  # a decoder of one's own: the generic reference
        return trainer, OwnReference, captured_of(family, cfg)
    return trainer, family.reference or ReferenceRun, family.captured or captured_module


def _no_module(name: str) -> bool:
    """No module's output is compared (a family's own step whose reference names none: ``captured``)."""
    return False


def reference_problems(cfg: Config) -> list[str]:
    """What ``bigtrain check`` cannot compare for ``cfg``'s model: the family's own reference says
    what it does not state, and so does the generic one of a decoder of one's own
    (:class:`~bigtrain.check.reference_own.OwnReference`); the decoder reference builds the model of
    the [model] fields; a loop of its own brings its own (OWN_STEP_REFERENCES)."""
    try:  # the references delay a gradient by one count of steps for the whole model
        config_gradient_delay(cfg)
    except ValueError:
        # It raised in the ranks' reference, after launch: a crash instead of a refusal.
        return ["parallel.pp_schedule = 'pipedream' with parallel.pp_vertical_sync = false: each stage computes "
                "with weights of another age, which bigtrain check's reference does not state; set "
                "parallel.pp_vertical_sync = true, or use parallel.pp_schedule = 'pipedream-2bw'"]
    family = family_of(cfg)
    if family.own_step is not None and family.reference is None:
        return [] if family.own_step in OWN_STEP_REFERENCES else [
            none_for(family, "reference", "bigtrain check compares each step of the family's own_step with an "
                     "independent reference: a class (cfg, device) with train_step(capture) -> ReferenceStep "
                     "(bigtrain.core.reference_step: the loss, gradient norm and skip, and when captured the "
                     "reduced gradients and updated weights by parameter name), learning_rate(step) and "
                     "problems(cfg), as bigtrain/check/reference_dlrm.py's DlrmReference",
                     "compare your family's run with a plain PyTorch loop of your own")]
    if family.reference is not None:
        return family.reference.problems(cfg)
    if owns_slots(family):
        return OwnReference.problems(cfg)
    if family.llama_fallbacks and family.model_fields:
        return []
    return [none_for(family, "reference", "bigtrain check compares each step with an independent reference of the "
                     "model", "compare your family's run with a plain PyTorch loop of your own (docs/families.md)")]


def check_layout(cfg: Config, mesh: Mesh, run_dir: str | Path, steps: int,
                 device: torch.device | str = "cpu", saved: tuple[dict, dict] | None = None,
                 saved_anchored: bool = False, save: bool = False,
                 saved_delay: int | None = None) -> CheckReport | None:
    """Run ``steps`` steps of ``cfg`` on ``mesh`` (every rank calls this) and compare them with the
    reference on the first rank; returns the report there, None elsewhere.

    ``saved``: the full (weights, optimizer state) a run saved in ``run_dir``'s newest checkpoint
    (:func:`save_on_rank`'s, or ``CheckReport.saved`` of a check with ``save``; on the first rank,
    anything elsewhere). The layout resumes from it, what it loaded must be what was saved (dtypes
    and bits), the reference replays the steps before it uncompared, and the ``steps`` after it are
    compared. ``saved_anchored``: the steps before it were checked too, along the replays' chain
    (``CheckReport.anchored``), which the compared steps then continue. ``save``: after the steps,
    save a checkpoint in ``run_dir`` and put its full state in the report (``CheckReport.saved``),
    for a check resumed from it. ``saved_delay``: the gradient delay of the run that saved the
    checkpoint (:func:`~bigtrain.check.reference.config_gradient_delay` of its config) where it is
    not ``cfg``'s (a resume across a change of schedule); the reference replays the steps before it
    with that delay."""
    trainer, reference_of, captured = _layout_and_reference(cfg, mesh, run_dir, device)
    world, is_first = mesh.comm("world"), mesh.rank == 0
    # The reference computes on this rank's device: the same kernels on both sides, so the
    # precision's tolerance measures the layout, not the hardware's arithmetic.
    reference = reference_of(cfg, trainer.device) if is_first else None
    # Copies of a weight under another name (a tied head on the last pipeline stage), from the
    # placement record of the ranks holding them: compared with the weight they copy.
    copies = world.gather_objects(trainer.parallel.placements.copies())
    aliases = {n: c for held in copies or [] for n, c in held.items()}
    probe = OutputProbe(_modules(trainer), captured)
    tol = tolerance_for(cfg.precision.mode, cfg.optim.name, cfg.memory.activation_compression, cfg.precision.fp8)
    coords = {axis: mesh.coord(axis) for axis in AXES}
    mine = {"rank": mesh.rank, "coords": coords, "params": [n for n, _ in trainer.model.named_parameters()],
            "modules": [n for n, _ in _modules(trainer)]}
    report = CheckReport(agree=True, steps=0, tolerance=tol, losses=[], precision=cfg.precision.mode) \
        if is_first else None
    # The layout's full weights before the next step (on the first rank): a resumed run's loaded
    # ones; a fresh run's first step computes at the reference's own (nothing to recompute there).
    weights_before, state_before = None, {}  # and the model state outside the weights (router biases)
    if saved is not None:
        loaded = _resumed_as_saved(trainer, reference, report, saved, world, saved_delay)
        if loaded is None:
            return report
        weights_before = loaded[0]
        state_before = _merged_state(world.gather_objects({"state": model_state(trainer.model)}))
    schedule = getattr(trainer.parallel, "schedule", None)  # a DLRM has no pipeline
    asynchronous = schedule is not None and schedule.asynchronous
    # Whether a gradient norm over its bound may be recomputed by the reference at the layout's own
    # weights before the step (_norm_recomputed): not where the step computes at older weights
    # (an asynchronous pipeline; the reference's at_weights refuses its own delays).
    recomputing = is_first and tol.norm_recomputed and not asynchronous and hasattr(reference, "at_weights")
    # 2BW runs with the deferred boundary wherever the layout allows it (fit starts it): check that.
    deferred = asynchronous and trainer.start_deferred_updates()
    replaying = replays_steps(cfg, deferred)
    # A float64 twin of the family's reference, for single tensors over the bound (built then).
    twin = ExactTwin.of(reference_of, cfg, trainer.device, report.start,
                        schedule_is_asynchronous(cfg), saved_delay) if is_first else None
    state = trainer.parallel.full_state() if replaying else None  # before the first step
    # The replays explain an update only along a chain of steps from moments the check verified:
    # a fresh run's (none, or zeros), or a resumed run's whose steps before the checkpoint were
    # checked along the chain (``saved_anchored``). Loaded moments equal what was saved, but
    # nothing else compares them with the reference's: from wrong ones every step replays and every
    # gradient is within bound while every weight goes astray (tests/test_check_review.py).
    # fp32 only: in bf16/fp16 single tensors of the free run are diagnostic, nothing to explain.
    anchored = replaying and cfg.optim.name == "adamw" and cfg.precision.mode == "fp32" and (
        starts_fresh(state[1]) or (saved is not None and saved_anchored))
    if report is not None:
        report.anchored = anchored
    for step, result, grads in _steps(trainer, steps, deferred):
        weights = trainer.parallel.full_weights()
        before, state = state, trainer.parallel.full_state() if replaying else None
        outputs = probe.take()
        if asynchronous:  # a run also starts the next step's forwards: the loss, gradients and weights decide
            outputs = {}
        shared = world.gather_objects({**mine, "outputs": outputs, "state": model_state(trainer.model)})
        verdict = torch.zeros(1, device=trainer.device)  # NCCL reduces device tensors only
        if is_first:
            # The reference before this step, should the norm need recomputing at the layout's
            # weights (a copy of a small model, made after an update only).
            ahead = copy.deepcopy(reference) if recomputing and weights_before is not None else None
            ref = reference.train_step(capture=True)
            report.losses.append((result.loss, ref.loss))
            report.steps += 1
            measured = _step_measurements(result, ref, grads, weights, shared, mesh, aliases)
            replayed: set[str] = set()  # the parameters this step's replay stepped
            if replaying and not result.skipped:
                measured += [Finding("replayed", what, error, detail=detail) for what, error, detail
                             in replayed_step(before, grads, state, reference.learning_rate(step), cfg.optim)]
                replayed = stepped_parameters(before, grads, weights, aliases)
            # Before any update (a fresh run's first step) the weights are the reference's; after
            # it, where single tensors may drift, the norm is held to its own gradients' difference,
            # unless the reference recomputes it at the layout's own weights (then 1e-5 holds).
            apart = gradients_difference(grads, ref.grads) if tol.norm_follows_gradients else None
            drifted = tol.grad_norm_bound(step == 0, apart)
            norm_bound = tol.grad_norm if ahead is not None else drifted
            findings = [_bounded_by(m, norm_bound, tol) for m in measured
                        if not m.error <= (norm_bound if m.kind == "grad_norm" else tol.of(m.kind))]
            if ahead is not None and any(f.kind == "grad_norm" for f in findings):
                findings, recomputed = _norm_recomputed(findings, result, ahead, weights_before, state_before,
                                                        tol, drifted, COMPUTE_DTYPES[cfg.precision.mode])
                report.within_rounding += recomputed
            if twin is not None and any(m.kind in SINGLE_TENSORS for m in findings):
                exact = twin.step(step)
                against_exact = _step_measurements(result, exact, grads, weights, shared, mesh, aliases)
                findings, rounding = judge_against_exact(findings, against_exact, ref, exact, aliases, tol.tensor)
                report.within_rounding += rounding
            if anchored:
                compared = {m.name for m in measured if m.kind == "gradient"}
                findings, explained = updates_explained(findings, replayed, compared)
                report.within_rounding += [replace(f, detail="the replayed update of a gradient within its bound")
                                           for f in explained]
            boundary = None
            if any(tol.decides(m.kind) for m in findings):
                boundary = overflow_boundary(cfg, result.skipped, ref.skipped, grads, ref.grads, aliases, findings)
                report.first_step, report.findings = step, findings
                if boundary is None:
                    report.agree = False
                else:  # no divergence, and nothing after it to compare
                    report.boundary = boundary
                verdict.fill_(1)
            # The largest differences; at fp16's boundary only of what the step agreed on (its loss,
            # outputs, replay and finite gradients), not of the update one run made and the other not.
            for m in measured:
                if boundary is None or m.kind in ("loss", "forward", "replayed") or (
                        m.kind == "gradient" and math.isfinite(m.error)):
                    report.worst[m.kind] = max(report.worst.get(m.kind, 0.0), m.error)
        world.all_reduce(verdict, tag="check")  # every rank stops at the first divergence
        if verdict.item():  # the host waits for the verdict (on NCCL the all-reduce does not block it)
            return report
        weights_before, state_before = weights, _merged_state(shared)
    if save:
        trainer.save()
        trainer.wait_for_save()
        full = trainer.parallel.full_state()  # collective
        if report is not None:
            report.saved = full
    return report


def _merged_state(shared: list[dict] | None) -> dict[str, torch.Tensor]:
    """The whole model's state outside the weights from every rank's part (on the first rank)."""
    return {name: t for part in shared or [] for name, t in part["state"].items()}


def _norm_recomputed(findings: list[Finding], result: StepResult, ahead, weights: dict[str, torch.Tensor],
                     state: dict[str, torch.Tensor], tol: Tolerance, drifted: float,
                     compute_dtype: torch.dtype) -> tuple[list[Finding], list[Finding]]:
    """(the findings that stand, the gradient norm's finding where the reference's recomputation of
    the step at the layout's own ``weights`` and model ``state`` (router biases) before it agrees
    within ``tol.grad_norm``, or, in bf16/fp16 (``tol.routing_flips``), routed MoE tokens otherwise
    than the layout: :mod:`bigtrain.check.routing`). ``ahead``: the reference as it was before the
    step (a copy, used up here); ``compute_dtype``: whose rounding moves MoE routing.

    After an update the layout's fp32 weights are the reference's within rounding that Adam
    amplifies (each weight compared at ``tol.tensor``, each update explained by its replay), and a
    gradient, hence its norm, moves with them: seed 20261443 sample 2 (Qwen3-MoE tp 4 x pp 2,
    resumed at Ulysses sp 2) had its gradients 2.6e-5 and its norm 1.6e-5 from the reference's at
    the fourth step, while the reference recomputing it at the layout's own weights was 2.5e-7 from
    the layout's norm (a float64 reference 1.0e-7). Recomputed there, the norm is held to 1e-5 at every
    step, as at a fresh run's first: a systematic scale of the gradient (a token count a few off in
    100,000), which every single tensor's 1e-4 lets through, still fails at any step it appears
    (tests/test_check_norm.py); a bound following the gradients' distance would let it through.
    8-bit AdamW's and Lion's weights part by their discontinuous updates too, int8's by code flips,
    and are held the same way. ``drifted``: the norm's bound where the reference cannot compute at ``weights`` (it lacks
    one of the model's), as though nothing were recomputed."""
    norm = next(f for f in findings if f.kind == "grad_norm")
    spare = copy.deepcopy(ahead) if tol.routing_flips else None  # for rounding_sensitivity
    if not ahead.at_weights(weights, state):
        if norm.error <= drifted:
            return [f for f in findings if f is not norm], []
        return [_bounded_by(norm, drifted, tol) if f is norm else f for f in findings], []
    again = ahead.train_step()
    error = scalar_error(result.grad_norm, again.grad_norm)
    judged = replace(norm, detail=f"{norm.detail}; recomputed by the reference at the layout's weights before the "
                                  f"step: {again.grad_norm:.7g}, relative difference {error:.3e} (bound {tol.grad_norm:.0e})")
    if error <= tol.grad_norm:
        return [f for f in findings if f is not norm], [judged]
    parted = routing_parted(result.moe, again.routing) if spare is not None else None
    if parted is not None:
        moved = rounding_sensitivity(spare, weights, state, again.grad_norm, compute_dtype)
        judged = replace(judged, detail=f"{judged.detail}; the recomputation routed MoE tokens otherwise (routings "
                                        f"per expert: {parted}), and rounding-sized changes of the weights move the "
                                        f"reference's own norm by up to {moved:.3e} (bound {SENSITIVITY_FACTOR:g}x that)")
        if error <= SENSITIVITY_FACTOR * moved:
            return [f for f in findings if f is not norm], [judged]
    return [judged if f is norm else f for f in findings], []


def _bounded_by(finding: Finding, norm_bound: float, tol: Tolerance) -> Finding:
    """``finding``, its bound said where it is the gradient norm's derived one (not ``tol.grad_norm``)."""
    if finding.kind != "grad_norm" or norm_bound == tol.grad_norm:
        return finding
    return replace(finding, detail=f"{finding.detail}; bound {norm_bound:.3e}: {tol.grad_norm:.0e} + the "
                                   f"gradients' own difference from the reference's")


def replays_steps(cfg: Config, deferred: bool) -> bool:
    """Whether each optimizer step is also replayed by the reference from the layout's own weights,
    state and gradient (:mod:`bigtrain.check.replay`): 8-bit AdamW, whose state a free run cannot
    hold to fp32's bound; AdamW, whose updated weights in fp32 may then be explained by gradients
    within their bound (``updates_explained``), and in bf16/fp16, where the free run's single tensors
    are diagnostic only (the loss decides), is judged per weight and moment by the replay: it steps
    from the layout's fp32 masters, fp32 moments and unscaled fp32 gradient, the same inputs as the
    layout's step, so the two differ by fp32 rounding whatever the compute precision (a wrong
    learning rate, clipping, update or state shows there while the loss may stay within 1e-3).
    Not where the step's gradient is gone when its update lands (2BW's deferred boundary) or the
    weights are averaged after it (local SGD). A DLRM's dense part is compared in the free run only
    (its trainer gathers no full optimizer state)."""
    replayed = cfg.optim.name in ("adamw8bit", "adamw")
    return (replayed and family_of(cfg).full_optimizer_state and not deferred
            and cfg.parallel.dp_sync != "local-sgd")


def schedule_is_asynchronous(cfg: Config) -> bool:
    """A pipeline without flush (2BW, PipeDream): resumed, it starts empty (docs/async.md)."""
    return cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in ASYNC_KINDS


def _resumed_as_saved(trainer: Trainer, reference, report: CheckReport | None, saved: tuple[dict, dict],
                      world, saved_delay: int | None = None) -> tuple[dict, dict] | None:
    """Resume ``trainer`` from its run's newest checkpoint and bring the reference to the same step
    (on the first rank; the run that saved it delayed its gradients by ``saved_delay``, None: as
    this config says); the loaded full state (complete on the first rank) where every rank goes on:
    it is the ``saved`` one; else None."""
    if not trainer.resume("auto"):
        raise RuntimeError(f"check: no checkpoint to resume from in {trainer.run_dir}")
    loaded = trainer.parallel.full_state()  # collective
    verdict = torch.zeros(1, device=trainer.device)
    if report is not None:
        report.start = trainer.step
        replay_to_checkpoint(reference, trainer.step, saved_delay, schedule_is_asynchronous(trainer.cfg))
        findings = loaded_differences(loaded, saved)
        if findings:
            report.agree, report.first_step, report.findings = False, trainer.step, findings
            verdict.fill_(1)
    world.all_reduce(verdict, tag="check")
    return None if verdict.item() else loaded


def loaded_differences(loaded: tuple[dict, dict], saved: tuple[dict, dict]) -> list[Finding]:
    """A finding for each weight or optimizer state tensor whose loaded dtype or value is not the saved one's."""
    pairs = [(name, loaded[0].get(name), w) for name, w in saved[0].items()]
    held = loaded[1].get("state", {})
    pairs += [(f"{name} {key}", held.get(name, {}).get(key), v)
              for name, state in saved[1].get("state", {}).items() for key, v in state.items()]
    out = []
    for what, got, want in pairs:
        if got is None:
            out.append(Finding("resumed", what, float("inf"), detail="not loaded"))
        elif got.dtype != want.dtype:
            out.append(Finding("resumed", what, float("inf"), detail=f"{got.dtype}, saved as {want.dtype}"))
        elif not torch.equal(got.reshape(-1), want.reshape(-1)):
            error = relative_error(got.reshape(-1), want.reshape(-1))
            out.append(Finding("resumed", what, error, detail="values differ"))
    return out


def _steps(trainer, steps: int, deferred: bool):
    """(step, its result, its full gradients) of ``steps`` steps, each once its update has landed.

    With 2BW's deferred boundary a step's update lands inside the next step's forwards (or at the
    flush after the last): its result, and the weights it made, are compared then. Its gradients
    were moved to the update's buffer by then, so a deferred step compares loss, gradient norm and
    weights, not gradients."""
    if not deferred:
        for _ in range(steps):
            grads: dict[str, torch.Tensor] = {}
            step = trainer.step
            yield step, trainer.train_step(before_update=lambda: grads.update(trainer.parallel.full_grads())), grads
        return
    for call in range(steps + 1):
        landed = trainer.train_step_deferred() if call < steps else trainer.flush_update()
        for result in landed:  # every rank lands the same steps in the same call
            yield result.step, result, {}


def _step_measurements(result: StepResult, ref: ReferenceStep, grads: dict, weights: dict, shared: list[dict],
                       mesh: Mesh, aliases: dict[str, str]) -> list[Finding]:
    """Every comparison of one step, each with its relative difference (within bounds or not)."""
    owners = _owners(shared, "params")
    order = list(ref.weights)
    sizes = {axis: mesh.size(axis) for axis in AXES}
    measured = (_compare_scalars(result, ref)
                + _compare_tensors("weight", order, weights, ref.weights, owners, aliases)
                + [Finding("extra", n, float("inf"), owners.get(n, []), "not a parameter of the reference model")
                   for n in weights if aliases.get(n, n) not in ref.weights]
                + _compare_outputs(shared, ref, sizes))
    if result.skipped and ref.skipped:
        # Both overflowed (fp16) and skipped: their gradients are inf or NaN alike, nothing to compare.
        return [m for m in measured if m.kind != "grad_norm"]
    return measured + _compare_tensors("gradient", list(reversed(order)), grads, ref.grads, owners, aliases)


def check_on_rank(rank: int, world_size: int, cfg: Config, run_dir: str | Path, steps: int,
                  saved: tuple[dict, dict] | None = None, saved_anchored: bool = False,
                  save: bool = False, saved_delay: int | None = None) -> CheckReport | None:
    """:func:`check_layout` on the mesh ``cfg`` describes, for rank ``rank`` of ``world_size``: the
    shape ``bigtrain.testing.run_ranks`` calls (the fuzzer and the tests use it)."""
    return check_layout(cfg, Mesh.from_config(cfg.parallel, rank, world_size), run_dir, steps, saved=saved,
                        saved_anchored=saved_anchored, save=save, saved_delay=saved_delay)


def check_compiled_on_rank(rank: int, world_size: int, cfg: Config, run_dir: str | Path, steps: int,
                           saved: tuple[dict, dict] | None = None, saved_anchored: bool = False,
                           save: bool = False, saved_delay: int | None = None) -> CheckReport | None:
    """:func:`check_on_rank` where a compiled region that falls back to eager is an error: run
    eagerly, it would agree with the reference and prove nothing about compiling (the fuzzer's
    compiled samples, tests/test_compile.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        return check_on_rank(rank, world_size, cfg, run_dir, steps, saved, saved_anchored, save, saved_delay)


def save_on_rank(rank: int, world_size: int, cfg: Config, run_dir: str | Path, steps: int) -> tuple[dict, dict]:
    """Train ``steps`` steps of ``cfg`` and save a checkpoint in ``run_dir``; the full (weights,
    optimizer state) saved, complete on the first rank: what :func:`check_on_rank` resumes from."""
    trainer = Trainer(cfg, Path(run_dir), Mesh.from_config(cfg.parallel, rank, world_size))
    for _ in range(steps):
        trainer.train_step()
    trainer.save()
    trainer.wait_for_save()
    return trainer.parallel.full_state()
