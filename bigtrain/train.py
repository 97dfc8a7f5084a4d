"""The training run on one rank: the loop around the optimizer step, metrics, the NaN policy,
signals, evaluation and checkpoints.

``Trainer(cfg, run_dir, mesh, device)`` is what ``bigtrain train`` runs in every rank, and what a
test or a user's script can run directly on a mesh it built itself. The step itself (building the
parallel model, micro-batches, the update) is :class:`bigtrain.train_step.StepRunner`'s.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from bigtrain import checkpoint as ckpt
from bigtrain import run_info
from bigtrain.async_checks import resume_caveat
from bigtrain.checkpoint.interval import SaveInterval
from bigtrain.checkpoint.resume import ResumeError, resume_checkpoint
from bigtrain.checkpoint.writer import CheckpointWriter
from bigtrain.config import Config
from bigtrain.distributed.mesh import Mesh
from bigtrain.evaluate import held_out_loss
from bigtrain.families.own import parameter_count as family_parameters
from bigtrain.metrics import MetricsLog
from bigtrain.models.llama import count_parameters
from bigtrain.nonfinite import BadSteps, NonFiniteStop
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.pipeline.draw import draw_timeline
from bigtrain.parallel.pipeline.executor import align_timelines
from bigtrain.parallel.pipeline.simulate import simulate
from bigtrain.preemption import Preempted, SignalWatch
from bigtrain.profiling import StepProfiler
from bigtrain.run_dir import RunDirWriteError, ensure_run_id, forget_stop, read_run_id, record_stop, write_run_config
from bigtrain.run_segments import open_segment, read_segments, totals, update_segment
from bigtrain.train_step import StepResult, StepRunner
from bigtrain.validation import validate


class Trainer(StepRunner):
    def __init__(self, cfg: Config, run_dir: Path, mesh: Mesh, device: torch.device | str = "cpu"):
        # The CLI validates before launch; a script that builds its own config is held to the same
        # rules here, so a bad field is named, not met as a shape error deep in a forward.
        validate(cfg, world_size=mesh.world_size, world_size_from="the mesh")
        super().__init__(cfg, run_dir, mesh, device)
        self.history: list[StepResult] = []
        self.checkpoint_writer = CheckpointWriter(cfg, mesh, self.device, self.checkpoint_root)
        self._run_id: str | None = None
        self.wall_time_s: float | None = None  # of the last fit() (this attempt, when resumed)
        self._fit_started: float | None = None
        self.resumed_from: Path | None = None  # the checkpoint the last resume loaded
        self._resumed_run_id: str | None = None  # the run id its manifest names
        self._stop_deferred = False  # a signal's stop waits for local SGD's next average (noted once)

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> list[StepResult]:
        """Train to ``train.steps``, resuming first if the config says so. Raises NonFiniteStop
        (``train.max_bad_steps`` bad steps in a row) or Preempted (SIGINT / SIGTERM, after saving)."""
        cfg = self.cfg
        started = self._fit_started = time.perf_counter()
        saved_at = None  # the step of this launch's newest checkpoint
        if self.is_main:  # unfinished saves of an earlier attempt: nothing reads them, they take space
            ckpt.remove_temp_dirs(self.checkpoint_root)
        if cfg.checkpoint.resume != "none" and self.resume(cfg.checkpoint.resume):
            # Its own checkpoint of this step is saved already: a run that has nothing left to train (a
            # launcher's restart after the final save) would otherwise write it again, removing the
            # old one first (a crash meanwhile lost the run's newest checkpoint).
            saved_at = self.step if ckpt.is_checkpoint_of(self.checkpoint_root, self.resumed_from) else None
            if self.is_main and self.step < cfg.train.steps:  # (a resumed run began at 'step 5/N', saying nothing)
                where = self.resumed_from.name if saved_at is not None else str(self.resumed_from)  # another run's
                print(f"bigtrain: resuming from {where} (step {self.step} of {cfg.train.steps})", flush=True)
        elif ckpt.list_checkpoints(self.checkpoint_root):  # a fresh run would rotate them away, or resume them
            newest = ckpt.list_checkpoints(self.checkpoint_root)[0].name
            raise ResumeError(f"{self.run_dir} holds checkpoints of a run (newest {newest}): continue it with "
                              f"checkpoint.resume = 'auto', or use another run directory")
        if self.is_main and self.step == 0 and cfg.model.init_from:  # resumed runs start from their checkpoint
            print(f"bigtrain: initial weights from model.init_from = {cfg.model.init_from!r}, not a random init",
                  flush=True)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._run_id = ensure_run_id(self.run_dir, self._continued_run_id())
            forget_stop(self.run_dir)
            write_run_config(self.run_dir, cfg)
            layout = run_info.layout_text(cfg, self.device.type == "cuda")
            open_segment(self.run_dir, self.step, self.global_tokens, layout, run_info.git_commit())
        log = MetricsLog(self.run_dir, self.is_main, cfg.train.steps, self.step, cfg.logging.progress,
                         cfg.logging.tensorboard)
        scaler = self.engine.scaler
        bad = BadSteps(cfg.train.max_bad_steps, scaler.min_scale if scaler is not None else None)
        deferred = self.start_deferred_updates()
        timed = SaveInterval(cfg.checkpoint.every_minutes, self.mesh.comm("world"), self.device)
        profiler = StepProfiler(cfg.logging.profile_steps, self.run_dir, self.mesh.rank, self.mesh.world_size,
                                self.device, cfg.logging.profile_memory)
        try:
            with SignalWatch(self.mesh.comm("world")) as signals:
                while self.step < cfg.train.steps:
                    with profiler.step(self.step + 1):
                        self._run_step(log, bad)
                    profiler.stepped(self.step)
                    saved = False
                    by_steps = bool(cfg.checkpoint.every) and self.step % cfg.checkpoint.every == 0
                    # A timed save between local SGD's averages waits for the next one (checkpoint.every
                    # is validated to fall on them).
                    if by_steps or (timed.due(self.step) and self._replicas_agree()):
                        self._record_landed(self.flush_update(), log, bad)  # the checkpoint holds this step's update
                        saved = self._save_unless_bad(bad, log)
                        saved_at = self.step if saved else saved_at
                        timed.replan(self.step)
                    # Every rank, every boundary: one decision. Deferred 2BW reads the previous
                    # boundary's (a signal stops the run a step later) rather than wait for the others.
                    signum = signals.agreed_late(self.device) if deferred else signals.agreed(self.device)
                    if signum is not None and self.step < cfg.train.steps and self._stop_now(signum, log):
                        self._record_landed(self.flush_update(), log, bad)
                        self._stop_on_signal(signum, saved or self._save_unless_bad(bad, log))
                self._record_landed(self.flush_update(), log, bad)  # the last step's update
                signals.settle()
        finally:
            profiler.close()  # a run that ended inside the window writes what it traced
            log.close()
            # however the loop ended (a stop, a failure): the steps it got to; a failure in flight
            # (a full disk that stopped metrics.jsonl) is the one said, not this record's own
            self._note_segment(failing=sys.exc_info()[1] is not None)
        if (ended := bad.ended_on_bad_steps()) is not None:  # whatever their number: exit 3, no final save
            self.wait_for_save()
            raise self._record(NonFiniteStop(f"{ended}; {self._last_finite_checkpoint()}", ended.step))
        if self.executor is not None and self.history:
            self.draw_pipeline()
        every = cfg.checkpoint.every
        if cfg.checkpoint.save_final and (not every or self.step % every) and saved_at != self.step:
            self.save()
        self.wait_for_save()
        # Offload's delayed update: the last step's update, still on the host, lands in the model
        # (after the save, which holds it and the weights in use: a longer run resumes exactly).
        finish_update = getattr(self.engine, "finish_update", None)
        if finish_update is not None:
            finish_update()
        self.wall_time_s = time.perf_counter() - started
        self._note_segment()
        return self.history

    def _note_segment(self, failing: bool = False) -> None:
        """This launch's segment of the run has reached ``self.step`` (rank 0 records it). ``failing``:
        the run is ending on an error already, which a record that cannot be written must not replace."""
        if self.is_main and self._fit_started is not None:
            try:
                update_segment(self.run_dir, self.step, time.perf_counter() - self._fit_started)
            except RunDirWriteError:
                if not failing:
                    raise

    def _logged(self, step: int) -> bool:
        cfg = self.cfg
        return (step + 1) % cfg.logging.log_every == 0 or step == 0 or step + 1 == cfg.train.steps

    def _run_step(self, log: MetricsLog, bad: BadSteps) -> None:
        """One step, logged (always when skipped), and counted by the NaN policy. With the deferred
        2BW boundary, the steps whose updates landed meanwhile (the previous one) are."""
        cfg = self.cfg
        measure = self._logged(self.step) and cfg.logging.measure_memory
        every = cfg.train.eval_every
        if self.deferred is not None:
            results = self.train_step_deferred(measure=measure)
            if every and (self.step % every == 0 or self.step == cfg.train.steps):
                results += self.flush_update()  # evaluate the weights after this step's update
                results[-1].eval_loss = self.evaluate()
            self._record_landed(results, log, bad)
            return
        scale_before = self.engine.scaler.scale if self.engine.scaler is not None else None
        result = self.train_step(measure=measure)
        if self.own_step is not None:  # its held-out metrics on every logged step (the report reads them)
            if self._logged(result.step):
                result.extra.update(self.own_step.evaluate())
        elif every and (self.step % every == 0 or self.step == cfg.train.steps):
            result.eval_loss = self.evaluate()
        self._log_result(result, log, bad, scale_before)

    def _record_landed(self, results: list[StepResult], log: MetricsLog, bad: BadSteps) -> None:
        for result in results:  # fp32 only: no loss scale before or after
            self._log_result(result, log, bad, None)

    def _log_result(self, result: StepResult, log: MetricsLog, bad: BadSteps, scale_before: float | None) -> None:
        """Log a finished step and count it for the NaN policy."""
        self.history.append(result)
        if self._logged(result.step) or result.skipped or result.eval_loss is not None or result.compile_s:
            log.write(result.record())
        if result.compile_s:
            log.note(f"bigtrain: step {result.step + 1} compiled for {result.compile_s:.1f} s (compile.enabled: "
                     f"each block's forward and backward graph, the first time it runs)")
        log.advance()
        try:
            note = bad.observe(result.step + 1, result.loss, result.grad_norm, result.skipped, scale_before,
                               result.loss_scale)
        except NonFiniteStop as stop:
            self.wait_for_save()
            raise self._record(NonFiniteStop(f"{stop}; {self._last_finite_checkpoint()}", stop.step))
        if note is not None:
            log.note(f"bigtrain: {note}")

    def _last_finite_checkpoint(self) -> str:
        newest = ckpt.list_checkpoints(self.checkpoint_root)
        return (f"the newest checkpoint, {newest[0].name}, holds the last finite state" if newest else
                "no checkpoint was written")

    def evaluate(self) -> float | dict[str, float]:
        """The mean loss over the held-out windows (``train.eval_batches`` global batches of
        ``data.val_fraction`` or ``data.val_source``) at the current weights; collective (:mod:`bigtrain.evaluate`). A family
        with its own step: its held-out metrics (a recommender's AUC and log loss)."""
        if self.own_step is not None:
            return self.own_step.evaluate()
        return held_out_loss(self.parallel, self.sampler, self.cfg.train.eval_batches, self.mesh.coord("dp"),
                             self.mesh.size("dp"), self.cfg.train.micro_batch, self._to_device)

    def _save_unless_bad(self, bad: BadSteps, log: MetricsLog) -> bool:
        """Save now, unless the last step was a bad one (the newest checkpoint stays the last
        finite state while a streak lasts); whether a checkpoint was written."""
        if bad.streak:
            if bad.streak == 1:
                log.note(f"bigtrain: step {self.step}: no checkpoint is written until a step is finite again")
            return False
        return self.save()

    def _replicas_agree(self) -> bool:
        """Whether the data-parallel replicas hold the same parameters (local SGD: only after an
        average), so that a checkpoint of them is one every replica trained."""
        averaging = self.engine.averaging if isinstance(self.engine, ReplicatedEngine) else None
        return averaging is None or averaging.in_agreement()

    def _stop_now(self, signum: int, log: MetricsLog) -> bool:
        """Whether a run that got ``signum`` stops at this step: local SGD's replicas train on to their
        next average (at most K - 1 steps), whose parameters the checkpoint can hold."""
        if self._replicas_agree():
            return True
        if not self._stop_deferred:
            self._stop_deferred = True
            log.note(f"bigtrain: {signal_name(signum)} at step {self.step}: stopping after the replicas' next "
                     f"average (parallel.local_sgd_every), which the checkpoint holds")
        return False

    def _stop_on_signal(self, signum: int, saved: bool) -> None:
        self.wait_for_save()
        name = signal_name(signum)
        if saved:
            what = (f"saved checkpoint step_{self.step:08d}; continue with bigtrain train --output-dir "
                    f"{self.run_dir} --resume")
        else:
            newest = ckpt.list_checkpoints(self.checkpoint_root)
            what = f"nothing saved now; the newest checkpoint is {newest[0].name if newest else 'none'}"
        raise self._record(Preempted(f"stopped by {name} after step {self.step}: {what}", signum))

    def _record(self, stop: NonFiniteStop | Preempted) -> NonFiniteStop | Preempted:
        """``stop``, recorded in the run directory (the launcher reads its exit code from there)."""
        if self.is_main:
            try:
                record_stop(self.run_dir, stop.exit_code, str(stop), self.step)
                stop.recorded = True  # the launcher will read its code (bigtrain.cli)
            except RunDirWriteError as e:
                print(f"bigtrain: warning: {e}", file=sys.stderr)
        return stop

    def draw_pipeline(self) -> list[Path]:
        """The last step's measured timeline of every pipeline rank, and the schedule simulated
        with the measured mean F and B times: the seeds' bubble diagram, twice (rank 0 draws)."""
        rows = self.parallel.pp.gather_objects(self.executor.timeline)
        if not self.is_main or rows is None:
            return []
        measured = align_timelines(rows)
        mean = {kind: statistics.mean([end - start for row in measured for label, start, end in row
                                       if str(label).startswith(kind)] or [0.0]) for kind in "FBIW"}
        schedule = self.parallel.schedule
        backward = mean["I"] + mean["W"] if schedule.split_backward else mean["B"]
        # Simulated costs are per rank's share of the model: undo the per-chunk split of interleaving.
        sim = simulate(schedule, cost_f=mean["F"] * schedule.v, cost_b=backward * schedule.v,
                       cost_w=mean["W"] * schedule.v)
        title = f"{schedule.kind}, p={schedule.p}, m={schedule.m}, v={schedule.v}"
        return [draw_timeline(measured, self.run_dir / "timeline_measured.png", f"measured: {title}"),
                draw_timeline(sim.timelines, self.run_dir / "timeline_simulated.png",
                              f"simulated: {title}, bubble {sim.overall_bubble_fraction:.0%}")]

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def run_id(self) -> str | None:
        """This run's id (recorded in ``run.json`` and in every checkpoint's manifest; rank 0)."""
        if self._run_id is None and self.is_main:
            self._run_id = ensure_run_id(self.run_dir, self._continued_run_id())
        return self._run_id

    def _continued_run_id(self) -> str | None:
        """The run id of the run's own checkpoint the last resume loaded (None: none, or another folder's)."""
        own = self.resumed_from is not None and ckpt.is_checkpoint_of(self.checkpoint_root, self.resumed_from)
        return self._resumed_run_id if own else None

    @property
    def checkpoint_format(self) -> str:
        """The "format" of this run's checkpoints (its family's entries: a recommender's are not a decoder's)."""
        return self.family.checkpoint_format or ckpt.FORMAT

    def save(self) -> bool:
        """Write checkpoint ``step`` in the sharded format: every rank writes the chunks it owns, in
        parallel (torch.distributed.checkpoint); rank 0 commits it (manifest, checksums, rename)
        once all are written. With ``checkpoint.async`` the chunks are snapshotted here and written
        in a background thread while training goes on (see :meth:`wait_for_save`). Nothing is
        written, and False returned, when any rank's weights or optimizer state are not finite, or
        between local SGD's averages (each replica's part of a range would be a patchwork)."""
        self.wait_for_save()
        self._land_pending()  # the checkpoint holds the update of the step it is named after
        background = getattr(self.cfg.checkpoint, "async")
        if not self._replicas_agree():
            if self.is_main:
                print(f"bigtrain: step {self.step}: not saving a checkpoint: local SGD's replicas hold different "
                      f"parameters between averages (every parallel.local_sgd_every steps)", flush=True)
            return False
        chunks = self.parallel.owned_chunks(copy=background, deferred=True)
        if not self.checkpoint_writer.all_finite(chunks):
            if self.is_main:
                print(f"bigtrain: step {self.step}: not saving a checkpoint: the weights or optimizer state are "
                      f"not finite", flush=True)
            return False
        scaler = self.engine.scaler
        meta = {"format": self.checkpoint_format, "config": self.cfg.to_dict(), "world_size": self.mesh.world_size,
                "optimizer": self.engine.optim_spec.name, "run_id": self.run_id,
                "loss_scaler": scaler.state_dict() if scaler is not None else None, "data": self.data_extent(),
                "model_description": self.model_description}
        self._note_segment()
        self.checkpoint_writer.write(self.step, chunks, meta, background)
        return True

    def wait_for_save(self) -> None:
        """Block until a background checkpoint write is committed (re-raising its error)."""
        self.checkpoint_writer.wait()

    def close(self) -> None:
        """A background checkpoint write committed first (re-raising its error), then the step's
        resources released (:meth:`StepRunner.close`). Idempotent."""
        try:
            self.checkpoint_writer.close()
        finally:
            super().close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resume(self, where: str) -> bool:
        """Continue from checkpoint ``where`` ('auto': this run's newest that verifies and loads);
        collective. False when 'auto' finds nothing (a fresh start). See :mod:`bigtrain.checkpoint.resume`."""
        self.wait_for_save()
        found = resume_checkpoint(self, where, read_run_id(self.run_dir))
        if found is None:
            return False
        self.step = int(found[1]["step"])
        self.resumed_from, self._resumed_run_id = found[0], found[1].get("run_id")
        if self.is_main and (caveat := resume_caveat(self.cfg, found[1].get("config", {}), found[0].name)):
            warnings.warn(caveat, stacklevel=2)  # bigtrain train prints it as one 'bigtrain: warning:' line
        if isinstance(self.engine, ReplicatedEngine) and self.engine.averaging is not None:
            self.engine.averaging.continue_at(self.step)
        return True

    def data_extent(self) -> dict | None:
        """The corpus's training and held-out token counts (None for a family with its own data):
        a checkpoint records them, so a resume on a corpus that changed under the same data.source
        says so (:mod:`bigtrain.checkpoint.resume`)."""
        if self.own_step is not None:
            return None
        train, held_out = self.sampler.token_counts()
        return {"train_tokens": train, "held_out_tokens": held_out, "fingerprint": self.sampler.fingerprint()}

    def units_seen(self) -> int:
        """The tokens (a recommender: the samples) of every step the run trained, each at the global
        batch of the launch that trained it (a resume may change train.global_batch): the run's
        segments' sum (rank 0 keeps them), else this launch's batch for every step."""
        segments = read_segments(self.run_dir) if self.is_main else []
        return totals(segments)["tokens"] if segments else self.step * self.global_tokens

    def summary(self) -> dict:
        """What ``summary.json`` records (the report reads it): the run's size and shape, what
        identifies it (:mod:`bigtrain.run_info`), and the planner's prediction for its layout."""
        cfg = self.cfg
        if self.own_step is not None:
            return {"steps": self.step, "mesh": self.mesh.sizes, "wall_time_s": self.wall_time_s,
                    "run": run_info.identity(cfg, self.device.type == "cuda"),
                    f"{self.own_step.unit}_seen": self.units_seen(),
                    "predicted": None, **self.own_step.summary()}
        return {"params": count_parameters(self.model), "steps": self.step,
                "checkpointed_blocks": self.parallel.checkpointed, "grad_accum": self.accum,
                "transforms": {name: list(kinds) for name, kinds in self.parallel.transforms.items()},
                "compile_s": self.compile_clock.seconds if self.compile_clock is not None else 0.0,
                "mesh": self.mesh.sizes, "model_params": family_parameters(self.family, cfg),  # whole, on meta
                "tokens_seen": self.units_seen(),
                "wall_time_s": self.wall_time_s, "run": run_info.identity(cfg, self.device.type == "cuda"),
                "data": {"source": cfg.data.source, **self.data_extent(),
                         **({"val_source": cfg.data.val_source} if cfg.data.val_source else {}),
                         **({"blend": cfg.data.blend} if cfg.data.blend else {})},
                # The planner models the decoder the [model] fields describe; another family's is not.
                "predicted": run_info.prediction(cfg, self.device.type == "cuda") if self.family.model_fields else None}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
