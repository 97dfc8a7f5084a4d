"""The training loop on one rank: build, materialize, parallelize, step, log, checkpoint.

``Trainer(cfg, run_dir, mesh, device)`` is what ``bigtrain train`` runs in every rank, and what a
test or a user's script can run directly on a mesh it built itself.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bigtrain import checkpoint as ckpt
from bigtrain.config import Config, to_toml
from bigtrain.data import TokenSampler, load_tokens
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.accounting import SavedActivations
from bigtrain.memory.checkpointing import apply_activation_checkpointing
from bigtrain.metrics import MetricsLog
from bigtrain.models.llama import build_model, count_parameters, init_value
from bigtrain.optim.schedule import lr_at
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import DynamicLossScaler, Precision

MEM_KEYS = ("params", "grads", "optimizer", "activations")


@dataclass
class StepResult:
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

    def record(self) -> dict:
        out = {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
               "tokens_per_s": self.tokens / max(self.step_time_s, 1e-9), "step_time_s": self.step_time_s,
               "mem": self.mem, "comm": self.comm, "comm_ops": self.comm_ops, "skipped": self.skipped}
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        return out


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, mesh: Mesh, device: torch.device | str = "cpu"):
        self.cfg, self.run_dir, self.mesh, self.device = cfg, Path(run_dir), mesh, torch.device(device)
        self.is_main = mesh.rank == 0
        self.dp_comm = mesh.comm("dp")
        self.model = build_model(cfg.model)  # meta: no memory yet
        self.checkpointed = apply_activation_checkpointing(
            self.model.layers, cfg.memory.checkpointing, cfg.memory.checkpoint_every)
        self.engine = self._build_engine()
        self.sampler = TokenSampler(load_tokens(cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes),
                                    cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
        self.accum = cfg.train.grad_accum(mesh.size("dp"))
        self.global_tokens = cfg.train.global_batch * cfg.data.seq_len
        self.step = 0
        self.history: list[StepResult] = []

    def _build_engine(self) -> ReplicatedEngine | ZeroEngine:
        """Materialize the model's weights as the layout says: full replicas, or ZeRO shards
        (each rank allocating and initializing only what it keeps)."""
        cfg, model = self.cfg, self.model
        if cfg.parallel.zero == 0 and cfg.precision.mode == "fp32":
            model.to_empty(device=self.device)
            model.init_weights(cfg.train.seed)
            return ReplicatedEngine(model, self.dp_comm, cfg.optim, cfg.parallel.bucket_mb)
        model.init_buffers(self.device)
        return ZeroEngine(
            model, self.dp_comm, cfg.parallel.zero, Precision.from_config(cfg.precision), cfg.optim,
            init_fn=lambda name, shape: init_value(name, shape, cfg.train.seed, cfg.model), device=self.device,
            reshard_after_forward=cfg.parallel.reshard_after_forward, prefetch=cfg.parallel.prefetch,
            scaler=DynamicLossScaler.from_config(cfg.precision))

    # -- one optimizer step -------------------------------------------------------------------
    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, sync: bool,
                          tracker: SavedActivations | None) -> torch.Tensor:
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        context = self.engine.no_sync() if not sync else nullcontext()
        with context:
            with tracker if tracker is not None else nullcontext():
                loss_sum = token_loss_sum(self.model(tokens), targets)
            # Normalizing by the global token count makes the sum over micro-batches and ranks the mean.
            self.engine.backward(loss_sum / self.global_tokens)
        if tracker is not None:
            tracker.reset()  # backward freed what this micro-batch saved
        return loss_sum.detach()

    def train_step(self, measure: bool = False) -> StepResult:
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg.train.steps, cfg.optim, cfg.train.global_batch)
        before = self.mesh.stats.snapshot()
        tracker = SavedActivations(self.model) if measure else None
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        batches = self.sampler.micro_batches(step, self.mesh.coord("dp"), self.mesh.size("dp"), cfg.train.micro_batch)
        for i, (tokens, targets) in enumerate(batches):
            loss_sum += self._forward_backward(tokens, targets, sync=i == self.accum - 1, tracker=tracker)
        self.engine.finish_grad_sync()
        grad_norm, skipped = self.engine.step(lr, cfg.optim.grad_clip)
        step_time = time.perf_counter() - start
        traffic = self.mesh.stats.since(before)
        mem = self._memory(tracker) if measure else {}
        self.dp_comm.all_reduce(loss_sum, tag="metrics")
        self.engine.zero_grad()
        self.step += 1
        scaler = self.engine.scaler
        return StepResult(step, float(loss_sum) / self.global_tokens, grad_norm, lr, step_time,
                          self.global_tokens, mem, traffic.by_axis(), traffic.by_op(), skipped,
                          scaler.scale if scaler is not None else None)

    def _memory(self, tracker: SavedActivations) -> dict[str, int]:
        states = self.engine.state_bytes()
        values = torch.tensor([states["params"], states["grads"], states["optimizer"], tracker.peak],
                              dtype=torch.float64)
        self.mesh.comm("world").max(values)  # the worst rank
        return dict(zip(MEM_KEYS, (int(v) for v in values.tolist())))

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> list[StepResult]:
        cfg = self.cfg
        if cfg.checkpoint.resume != "none":
            self.resume(cfg.checkpoint.resume)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        log = MetricsLog(self.run_dir, self.is_main, cfg.train.steps, self.step, cfg.logging.progress)
        try:
            while self.step < cfg.train.steps:
                logged = (self.step + 1) % cfg.logging.log_every == 0 or self.step == 0 \
                    or self.step + 1 == cfg.train.steps
                result = self.train_step(measure=logged and cfg.logging.measure_memory)
                self.history.append(result)
                if logged:
                    log.write(result.record())
                log.advance()
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save()
        finally:
            log.close()
        if cfg.checkpoint.save_final and (not cfg.checkpoint.every or self.step % cfg.checkpoint.every):
            self.save()
        return self.history

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self) -> None:
        weights, optim_state = self.engine.full_state()  # collective under ZeRO
        if self.is_main:
            files = {"model.pt": weights, "optimizer.pt": optim_state}
            scaler = self.engine.scaler
            meta = {"config": self.cfg.to_dict(), "world_size": self.mesh.world_size,
                    "loss_scaler": scaler.state_dict() if scaler is not None else None}
            ckpt.save_checkpoint(self.checkpoint_root, self.step, files, meta, self.cfg.checkpoint.keep)
        self.mesh.comm("world").all_reduce(torch.zeros(1), tag="barrier")  # all ranks see the save

    def resume(self, where: str) -> bool:
        root = self.checkpoint_root if where == "auto" else Path(where)
        found = ckpt.newest_valid_checkpoint(root)
        if found is None:
            if where != "auto":
                raise FileNotFoundError(f"checkpoint.resume = '{where}': no valid checkpoint there")
            return False
        path, meta = found
        self.engine.load_full_state(ckpt.load_file(path, "model.pt"), ckpt.load_file(path, "optimizer.pt"))
        if self.engine.scaler is not None and meta.get("loss_scaler"):
            self.engine.scaler.load_state_dict(meta["loss_scaler"])
        self.step = int(meta["step"])
        return True

    def summary(self) -> dict:
        return {"params": count_parameters(self.model), "steps": self.step,
                "checkpointed_blocks": self.checkpointed, "grad_accum": self.accum,
                "mesh": self.mesh.sizes}


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
