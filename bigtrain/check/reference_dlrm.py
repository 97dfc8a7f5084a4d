"""The independent reference for the DLRM: one process, plain PyTorch.

It shares only the model class (:class:`~bigtrain.models.dlrm.DLRM`, whose initial values depend
on the seed and each parameter's name) and the data sampler with the trainer. The tables are
plain ``nn.EmbeddingBag`` weights whose dense gradient autograd computes; the sparse optimizers
are written again here on the whole table (rows = the distinct ids of the global batch); the dense
part uses ``torch.nn.utils.clip_grad_norm_`` and the torch optimizer at the reference schedule
(:class:`bigtrain.check.reference.ReferenceRun`'s). No all-to-all, no pieces, no engine.

A step returns a :class:`~bigtrain.check.reference.ReferenceStep` like the decoder's reference, so
``bigtrain check`` compares both models in one loop: the loss, the dense gradients' norm, the dense
gradients (the tables have none: their sparse optimizer takes the pooled gradients), every weight (tables
whole), and the outputs of the bottom MLP, the pooled lookup and the top MLP over the global batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bigtrain.check.reference import ReferenceRun, ReferenceStep, reference_optimizer_of
from bigtrain.config import Config
from bigtrain.models.dlrm import build_dlrm
from bigtrain.recsys.data import sampler_for
from bigtrain.recsys.train import DlrmStep
from bigtrain.core.tables import parse_sizes

# Whole-batch outputs any table layout can put back together from its ranks' batch slices.
CAPTURED = ("bottom", "embeddings", "top")


def captured_dlrm_module(name: str) -> bool:
    return name in CAPTURED


class DlrmReference:
    learning_rate = ReferenceRun.learning_rate  # reads only self.cfg

    def __init__(self, cfg: Config, device: torch.device | str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self.model = build_dlrm(cfg, "cpu")
        self.model.init_weights(cfg.train.seed)  # drawn on the CPU whatever the device, as the trainer's
        self.model.to(self.device)
        dense = [p for n, p in self.model.named_parameters() if not n.startswith("embeddings.")]
        groups = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
                  {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = reference_optimizer_of(groups, cfg.optim)
        self.dense = dense
        self.tables = [t.weight for t in self.model.embeddings.tables]
        self.accumulators = [torch.zeros(w.shape[0], device=self.device) for w in self.tables]
        self.sampler = sampler_for(cfg, parse_sizes(cfg.embedding.tables))
        self.step = 0

    def train_step(self, capture: bool = False) -> ReferenceStep:
        g = self.cfg.train.global_batch
        dense, ids, labels = (t.to(self.device) for t in self.sampler.batch(self.step, 0, g))
        outputs: dict[str, torch.Tensor] = {}
        handles = [m.register_forward_hook(lambda mod, args, out, name=name: outputs.update({name: out.detach()}))
                   for name, m in self.model.named_modules() if capture and captured_dlrm_module(name)]
        try:
            logits = self.model(dense, ids)
        finally:
            for h in handles:
                h.remove()
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="mean")
        loss.backward()
        self._sparse_update(ids)
        grads = {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()
                 if p.grad is not None} if capture else {}
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.dense, max_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        result = ReferenceStep(loss=float(loss.detach()), grad_norm=norm, skipped=False, grads=grads)
        if capture:
            result.weights = {n: w.cpu() for n, w in self.weights().items()}
            result.outputs = {n: outputs[n].float().cpu().clone() for n in CAPTURED}
        return result

    @torch.no_grad()
    def _sparse_update(self, ids: torch.Tensor) -> None:
        """From the definitions, on whole tables: SGD ``w[r] -= lr g[r]``; row-wise Adagrad
        ``s[r] += mean_j g[r, j]^2, w[r] -= lr g[r] / (sqrt(s[r]) + eps)``, over the rows the
        global batch looked up. The tables' gradients are cleared: they never reach the norm."""
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
    losses = [run.train_step().loss for _ in range(steps)]
    assert all(math.isfinite(x) for x in losses)
    return losses, run.weights()


# The reference of each family's own step (bigtrain.families' ``own_step`` slot), by its class.
OWN_STEP_REFERENCES = {DlrmStep: (DlrmReference, captured_dlrm_module)}
