"""Training a DLRM over the data-parallel ranks: the tables sharded (``bigtrain.parallel.embedding``),
the dense part through the engine like any model.

``parallelize_dlrm`` swaps the plain model's :class:`EmbeddingBags` for the sharded lookup, records
each table part's placement next to the dense weights' (``dense``: replicated, partial over
``dp_sp``), and hands the engine only the dense modules: the tables' gradients are never reduced by it, their sparse optimizer runs in backward.

A step on each of the W ranks: its B = global_batch / W samples of the step's global batch, the
summed binary cross-entropy divided by the global batch (so the sum over ranks is the mean), the
dense update at the schedule's learning rate after clipping the dense gradients' norm.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bigtrain import checkpoint as ckpt
from bigtrain.config import Config
from bigtrain.distributed.mesh import Mesh
from bigtrain.from_config import parallel_plan
from bigtrain.models.dlrm import DLRM, bce_loss_sum, build_dlrm, init_value
from bigtrain.core.tables import parse_sizes
from bigtrain.optim.schedule import lr_at
from bigtrain.optim.sparse import SparseOptimizer
from bigtrain.parallel.build import apply_engine
from bigtrain.parallel.embedding import EmbeddingLayout, ShardedEmbeddingBags
from bigtrain.parallel.placement import Placements
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.recsys.placement import plan_embedding
from bigtrain.recsys.checkpoint import commit_dlrm, resume_dlrm
from bigtrain.recsys.data import sampler_for
from bigtrain.recsys.metrics import auc, log_loss


def layout_for(cfg: Config, world: int) -> EmbeddingLayout:
    e = cfg.embedding
    state = SparseOptimizer(e.optimizer, e.lr).state_bytes_per_row()
    return plan_embedding(parse_sizes(e.tables), e.dim, world, e.sharding, state, int(e.budget_gb * 2**30))


@dataclass
class ParallelDLRM:
    model: DLRM  # the tables replaced by this rank's sharded lookup
    embeddings: ShardedEmbeddingBags
    dense: nn.Module  # what the engine owns: the bottom and top MLPs
    engine: ReplicatedEngine
    placements: Placements  # every parameter this rank holds, tables included

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight by name, tables whole (a collective over the tables' ranks), on the CPU."""
        tables = gather_tables(self, self.embeddings.layout)
        return {**self.engine.full_weights(), **{f"embeddings.tables.{t}.weight": w for t, w in tables.items()}}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The dense part's reduced, unclipped gradients by name (between the gradient sync and the
        step); the tables have none: their sparse optimizer ran in backward."""
        return self.engine.full_grads()


def parallelize_dlrm(model: DLRM, mesh: Mesh, cfg: Config, layout: EmbeddingLayout,
                     device: torch.device | str = "cpu") -> ParallelDLRM:
    comm, seed = mesh.comm("dp_sp"), cfg.train.seed
    e = cfg.embedding
    sharded = ShardedEmbeddingBags(layout, comm, SparseOptimizer(e.optimizer, e.lr, e.eps), device)
    model.embeddings = sharded
    sharded.init_from(lambda t: init_value(f"embeddings.tables.{t}.weight", (layout.rows[t], layout.dim), seed))
    dense = nn.ModuleDict({"bottom": model.bottom, "top": model.top})  # the same names as in the model
    placements = Placements.of_model(dense, mesh.comm)
    engine = apply_engine(dense, mesh, parallel_plan(cfg), lambda name, shape: init_value(name, shape, seed),
                          placements, device)
    record = dict(placements.items())
    record.update({f"embeddings.tables.{t}.weight": layout.placement(t, comm.rank)
                   for t in layout.local_shapes(comm.rank)})
    return ParallelDLRM(model, sharded, dense, engine, Placements(record, mesh.comm))


@dataclass
class DlrmStep:
    loss: float
    grad_norm: float
    skipped: bool


class DlrmTrainer:
    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device | str = "cpu"):
        self.cfg, self.mesh, self.device = cfg, mesh, torch.device(device)
        self.comm = mesh.comm("dp_sp")
        self.world, self.rank = self.comm.size, self.comm.rank
        self.layout = layout_for(cfg, self.world)
        self.parallel = parallelize_dlrm(build_dlrm(cfg, "meta"), mesh, cfg, self.layout, self.device)
        self.model, self.engine = self.parallel.model, self.parallel.engine
        self.sampler = sampler_for(cfg, parse_sizes(cfg.embedding.tables))
        self.local_batch = cfg.train.global_batch // self.world
        self.step = 0

    def _local(self, sampler, step: int):
        dense, ids, labels = sampler.batch(step, self.rank * self.local_batch, self.local_batch)
        return dense.to(self.device), ids.to(self.device), labels.to(self.device)

    def local_batch_of(self, step: int):
        """This rank's part of step ``step``'s global batch: (dense, ids, labels) on the device."""
        return self._local(self.sampler, step)

    def train_step(self, batch=None, before_update=None) -> DlrmStep:
        """One step, on ``batch`` (from :meth:`local_batch_of`) or this step's batch from the sampler;
        ``before_update`` is called once the dense gradients are reduced, before the dense update
        (``bigtrain check`` reads them there, as from :meth:`bigtrain.train.Trainer.train_step`)."""
        cfg = self.cfg
        dense, ids, labels = batch if batch is not None else self._local(self.sampler, self.step)
        loss_sum = bce_loss_sum(self.model(dense, ids), labels)
        self.engine.backward(loss_sum / cfg.train.global_batch)  # the tables update in here
        self.engine.finish_grad_sync()
        if before_update is not None:
            before_update()
        lr = lr_at(self.step, cfg.train.steps, cfg.optim, cfg.train.global_batch)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        norm, skipped = self.engine.step(lr, max_norm)
        self.engine.zero_grad()
        total = loss_sum.detach().clone()
        self.comm.all_reduce(total, tag="metrics")
        self.step += 1
        return DlrmStep(float(total) / cfg.train.global_batch, norm, skipped)

    def fit(self, run_dir: Path | None = None, eval_batches: int = 4) -> list[dict]:
        """Train ``train.steps`` steps; every ``logging.log_every`` steps (and at the end) a record of
        the loss, samples/s and the held-out AUC and log loss, written to ``metrics.jsonl`` by rank 0
        and printed there."""
        cfg = self.cfg
        root = Path(run_dir) / "checkpoints" if run_dir is not None else None
        resumed = root is not None and self.resume(root)
        log = Path(run_dir) / "metrics.jsonl" if run_dir is not None and self.rank == 0 else None
        if log is not None and not resumed:
            log.write_text("")
        records, started, done = [], time.perf_counter(), 0
        every, saved = cfg.checkpoint.every, self.step
        while self.step < cfg.train.steps:
            result = self.train_step()
            done += 1
            if root is not None and every > 0 and self.step % every == 0:
                commit_dlrm(self, root, cfg.checkpoint.keep)
                saved = self.step
            if self.step % cfg.logging.log_every == 0 or self.step == cfg.train.steps:
                elapsed = time.perf_counter() - started
                record = {"step": self.step, "loss": result.loss, "grad_norm": result.grad_norm,
                          "samples_per_s": done * cfg.train.global_batch / elapsed, **self.evaluate(eval_batches)}
                records.append(record)
                if log is not None:
                    with open(log, "a") as f:
                        f.write(json.dumps(record) + "\n")
                if self.rank == 0:
                    print(f"step {record['step']:>6}  loss {record['loss']:.4f}  auc {record['auc']:.4f}  "
                          f"log loss {record['log_loss']:.4f}  {record['samples_per_s']:,.0f} samples/s", flush=True)
                started, done = time.perf_counter(), 0  # the evaluation is not training time
        if root is not None and cfg.checkpoint.save_final and saved != self.step:
            commit_dlrm(self, root, cfg.checkpoint.keep)
        return records

    def resume(self, root: Path) -> bool:
        """As ``checkpoint.resume`` says: 'none', 'auto' (the newest valid checkpoint under ``root``,
        this run's checkpoints folder, if any) or a path; True when a checkpoint was loaded."""
        where = self.cfg.checkpoint.resume
        if where == "none":
            if ckpt.list_checkpoints(root):  # a fresh run would rotate them away
                raise ValueError(f"{root.parent} holds checkpoints of a run (newest "
                                 f"{ckpt.list_checkpoints(root)[0].name}): continue it with --resume "
                                 f"(checkpoint.resume = 'auto'), or use another run directory")
            return False
        loaded = resume_dlrm(self, root if where == "auto" else Path(where))
        if loaded is None and where != "auto":
            raise ValueError(f"checkpoint.resume = '{where}': no checkpoint there verifies")
        if loaded is not None and self.rank == 0:
            print(f"bigtrain: resumed from {loaded} at step {self.step}", flush=True)
        return loaded is not None

    @torch.no_grad()
    def evaluate(self, batches: int = 4) -> dict[str, float]:
        """AUC and log loss on ``batches`` global batches of the held-out slice (every rank the same)."""
        held_out = self.sampler.held_out()
        logits, labels = [], []
        for step in range(batches):
            dense, ids, y = self._local(held_out, step)
            local = torch.stack([self.model(dense, ids).float(), y.float()])
            gathered = local.new_empty((self.world, 2, self.local_batch))
            self.comm.all_gather(gathered, local.unsqueeze(0).contiguous(), tag="metrics")
            logits.append(gathered[:, 0].reshape(-1))
            labels.append(gathered[:, 1].reshape(-1))
        logits, labels = torch.cat(logits).cpu(), torch.cat(labels).cpu()
        return {"auc": auc(logits, labels), "log_loss": log_loss(logits, labels)}

    def embedding_bytes(self) -> int:
        """Measured: the live storages of this rank's table parts and their optimizer state."""
        tensors = [p for p in self.parallel.embeddings.parameters()] + self.parallel.embeddings.state_tensors()
        return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def gather_tables(parallel: ParallelDLRM, layout: EmbeddingLayout) -> dict[int, torch.Tensor]:
    """Whole tables from their pieces (all-reduce of zero-padded parts, in table order), on the CPU.
    The sum runs on the tables' device: NCCL reduces device tensors only."""
    emb = parallel.embeddings
    device = next(iter(parallel.dense.parameters())).device  # a rank may hold no table piece
    out = {}
    for t in range(len(layout.rows)):
        if layout.kinds[t] == "data":
            out[t] = emb.weight(t).detach().cpu().clone()
            continue
        full = torch.zeros((layout.rows[t], layout.dim), device=device)
        for piece in layout.pieces_of(t):
            if piece.rank == emb.rank:
                full[piece.rows[0]:piece.rows[1], piece.cols[0]:piece.cols[1]] = emb.weight(t).detach()
        emb.comm.all_reduce(full, tag="checkpoint")
        out[t] = full.cpu()
    return out
