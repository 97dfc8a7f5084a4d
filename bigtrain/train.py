"""The training loop on one rank: build, materialize, parallelize, step, log, checkpoint.

``Trainer(cfg, run_dir, mesh, device)`` is what ``bigtrain train`` runs in every rank, and what a
test or a user's script can run directly on a mesh it built itself.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from bigtrain import checkpoint as ckpt
from bigtrain import run_info
from bigtrain.checkpoint.hf import initial_weights
from bigtrain.checkpoint.interval import SaveInterval
from bigtrain.checkpoint.resume import ResumeError, resume_checkpoint
from bigtrain.checkpoint.sharded import save_chunks
from bigtrain.config import Config, to_toml
from bigtrain.core.targets import IGNORE_INDEX
from bigtrain.data import TokenSampler, load_corpus
from bigtrain.distributed.comm import AxisComm, CollectiveError, CommStats
from bigtrain.distributed.mesh import Mesh
from bigtrain.evaluate import held_out_loss
from bigtrain.from_config import parallel_plan
from bigtrain.memory.accounting import SavedActivations
from bigtrain.metrics import MetricsLog
from bigtrain.families import Family, family_of
from bigtrain.models.llama import count_parameters
from bigtrain.nonfinite import BadSteps, NonFiniteStop
from bigtrain.optim.schedule import lr_at
from bigtrain.parallel.pipeline.deferred import DeferredUpdate, LandedUpdate, deferrable
from bigtrain.parallel.pipeline.draw import draw_timeline
from bigtrain.parallel.pipeline.executor import PipelineExecutor, align_timelines
from bigtrain.parallel.pipeline.simulate import simulate
from bigtrain.models.moe import set_aux_loss_scale, update_router_biases
from bigtrain.parallel.build import ParallelModel, parallelize
from bigtrain.parallel.compile import compile_clock
from bigtrain.preemption import Preempted, SignalWatch
from bigtrain.run_dir import RunDirWriteError, ensure_run_id, forget_stop, read_run_id, record_stop, write_atomic
from bigtrain.run_segments import open_segment, update_segment

MEM_KEYS = ("params", "grads", "optimizer", "activations")
OFFLOAD_MEM_KEYS = ("host", "nvme")  # with offload: bytes its tiers hold (not part of the device's total)


@dataclass
class StepResult:
    # The update's index from 0 (the trainer's own count before it). What a user sees counts from 1:
    # a record's "step", the console, messages and checkpoint step_k all mean "after k updates".
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens: int
    mem: dict[str, int] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    comm_ops: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: bool = False
    loss_scale: float | None = None
    moe: dict[str, dict] = field(default_factory=dict)  # per MoE block: expert load, dropped routings, aux loss
    eval_loss: float | None = None  # the held-out loss after this step (train.eval_every)
    # offload: the host optimizer step that finished in this step (the previous step's, with the
    # delayed update): its duration and the fraction of it that ran during this step's forward and backward
    offload: dict[str, float] = field(default_factory=dict)
    compile_s: float = 0.0  # compile.enabled: seconds this rank spent compiling since the step before
    # A family's own step's fields of the record: its throughput in its unit (the recommender's
    # samples_per_s) and, on logged steps, its held-out metrics (AUC, log loss).
    extra: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict:
        out = {"step": self.step + 1, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
               "tokens_per_s": self.tokens / max(self.step_time_s, 1e-9), "step_time_s": self.step_time_s,
               "mem": self.mem, "comm": self.comm, "comm_ops": self.comm_ops, "skipped": self.skipped}
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        if self.moe:
            out["moe"] = self.moe
        if self.eval_loss is not None:
            out["eval_loss"] = self.eval_loss
        if self.offload:
            out["offload_step_ms"], out["offload_hidden"] = self.offload["step_ms"], self.offload["hidden"]
        if self.compile_s:
            out["compile_s"] = self.compile_s
        out.update(self.extra)
        return out


def parallelize_family(family: Family, cfg: Config, mesh: Mesh, run_dir: str, device: torch.device) -> ParallelModel:
    """This rank's part of ``cfg``'s model as its family builds, cuts and initializes it."""
    model = family.build_meta(cfg)
    plan = parallel_plan(cfg, run_dir, device_type=device.type)
    if family.tp_plan is not None:
        tp, sp = mesh.comm("tp").size, mesh.comm("sp").size
        styles = family.tp_plan(model, tp, plan.tensor.sequence_parallel and tp > 1, sp > 1)
        plan = dataclasses.replace(plan, tensor=dataclasses.replace(plan.tensor, styles=styles))
    if family.blocks is not None:
        plan = dataclasses.replace(plan, activations=dataclasses.replace(plan.activations, blocks=family.blocks))
    if family.split_stages is not None:
        plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, split=family.split_stages))
    init_fn = family.init_fn(cfg, model) if family.init_fn is not None else initial_weights(cfg.model)
    return parallelize(model, mesh, plan, device, init_fn=init_fn)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, mesh: Mesh, device: torch.device | str = "cpu"):
        self.cfg, self.run_dir, self.mesh, self.device = cfg, Path(run_dir), mesh, torch.device(device)
        self.is_main = mesh.rank == 0
        self.family = family_of(cfg)
        self.deferred: DeferredUpdate | None = None  # 2BW's deferred update, once started (fit does)
        # A family with a step of its own (the recommender's): the run below is this one's all the same.
        self.own_step = self.family.own_step(cfg, mesh, self.device) if self.family.own_step is not None else None
        if self.own_step is not None:
            self.parallel, self.model, self.engine = self.own_step.parallel, self.own_step.model, self.own_step.engine
            self.compile_clock, self.executor, self.accum = None, None, 1
            self.sampler = self.own_step.sampler
            self.global_tokens = self.own_step.per_step  # a step's units (segments and the summary count them)
        else:
            self._build_decoder()
        self.step = 0
        self.history: list[StepResult] = []
        self._pending_save: Future | None = None  # a background checkpoint write (checkpoint.async)
        self._save_thread: ThreadPoolExecutor | None = None
        self._checkpoint_group = None
        self._run_id: str | None = None
        self.wall_time_s: float | None = None  # of the last fit() (this attempt, when resumed)
        self._fit_started: float | None = None

    def _build_decoder(self) -> None:
        """The decoder's parallel model, executor and token sampler (the Trainer's own step)."""
        cfg, mesh = self.cfg, self.mesh
        self.parallel = parallelize_family(self.family, cfg, mesh, str(self.run_dir), self.device)
        self.model, self.engine = self.parallel.model, self.parallel.engine
        self.compile_clock = compile_clock() if self.parallel.compiled is not None else None
        if self.compile_clock is not None:
            self.compile_clock.take()  # what compiled before this run (another trainer's) is not this run's
        set_aux_loss_scale(self.model, 1.0 / cfg.train.global_batch)  # each sequence's share of the batch mean
        self.executor = self._build_executor() if self.parallel.schedule is not None else None
        self.sampler = TokenSampler(load_corpus(cfg.data),
                                    cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.data.ignore_target,
                                    cfg.data.val_fraction)
        self.accum = cfg.train.grad_accum(mesh.size("dp"))
        self.global_tokens = cfg.train.global_batch * cfg.data.seq_len
        self.counted_targets = self.global_tokens  # this step's loss normalizer (fewer when targets are masked)

    @property
    def checkpoint_format(self) -> str:
        """The "format" of this run's checkpoints (its family's entries: a recommender's are not a decoder's)."""
        return self.family.checkpoint_format or ckpt.FORMAT

    # -- one optimizer step -------------------------------------------------------------------
    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, sync: bool,
                          tracker: SavedActivations | None) -> torch.Tensor:
        tokens, targets = self._to_device(tokens), self._to_device(targets)
        context = self.engine.no_sync() if not sync else nullcontext()
        with context:
            with tracker if tracker is not None else nullcontext():
                loss_sum = self.parallel.forward_loss(tokens, targets)
            # Normalizing by the global count of targets makes the sum over micro-batches and ranks the mean.
            self.engine.backward(loss_sum / self.counted_targets)
        if tracker is not None:
            tracker.reset()  # backward freed what this micro-batch saved
        return loss_sum.detach()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A batch tensor on the compute device. To a GPU it is copied from pinned memory without
        blocking: from pageable memory torch would synchronize the stream, and the host would wait
        for the previous micro-batch's backward before it could queue the next forward (the pinned
        buffer is not reused before the copy ran: torch's host allocator records it on the stream)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.contiguous().pin_memory().to(self.device, non_blocking=True)

    def _micro_batches_in_turn(self, batches, measure: bool) -> tuple[torch.Tensor, int]:
        """Forward and backward of each micro-batch in turn; (summed loss, peak saved bytes)."""
        tracker = SavedActivations(self.model) if measure else None
        loss_sum = torch.zeros((), device=self.device)
        for i, (tokens, targets) in enumerate(batches):
            loss_sum += self._forward_backward(tokens, targets, sync=i == self.accum - 1, tracker=tracker)
        return loss_sum, tracker.peak if tracker is not None else 0

    def _micro_batches_through_pipeline(self, batches, measure: bool, reduce: bool = True) -> tuple[torch.Tensor, int]:
        """The schedule's order of forwards and backwards over this rank's stages. An asynchronous
        schedule also starts the next steps' first forwards: it gets their micro-batches too.
        ``reduce``: sum the loss over the pipeline here (else the caller does, later)."""
        for ahead in range(1, self.executor.lookahead_steps + 1):
            batches = batches + list(self.sampler.micro_batches(self.step + ahead, self.mesh.coord("dp"),
                                                                self.mesh.size("dp"), self.cfg.train.micro_batch))
        chunks = [self.parallel.sequence_chunk(self._to_device(t), self._to_device(y))[:2] for t, y in batches]
        self.executor.measure_activations = measure
        out = self.executor.run(chunks)
        loss_sum = torch.zeros((), device=self.device)
        if out is not None:  # the last stage: undo the normalization and the loss scale of loss_fn
            loss_sum = out.detach() * self.counted_targets / self._loss_scale()
        if reduce:
            self.parallel.pp.all_reduce(loss_sum, tag="metrics")
        return loss_sum, self.executor.peak_activation_bytes

    def _loss_scale(self) -> float:
        return self.engine.scaler.scale if self.engine.scaler is not None else 1.0

    def _build_executor(self) -> PipelineExecutor:
        parallel = self.parallel

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # The executor calls backward itself: normalize (and scale, for fp16) here.
            return parallel.loss_sum(logits, targets) / self.counted_targets * self._loss_scale()

        return PipelineExecutor(parallel.stages, parallel.schedule, parallel.pp, loss_fn,
                                engines={s: self.engine for s in parallel.stages},
                                forward_kwargs=parallel.forward_kwargs(parallel.sequence_position(self.cfg.data.seq_len)),
                                vertical_sync=self.cfg.parallel.pp_vertical_sync)

    def _step_inputs(self) -> tuple:
        """What a step starts from: (its learning rate, the traffic counters before it, its start
        time, the batch's count of targets, this replica's micro-batches)."""
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg.train.steps, cfg.optim, cfg.train.global_batch)
        before = self.mesh.stats.snapshot()
        start = time.perf_counter()
        batches = list(self.sampler.micro_batches(step, self.mesh.coord("dp"), self.mesh.size("dp"),
                                                  cfg.train.micro_batch))
        return lr, before, start, self.sampler.counted_targets(step), batches

    def train_step(self, measure: bool = False, before_update: Callable[[], None] | None = None) -> StepResult:
        """One optimizer step. ``before_update`` runs once the gradients are reduced and before the
        optimizer uses them (``bigtrain check`` reads them there)."""
        if self.own_step is not None:
            return self._own_train_step(before_update)
        self._land_pending()  # after deferred steps: their last update first
        cfg, step = self.cfg, self.step
        lr, before, start, global_targets, batches = self._step_inputs()
        # Local SGD: each replica's gradient is the mean loss's over its own part of the batch.
        local = getattr(self.engine, "averaging", None) is not None
        self.counted_targets = max(1, sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)) if local else global_targets
        computing = time.perf_counter()
        if self.executor is not None:
            loss_sum, activations = self._micro_batches_through_pipeline(batches, measure)
        else:
            loss_sum, activations = self._micro_batches_in_turn(batches, measure)
        self.parallel.finish_grad_sync()
        if self.device.type == "cuda" and getattr(self.engine, "offload", None) is not None:
            torch.cuda.current_stream(self.device).synchronize()  # the overlap timeline's end: the device's
        computed = time.perf_counter()
        if before_update is not None:
            before_update()
        # Every rank's loss before the update: a non-finite one (anywhere) vetoes the step on every
        # rank, through the overflow flag the gradient norm's reduction carries (the NaN policy).
        self.parallel.grad_comm.all_reduce(loss_sum, tag="metrics")
        veto = (~torch.isfinite(loss_sum)).float()
        grad_norm, skipped = self.engine.step(lr, cfg.optim.grad_clip, skip=veto)  # host sync 1: norm, skip
        if self.deferred is not None:  # the executor keeps versions when told: these weights are the next
            self.executor.keep_version(self.executor.runs)
        # The replicas' loads summed; a skipped step leaves the routers' biases as they were.
        moe = update_router_biases(self.model, self.parallel.grad_comm, move_biases=not skipped)
        traffic = self.mesh.stats.since(before)
        # Host sync 2, the step's last: on CUDA it waits for the current stream, where the optimizer's
        # kernels were queued before it, so the step time below is the device's, not the time it
        # took to queue the kernels.
        loss = float(loss_sum) / global_targets
        step_time = time.perf_counter() - start
        mem = self._memory(activations) if measure else {}  # one more sync, on measured steps only
        self.engine.zero_grad()
        self.step += 1
        scaler = self.engine.scaler
        return StepResult(step, loss, grad_norm, lr, step_time, self.global_tokens, mem, traffic.by_axis(),
                          traffic.by_op(), skipped, scaler.scale if scaler is not None else None, moe,
                          offload=self._host_step(computing, computed), compile_s=self._compile_seconds())

    def _own_train_step(self, before_update: Callable[[], None] | None) -> StepResult:
        """One step of the family's own step (:attr:`own_step`), at the schedule's learning rate."""
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg.train.steps, cfg.optim, cfg.train.global_batch)
        before, start = self.mesh.stats.snapshot(), time.perf_counter()
        loss, grad_norm, skipped = self.own_step.train_step(step, lr, before_update)
        step_time = time.perf_counter() - start
        traffic = self.mesh.stats.since(before)
        self.step += 1
        per_s = {f"{self.own_step.unit}_per_s": self.own_step.per_step / max(step_time, 1e-9)}
        return StepResult(step, loss, grad_norm, lr, step_time, self.own_step.per_step, {}, traffic.by_axis(),
                          traffic.by_op(), skipped, extra=per_s)

    def _compile_seconds(self) -> float:
        """Seconds spent compiling since the last step (compile.enabled): the first step's, and any
        recompilation's, which the metrics show."""
        return self.compile_clock.take()[0] if self.compile_clock is not None else 0.0

    # -- 2BW's deferred update (bigtrain/parallel/pipeline/deferred.py) ---------------------------------
    def start_deferred_updates(self) -> bool:
        """From now on, run 2BW steps with :meth:`train_step_deferred`'s boundary, where the layout
        allows it (:func:`deferrable`); whether it does. ``fit`` starts it."""
        if self.deferred is None and self.executor is not None and deferrable(self.parallel, self.cfg.model):
            self.deferred = DeferredUpdate(self.engine, self.executor, self.parallel.pp, self.cfg.optim.grad_clip)
        return self.deferred is not None

    def train_step_deferred(self, measure: bool = False) -> list[StepResult]:
        """One 2BW step whose boundary waits for no other rank: its reductions are posted and its
        update lands when the weights it makes are first needed (in the next step), with the same
        numbers as :meth:`train_step`. Returns the results of the steps whose updates landed during
        this call (the previous step's; none for the first): a step's loss, norm and skip are known
        only then. :meth:`flush_update` lands the last one."""
        if self.deferred is None:
            raise RuntimeError("train_step_deferred needs start_deferred_updates() (2BW, on a layout it allows)")
        step = self.step
        lr, before, start, global_targets, batches = self._step_inputs()
        self.counted_targets = global_targets
        loss_sum, activations = self._micro_batches_through_pipeline(batches, measure, reduce=False)
        self.parallel.finish_grad_sync()
        self.deferred.land()  # the previous step's, if no forward of this segment needed it (the last stage)
        pending = self.deferred.post(step, lr, loss_sum)
        traffic = self.mesh.stats.since(before)
        step_time = time.perf_counter() - start
        mem = self._memory(activations) if measure else {}  # a blocking collective: on measured steps only
        pending.info = {"global_targets": global_targets, "step_time": step_time, "mem": mem,
                        "comm": traffic.by_axis(), "comm_ops": traffic.by_op()}
        self.step += 1
        return self._landed_results()

    def flush_update(self) -> list[StepResult]:
        """Land the deferred update still pending (before a checkpoint, an evaluation, the end of a
        run, or a synchronous step): a barrier, as the synchronous boundary is. The results of the
        steps that landed and were not yet returned."""
        if self.deferred is None:
            return []
        self.deferred.flush()
        return self._landed_results()

    def _land_pending(self) -> None:
        """Land the deferred update still pending; its result waits for the next ``flush_update`` or
        ``train_step_deferred`` to return it."""
        if self.deferred is not None:
            self.deferred.flush()

    def _landed_results(self) -> list[StepResult]:
        landed, self.deferred.landed = self.deferred.landed, []
        return [self._deferred_result(one) for one in landed]

    def _deferred_result(self, landed: LandedUpdate) -> StepResult:
        pending, info = landed.pending, landed.pending.info
        return StepResult(pending.step, landed.loss_sum / info["global_targets"], landed.grad_norm, pending.lr,
                          info["step_time"], self.global_tokens, info["mem"], info["comm"], info["comm_ops"],
                          landed.skipped, compile_s=self._compile_seconds())

    def _host_step(self, start: float, end: float) -> dict[str, float]:
        offload = getattr(self.engine, "offload", None)
        return offload.host_step_timing(start, end) if offload is not None else {}

    def _memory(self, activations: int) -> dict[str, int]:
        states = self.engine.state_bytes()
        values = torch.tensor([states["params"], states["grads"], states["optimizer"], activations],
                              dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        self.mesh.comm("world").max(values)  # the worst rank
        mem = dict(zip(MEM_KEYS, (int(v) for v in values.tolist())))
        offload = getattr(self.engine, "offload", None)
        if offload is not None:  # the worst rank's bytes in host memory and in files
            tiers = offload.offloaded_bytes()
            values = torch.tensor([tiers[k] for k in OFFLOAD_MEM_KEYS], dtype=torch.float64, device=self.device)
            self.mesh.comm("world").max(values)
            mem.update(zip(OFFLOAD_MEM_KEYS, (int(v) for v in values.tolist())))
        return mem

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> list[StepResult]:
        """Train to ``train.steps``, resuming first if the config says so. Raises NonFiniteStop
        (``train.max_bad_steps`` bad steps in a row) or Preempted (SIGINT / SIGTERM, after saving)."""
        cfg = self.cfg
        started = self._fit_started = time.perf_counter()
        if self.is_main:  # unfinished saves of an earlier attempt: nothing reads them, they take space
            ckpt.remove_temp_dirs(self.checkpoint_root)
        if cfg.checkpoint.resume != "none":
            self.resume(cfg.checkpoint.resume)
        elif ckpt.list_checkpoints(self.checkpoint_root):  # a fresh run would rotate them away, or resume them
            newest = ckpt.list_checkpoints(self.checkpoint_root)[0].name
            raise ResumeError(f"{self.run_dir} holds checkpoints of a run (newest {newest}): continue it with "
                              f"checkpoint.resume = 'auto', or use another run directory")
        if self.is_main and self.step == 0 and cfg.model.init_from:  # resumed runs start from their checkpoint
            print(f"bigtrain: initial weights from model.init_from = {cfg.model.init_from!r}, not a random init",
                  flush=True)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._run_id = ensure_run_id(self.run_dir)
            forget_stop(self.run_dir)
            write_atomic(self.run_dir / "config.toml", to_toml(cfg))  # a full disk keeps the old one whole
            open_segment(self.run_dir, self.step, self.global_tokens, run_info.layout_text(cfg), run_info.git_commit())
        log = MetricsLog(self.run_dir, self.is_main, cfg.train.steps, self.step, cfg.logging.progress,
                         cfg.logging.tensorboard)
        scaler = self.engine.scaler
        bad = BadSteps(cfg.train.max_bad_steps, scaler.min_scale if scaler is not None else None)
        deferred = self.start_deferred_updates()
        timed = SaveInterval(cfg.checkpoint.every_minutes, self.mesh.comm("world"), self.device)
        saved_at = None  # the step of this launch's newest checkpoint
        try:
            with SignalWatch(self.mesh.comm("world")) as signals:
                while self.step < cfg.train.steps:
                    self._run_step(log, bad)
                    saved = False
                    by_steps = bool(cfg.checkpoint.every) and self.step % cfg.checkpoint.every == 0
                    if by_steps or timed.due(self.step):
                        self._record_landed(self.flush_update(), log, bad)  # the checkpoint holds this step's update
                        saved = self._save_unless_bad(bad, log)
                        saved_at = self.step if saved else saved_at
                        timed.replan(self.step)
                    # Every rank, every boundary: one decision. Deferred 2BW reads the previous
                    # boundary's (a signal stops the run a step later) rather than wait for the others.
                    signum = signals.agreed_late(self.device) if deferred else signals.agreed(self.device)
                    if signum is not None and self.step < cfg.train.steps:
                        self._record_landed(self.flush_update(), log, bad)
                        self._stop_on_signal(signum, saved or self._save_unless_bad(bad, log))
                self._record_landed(self.flush_update(), log, bad)  # the last step's update
                signals.settle()
        finally:
            log.close()
            self._note_segment()  # however the loop ended (a stop, a failure): the steps it got to
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

    def _note_segment(self) -> None:
        """This launch's segment of the run has reached ``self.step`` (rank 0 records it)."""
        if self.is_main and self._fit_started is not None:
            update_segment(self.run_dir, self.step, time.perf_counter() - self._fit_started)

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
        ``data.val_fraction``) at the current weights; collective (:mod:`bigtrain.evaluate`). A family
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
            self._run_id = ensure_run_id(self.run_dir)
        return self._run_id

    def save(self) -> bool:
        """Write checkpoint ``step`` in the sharded format: every rank writes the chunks it owns, in
        parallel (torch.distributed.checkpoint); rank 0 commits it (manifest, checksums, rename)
        once all are written. With ``checkpoint.async`` the chunks are snapshotted here and written
        in a background thread while training goes on (see :meth:`wait_for_save`). Nothing is
        written, and False returned, when any rank's weights or optimizer state are not finite."""
        self.wait_for_save()
        self._land_pending()  # the checkpoint holds the update of the step it is named after
        background = getattr(self.cfg.checkpoint, "async")
        chunks = self.parallel.owned_chunks(copy=background)
        if not self._all_finite(chunks):
            if self.is_main:
                print(f"bigtrain: step {self.step}: not saving a checkpoint: the weights or optimizer state are "
                      f"not finite", flush=True)
            return False
        scaler = self.engine.scaler
        meta = {"format": self.checkpoint_format, "config": self.cfg.to_dict(), "world_size": self.mesh.world_size,
                "optimizer": self.engine.optim_spec.name, "run_id": self.run_id,
                "loss_scaler": scaler.state_dict() if scaler is not None else None}
        self._note_segment()
        if not background:
            self._write_checkpoint(self.step, chunks, meta, None)
            return True
        if self._checkpoint_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            # The background write's collectives get their own group, apart from training's, with
            # the run's timeout (a new group's default is torch's 30 minutes).
            self._checkpoint_group = dist.new_group(backend="gloo",
                                                    timeout=timedelta(seconds=self.cfg.distributed.timeout_s))
        if self._save_thread is None:
            self._save_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending_save = self._save_thread.submit(self._write_checkpoint, self.step, chunks, meta,
                                                      self._checkpoint_group)
        return True

    def _all_finite(self, chunks: list) -> bool:
        """Whether every rank's chunks (weights, optimizer state) are finite; collective."""
        finite = [torch.isfinite(c.data).all() for c in chunks if c.data.is_floating_point()]
        flag = torch.zeros(1, device=self.device)
        if finite:  # one host sync for all of them
            flag += (~torch.stack(finite).all()).to(self.device, torch.float32)
        self.mesh.comm("world").max(flag, tag="checkpoint")
        return not flag.item()

    def _write_checkpoint(self, step: int, chunks: list, meta: dict, group) -> None:
        """Every rank writes its chunks, rank 0 commits. The ranks agree after each phase whether all
        succeeded (instead of barriers), so a failure on one rank stops all of them; the partial
        temporary directory is removed and earlier checkpoints stay as they were."""
        root, keep = self.checkpoint_root, self.cfg.checkpoint.keep
        tmp = ckpt.temp_dir(root, step)
        several = dist.is_initialized() and dist.get_world_size() > 1
        # A group of the async write is Gloo (host tensors); the default group may be NCCL.
        device = torch.device("cpu") if group is not None else self.device
        # The agreements go through a named collective: a rank that dies or freezes during the save
        # is reported like any other collective's failure (rank, collective, group), not as a raw
        # Gloo traceback. The background write's group keeps its own counters (another thread).
        comm = (self.mesh.comm("world") if group is None else
                AxisComm("world", group, dist.get_world_size(), dist.get_rank(), CommStats())) if several else None
        error: BaseException | None = None
        try:
            try:
                if self.is_main:
                    root.mkdir(parents=True, exist_ok=True)
                    ckpt.fresh_temp_dir(root, step)
            except OSError as e:
                error = e
            if several:  # DCP's writers create the directory too: they must find rank 0's fresh one, not race it
                error = _agree(error, comm, device, f"rank 0 could not create {tmp}")
            if error is None:
                try:
                    save_chunks(tmp, chunks, group)  # returns once every rank's files and the metadata are written
                    if self.is_main:
                        ckpt.commit_checkpoint(root, step, tmp, meta, keep)
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises a BaseException
                    error = e
                if several:  # every rank sees the committed save, or the failure
                    error = _agree(error, comm, device, f"another rank failed to write checkpoint step {step}")
        except CollectiveError as lost:  # another rank died or froze during the save
            lost.step = step
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            mine = (f"writing the parts (torch.distributed.checkpoint's own collectives) had failed on this rank "
                    f"first: {_short(error)}" if error is not None else "this rank had written its part")
            raise ckpt.CheckpointWriteError(f"{lost.describe()}\n  while saving checkpoint step {step} into {root}: "
                                            f"{mine}; the partial save was removed and "
                                            f"{_kept(root)}") from lost
        if error is None:
            return
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = _kept(root)
        if ckpt.is_disk_full(error):
            raise ckpt.CheckpointWriteError(f"checkpoint step {step}: no space left on device in {root}; the partial "
                                            f"save was removed and {kept}; free space or choose another "
                                            f"--output-dir, then continue with --resume") from error
        raise ckpt.CheckpointWriteError(f"checkpoint step {step} could not be written to {root} "
                                        f"({_short(error)}); {kept}") from error

    def wait_for_save(self) -> None:
        """Block until a background checkpoint write is committed (re-raising its error)."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            pending.result()

    def resume(self, where: str) -> bool:
        """Continue from checkpoint ``where`` ('auto': this run's newest that verifies and loads);
        collective. False when 'auto' finds nothing (a fresh start). See :mod:`bigtrain.checkpoint.resume`."""
        self.wait_for_save()
        found = resume_checkpoint(self, where, read_run_id(self.run_dir))
        if found is None:
            return False
        self.step = int(found[1]["step"])
        return True

    def summary(self) -> dict:
        """What ``summary.json`` records (the report reads it): the run's size and shape, what
        identifies it (:mod:`bigtrain.run_info`), and the planner's prediction for its layout."""
        cfg = self.cfg
        if self.own_step is not None:
            return {"steps": self.step, "mesh": self.mesh.sizes, "wall_time_s": self.wall_time_s,
                    "run": run_info.identity(cfg), f"{self.own_step.unit}_seen": self.step * self.own_step.per_step,
                    "predicted": None, **self.own_step.summary()}
        return {"params": count_parameters(self.model), "steps": self.step,
                "checkpointed_blocks": self.parallel.checkpointed, "grad_accum": self.accum,
                "transforms": {name: list(kinds) for name, kinds in self.parallel.transforms.items()},
                "compile_s": self.compile_clock.seconds if self.compile_clock is not None else 0.0,
                "mesh": self.mesh.sizes, "model_params": self.family.parameter_count(cfg),  # whole, on meta
                "tokens_seen": self.step * self.global_tokens,
                "wall_time_s": self.wall_time_s, "run": run_info.identity(cfg),
                "data": {"source": cfg.data.source, "train_tokens": len(self.sampler.tokens),
                         "held_out_tokens": len(self.sampler.val_tokens)},
                # The planner models the decoder the [model] fields describe; another family's is not.
                "predicted": run_info.prediction(cfg, self.device.type == "cuda") if self.family.model_fields else None}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _agree(error: BaseException | None, comm: AxisComm, device: torch.device, elsewhere: str
           ) -> BaseException | None:
    """This rank's ``error``, or one naming ``elsewhere`` if only another rank failed; collective
    (a CollectiveError naming it when a rank is gone)."""
    failed = torch.tensor([1 if error is not None else 0], dtype=torch.int32, device=device)
    comm.max(failed, tag="checkpoint")
    if error is None and failed.item():
        return RuntimeError(elsewhere)
    return error


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


def _kept(root: Path) -> str:
    """What a failed save left of the earlier checkpoints: the newest that verifies (its manifest;
    a link or a damaged folder under a checkpoint's name is not one)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped ones are not news here
        found = next(ckpt.valid_checkpoints(root, files=False), None)
    return f"the previous checkpoint {found[0].name} is intact" if found else "no earlier checkpoint exists"


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
