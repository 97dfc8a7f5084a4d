"""One optimizer step of a config's model on this rank: build the parallel model, run the
micro-batches (in turn, or through the pipeline schedule), reduce, update, measure.

:class:`StepRunner` is the step without the run around it; :class:`bigtrain.train.Trainer` adds the
run (the loop, metrics, the NaN policy, signals, checkpoints). :class:`StepResult` is what one step
reports (a metrics record).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from bigtrain.config import Config
from bigtrain.core.targets import IGNORE_INDEX
from bigtrain.data.load import run_sampler
from bigtrain.distributed.mesh import Mesh
from bigtrain.from_config import parallel_plan
from bigtrain.memory.accounting import SavedActivations
from bigtrain.families import Family, family_of, model_vocabulary
from bigtrain.families.own import initial_values
from bigtrain.optim.schedule import lr_at
from bigtrain.parallel.pipeline.deferred import DeferredUpdate, LandedUpdate, deferrable
from bigtrain.parallel.pipeline.executor import PipelineExecutor
from bigtrain.parallel.zero.delayed import abandon
from bigtrain.models.moe import moe_blocks, set_aux_loss_scale, update_router_biases
from bigtrain.parallel.build import ParallelModel, parallelize
from bigtrain.parallel.compile import compile_clock
from bigtrain.profiling import phase

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
    tokens: int  # what the step processed, in ``unit``s
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
    # A family's own step's fields of the record: on logged steps, its held-out metrics (AUC, log loss).
    extra: dict[str, float] = field(default_factory=dict)
    # What ``tokens`` counts; the record's throughput is ``{unit}_per_s`` (a recommender's step counts
    # samples: its record has samples_per_s, and no tokens_per_s, which would hold samples a second)
    unit: str = "tokens"

    def record(self) -> dict:
        out = {"step": self.step + 1, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
               f"{self.unit}_per_s": self.tokens / max(self.step_time_s, 1e-9), "step_time_s": self.step_time_s,
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
    plan = parallel_plan(cfg, run_dir, device_type=device.type, family_compiles=family.compiles)
    if family.tp_plan is not None:
        tp, sp = mesh.comm("tp").size, mesh.comm("sp").size
        styles = family.tp_plan(model, tp, plan.tensor.sequence_parallel and tp > 1, sp > 1)
        plan = dataclasses.replace(plan, tensor=dataclasses.replace(plan.tensor, styles=styles))
    if family.blocks is not None:
        plan = dataclasses.replace(plan, activations=dataclasses.replace(plan.activations, blocks=family.blocks),
                                   float8=dataclasses.replace(plan.float8, blocks=family.blocks))
    if family.head is not None:
        plan = dataclasses.replace(plan, activations=dataclasses.replace(plan.activations, head=family.head))
    plan = dataclasses.replace(plan, compile=dataclasses.replace(plan.compile, final_norm=family.final_norm))
    if family.split_stages is not None:
        plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, split=family.split_stages))
    if family.context_parallel is not None:
        plan = dataclasses.replace(plan, tensor=dataclasses.replace(plan.tensor,
                                                                    context_attention=family.context_parallel))
    return parallelize(model, mesh, plan, device, init_fn=initial_values(family, cfg, model))


class StepRunner:
    """This rank's part of ``cfg``'s model and the optimizer steps on it; ``step`` counts them."""

    def __init__(self, cfg: Config, run_dir: Path, mesh: Mesh, device: torch.device | str = "cpu"):
        self.cfg, self.run_dir, self.mesh, self.device = cfg, Path(run_dir), mesh, torch.device(device)
        self.is_main = mesh.rank == 0
        self.family = family_of(cfg)
        # Read once, as the model is built from it: the file may change while the run goes on.
        self.model_description = self.family.description(cfg.model) if self.family.description else None
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
        self._closed = False
        delayed = getattr(getattr(self.engine, "offload", None), "delayed", None)
        if delayed is not None:  # a runner dropped mid-update: its host step is cancelled, not run out
            weakref.finalize(self, abandon, weakref.ref(delayed))

    def close(self) -> None:
        """Release now what the step holds beyond tensors: offload's host update (a delayed one still
        running is cancelled at its next unit; ``fit`` lands the last before it returns), its files,
        pinned buffers and threads. Nothing is run on this runner after. Idempotent."""
        if self._closed:
            return
        self._closed = True
        offload = getattr(self.engine, "offload", None)
        if offload is not None:
            if offload.delayed is not None:
                offload.delayed.cancel()
            offload.close()

    def _build_decoder(self) -> None:
        """The decoder's parallel model, executor and token sampler (the Trainer's own step)."""
        cfg, mesh = self.cfg, self.mesh
        self.parallel = parallelize_family(self.family, cfg, mesh, str(self.run_dir), self.device)
        self.model, self.engine = self.parallel.model, self.parallel.engine
        self.compile_clock = compile_clock() if self.parallel.compiled is not None else None
        if self.compile_clock is not None:
            self.compile_clock.take()  # what compiled before this run (another trainer's) is not this run's
        set_aux_loss_scale(self.model, 1.0 / cfg.train.global_batch)  # each sequence's share of the batch mean
        self.moe_on_other_stages = self._moe_on_other_stages()
        self.executor = self._build_executor() if self.parallel.schedule is not None else None
        vocab, vocab_field = model_vocabulary(cfg)
        self.sampler = run_sampler(cfg, vocab_size=vocab, vocab_field=vocab_field)
        self.accum = cfg.train.grad_accum(mesh.size("dp"))
        self.global_tokens = cfg.train.global_batch * cfg.data.seq_len
        self.counted_targets = self.global_tokens  # this step's loss normalizer (fewer when targets are masked)

    def _moe_on_other_stages(self) -> bool:
        """Whether pipeline stages hold MoE blocks that this stage's record would leave out (a step's
        ``moe`` metrics are the first rank's, which updates only its own stage's blocks): agreed by
        every pipeline rank once, so that dense pipelines pay no collective a step."""
        pp = self.parallel.pp
        if pp.size == 1:
            return False
        held = torch.tensor([float(bool(moe_blocks(self.model)))], device=self.device)
        return bool(pp.max(held).item())

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
        # Each micro-batch's documents (block-causal attention) travel with it to every stage.
        # (Its keywords go on top of the executor's own, which they repeat: per-token positions win.)
        chunks = [self.parallel.model_inputs(self._to_device(t), self._to_device(y)) for t, y in batches]
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
        with phase("forward and backward"):
            if self.executor is not None:
                loss_sum, activations = self._micro_batches_through_pipeline(batches, measure)
            else:
                loss_sum, activations = self._micro_batches_in_turn(batches, measure)
        with phase("gradient reduction"):
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
        with phase("optimizer step"):
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
        if self.moe_on_other_stages:  # the record is the first rank's: every stage's blocks (after the timing)
            stages = self.parallel.pp.gather_objects(moe)
            moe = {name: m for stage in stages for name, m in stage.items()} if stages is not None else moe
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
        return StepResult(step, loss, grad_norm, lr, step_time, self.own_step.per_step, {}, traffic.by_axis(),
                          traffic.by_op(), skipped, unit=self.own_step.unit)

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
