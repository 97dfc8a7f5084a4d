"""The independent reference for the DLRM: one process, plain PyTorch.

It shares only the model class (:class:`~bigtrain.models.dlrm.DLRM`, whose initial values depend
on the seed and each parameter's name) and the data sampler with the trainer. The tables are
plain ``nn.EmbeddingBag`` weights whose dense gradient autograd computes; the sparse optimizers
are written again here on the whole table (rows = the distinct ids of the global batch); the dense
part uses ``torch.nn.utils.clip_grad_norm_`` and the torch optimizer at the reference schedule
(:class:`bigtrain.check.reference.ReferenceRun`'s). No all-to-all, no pieces, no engine.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bigtrain.check.reference import ReferenceRun, _optimizer
from bigtrain.config import Config
from bigtrain.models.dlrm import build_dlrm
from bigtrain.recsys.tables import parse_sizes
from bigtrain.recsys.data import sampler_for


class DlrmReference:
    learning_rate = ReferenceRun.learning_rate  # reads only self.cfg

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model = build_dlrm(cfg, "cpu")
        self.model.init_weights(cfg.train.seed)
        dense = [p for n, p in self.model.named_parameters() if not n.startswith("embeddings.")]
        groups = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
                  {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = _optimizer(groups, cfg.optim)
        self.dense = dense
        self.tables = [t.weight for t in self.model.embeddings.tables]
        self.accumulators = [torch.zeros(w.shape[0]) for w in self.tables]
        self.sampler = sampler_for(cfg, parse_sizes(cfg.embedding.tables))
        self.step = 0

    def train_step(self) -> float:
        g = self.cfg.train.global_batch
        dense, ids, labels = self.sampler.batch(self.step, 0, g)
        logits = self.model(dense, ids)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="mean")
        loss.backward()
        self._sparse_update(ids)
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_(self.dense, max_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def _sparse_update(self, ids: torch.Tensor) -> None:
        e = self.cfg.embedding
        for t, (weight, acc) in enumerate(zip(self.tables, self.accumulators)):
            rows = torch.unique(ids[:, t])
            grad = weight.grad[rows]
            if e.optimizer == "sgd":
                weight[rows] -= e.lr * grad
            else:  # row-wise Adagrad: one accumulator per row, the mean square of its gradient
                acc[rows] += (grad * grad).mean(dim=1)
                weight[rows] -= e.lr * grad / (acc[rows].sqrt() + e.eps).unsqueeze(1)
            weight.grad = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def reference_dlrm(cfg: Config, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    run = DlrmReference(cfg)
    losses = [run.train_step() for _ in range(steps)]
    assert all(math.isfinite(x) for x in losses)
    return losses, run.weights()
