"""Training a DLRM over the data-parallel ranks: the tables sharded (``bigtrain.parallel.embedding``),
the dense part through the engine like any model, the run by :class:`bigtrain.train.Trainer`
(:class:`DlrmStep` is the step it takes).

``parallelize_dlrm`` swaps the plain model's :class:`EmbeddingBags` for the sharded lookup, records
each table part's placement next to the dense weights' (``dense``: replicated, partial over
``dp_sp``), and hands the engine only the dense modules: the tables' gradients are never reduced by it,
their sparse optimizer takes the pooled gradients once the step is decided.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from bigtrain.config import Config
from bigtrain.distributed.mesh import Mesh
from bigtrain.from_config import parallel_plan
from bigtrain.models.dlrm import DLRM, bce_loss_sum, build_dlrm, init_value
from bigtrain.core.tables import parse_sizes
from bigtrain.optim.sparse import SparseOptimizer
from bigtrain.parallel.build import apply_engine
from bigtrain.parallel.embedding import ShardedEmbeddingBags
from bigtrain.parallel.embedding_layout import EmbeddingLayout
from bigtrain.parallel.placement import Placements
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.recsys.placement import micro_batch_sizes, plan_embedding
from bigtrain.parallel.chunks import SavedChunk
from bigtrain.recsys.checkpoint import dlrm_chunks, load_dlrm
from bigtrain.recsys.data import sampler_for
from bigtrain.recsys.metrics import auc, log_loss

if TYPE_CHECKING:  # the reader is handed in (bigtrain.recsys.checkpoint says why not imported here)
    from bigtrain.checkpoint.sharded import ChunkReader


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

    @property
    def layout(self) -> EmbeddingLayout:
        return self.embeddings.layout

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight by name, tables whole (a collective over the tables' ranks), on the CPU."""
        tables = gather_tables(self, self.embeddings.layout)
        return {**self.engine.full_weights(), **{f"embeddings.tables.{t}.weight": w for t, w in tables.items()}}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The dense part's reduced, unclipped gradients by name (between the gradient sync and the
        step); the tables have none: their sparse optimizer takes the pooled gradients."""
        return self.engine.full_grads()

    # -- checkpoints: what bigtrain.train.Trainer's save and resume ask of a parallel model --------
    def owned_chunks(self, copy: bool = False, deferred: bool = False) -> list[SavedChunk]:
        return dlrm_chunks(self, copy)  # no offload: nothing to read back (``deferred`` changes nothing)

    def load_sharded(self, reader: ChunkReader) -> None:
        load_dlrm(self, reader)

    def embedding_bytes(self) -> int:
        """Measured: the live storages of this rank's table parts and their optimizer state."""
        tensors = [p for p in self.embeddings.parameters()] + self.embeddings.state_tensors()
        return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


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


class DlrmStep:
    """The recommender's step for :class:`bigtrain.train.Trainer` (the family's ``own_step``): its
    sharded model, engine and sampler, one optimizer step, and the held-out metrics. The run around
    it (the NaN policy, signals, metrics, checkpoints and their commit, resume) is the Trainer's.

    A step on each of the W ranks: its B = global_batch / W samples of the step's global batch (in
    micro-batches of train.micro_batch, :meth:`micro_batches`), the
    summed binary cross-entropy divided by the global batch (so the sum over ranks is the mean), the
    dense update at the schedule's learning rate after clipping the dense gradients' norm, and the
    tables' sparse update; a step whose loss or gradients (dense or the tables') are not finite on
    any rank updates nothing on every rank."""

    unit = "samples"  # what a step's throughput counts (the record's samples_per_s), per_step of them

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device | str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self.comm = mesh.comm("dp_sp")
        self.world, self.rank = self.comm.size, self.comm.rank
        self.layout = layout_for(cfg, self.world)
        self.parallel = parallelize_dlrm(build_dlrm(cfg, "meta"), mesh, cfg, self.layout, self.device)
        self.model, self.engine = self.parallel.model, self.parallel.engine
        self.sampler = sampler_for(cfg, parse_sizes(cfg.embedding.tables))
        self.local_batch = cfg.train.global_batch // self.world
        self.per_step = cfg.train.global_batch  # samples in a step

    def _local(self, sampler, step: int):
        dense, ids, labels = sampler.batch(step, self.rank * self.local_batch, self.local_batch)
        return dense.to(self.device), ids.to(self.device), labels.to(self.device)

    def local_batch_of(self, step: int):
        """This rank's part of step ``step``'s global batch: (dense, ids, labels) on the device."""
        return self._local(self.sampler, step)

    def micro_batches(self) -> int:
        """Forwards and backwards a step takes on a rank: its B samples in micro-batches of
        train.micro_batch (the last one smaller when it does not divide B); one when train.micro_batch
        >= B (the presets set it to the global batch: no accumulation at any dp)."""
        return len(micro_batch_sizes(self.local_batch, self.cfg.train.micro_batch))

    def train_step(self, step: int, lr: float, before_update=None, batch=None) -> tuple[float, float, bool]:
        """Step ``step`` at learning rate ``lr`` on ``batch`` (from :meth:`local_batch_of`) or the
        sampler's; (mean loss, dense gradient norm, skipped). ``before_update`` is called once the
        dense gradients are reduced, before any update (``bigtrain check`` reads them there).

        Gradient accumulation: the batch's micro-batches go forward and backward in turn (the dense
        gradients summed, reduced over the ranks after the last; the tables' pooled gradients kept
        until the step's decision, then applied as one update), so the step is the whole batch's."""
        cfg, emb = self.cfg, self.parallel.embeddings
        dense, ids, labels = batch if batch is not None else self._local(self.sampler, step)
        sizes = micro_batch_sizes(dense.shape[0], cfg.train.micro_batch)
        total = torch.zeros((), device=self.device)
        first = 0
        with emb.accumulating():
            for k, size in enumerate(sizes):
                part, first = slice(first, first + size), first + size
                with self.engine.no_sync() if k < len(sizes) - 1 else contextlib.nullcontext():
                    loss_sum = bce_loss_sum(self.model(dense[part], ids[part]), labels[part])
                    # over the global batch: the sum over micro-batches and ranks is the mean
                    self.engine.backward(loss_sum / cfg.train.global_batch)  # the tables wait: emb.pending
                total += loss_sum.detach()
        self.engine.finish_grad_sync()
        if before_update is not None:
            before_update()
        self.comm.all_reduce(total, tag="metrics")
        # The NaN policy: a non-finite loss, or non-finite pooled gradients on any rank, vetoes the
        # step on every rank (the flag is summed with the gradient norm); the tables follow the verdict.
        veto = (~torch.isfinite(total)).float() + emb.pending_nonfinite()
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        norm, skipped = self.engine.step(lr, max_norm, skip=veto)
        emb.finish_update(apply=not skipped)
        self.engine.zero_grad()
        return float(total) / cfg.train.global_batch, norm, skipped

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

    def summary(self) -> dict:
        """What summary.json adds for a recommender: its parameters (tables whole) and this rank's
        table bytes."""
        layout = self.layout
        dense = sum(p.numel() for p in self.parallel.dense.parameters())
        return {"params": dense + sum(rows * layout.dim for rows in layout.rows),
                "embedding_bytes": self.parallel.embedding_bytes(), "grad_accum": self.micro_batches()}


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
