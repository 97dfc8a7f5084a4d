"""A family that takes no tokens: a regression MLP of float features, trained by a step of its own
(``Family.own_step``) and checked by a reference of its own (``Family.reference``).

    cd examples/own_family
    bigtrain train --config regression.toml          # dp 2 x ZeRO-3 through bigtrain's launcher
    bigtrain check --config regression.toml          # each step against the plain loop below

The Trainer's own step trains decoders on token batches; a model of other inputs brings its step
(docs/families.md, "A step of your own"). bigtrain gives it the rest of the run: the launcher, the
run directory, checkpoints (resharded on resume), the NaN policy, the learning-rate schedule,
metrics. The step builds the model through ``parallelize`` (dp with ZeRO 0-3, the precision, the
optimizer of the config), draws its data and computes its loss; ``bigtrain check`` compares it with
:class:`RegressionReference`, which shares with it only the model class, the initial values and the
data (torch's AdamW, ``clip_grad_norm_``).

The data: a fixed synthetic task, y = sin(sum of the features / sqrt(FEATURES)), the same global
batch of a step on every layout (drawn from the step's index), each dp rank its slice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bigtrain.core.reference_step import ReferenceStep, reference_learning_rate
from bigtrain.families import Family, register_family
from bigtrain.families.own import seeded_init
from bigtrain.from_config import parallel_plan
from bigtrain.parallel.build import parallelize

FEATURES = 10
HELD_OUT = 1_000_000  # the held-out batches' indices: far from any step's


class Regressor(nn.Module):
    """(batch, FEATURES) -> (batch,): model.n_layers GELU layers of model.dim, then one output."""

    def __init__(self, features: int, hidden: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(features if i == 0 else hidden, hidden), nn.GELU())
                                    for i in range(layers))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)


def build(cfg, device: str = "meta") -> Regressor:
    with torch.device(device):
        return Regressor(FEATURES, cfg.model.dim, cfg.model.n_layers)


def batch(cfg, index: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [start, start + count) of global batch ``index``: (features, targets)."""
    gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + index)
    x = torch.randn(cfg.train.global_batch, FEATURES, generator=gen)
    return x[start:start + count], torch.sin(x.sum(-1) / math.sqrt(FEATURES))[start:start + count]


class RegressionStep:
    """What the Trainer takes as the family's step: ``parallel``, ``model``, ``engine`` (from
    ``parallelize``), ``sampler``, ``per_step`` and ``unit`` (what the throughput counts),
    ``train_step``, ``evaluate`` and ``summary``."""

    unit = "samples"

    def __init__(self, cfg, mesh, device="cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self.dp = mesh.comm("dp")
        model = build(cfg)
        # (seed, name) draws, the same on every rank and in the reference (a per-process hash() is not)
        self.init_fn = seeded_init(cfg, model)
        self.parallel = parallelize(model, mesh, parallel_plan(cfg), self.device, init_fn=self.init_fn)
        self.model, self.engine = self.parallel.model, self.parallel.engine
        self.sampler = None  # no token corpus: batch() draws the data
        self.per_step = cfg.train.global_batch
        self.local = cfg.train.global_batch // self.dp.size

    def _local(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(self.cfg, index, self.dp.rank * self.local, self.local)
        return x.to(self.device), y.to(self.device)

    def train_step(self, step: int, lr: float, before_update=None) -> tuple[float, float, bool]:
        """(the mean loss over the global batch, the gradient norm, skipped). The summed squared
        error divided by the global batch: summed over the dp ranks, the mean."""
        x, y = self._local(step)
        loss_sum = ((self.model(x).float() - y) ** 2).sum()
        self.engine.backward(loss_sum / self.cfg.train.global_batch)
        self.engine.finish_grad_sync()
        if before_update is not None:  # bigtrain check reads the reduced gradients here
            before_update()
        total = loss_sum.detach().clone()
        self.dp.all_reduce(total, tag="metrics")
        veto = (~torch.isfinite(total)).float()  # the NaN policy: a non-finite loss skips the step everywhere
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        norm, skipped = self.engine.step(lr, clip, skip=veto)
        self.engine.zero_grad()
        return float(total) / self.cfg.train.global_batch, norm, skipped

    @torch.no_grad()
    def evaluate(self, batches: int = 2) -> dict[str, float]:
        """The mean squared error on held-out batches (every rank the same)."""
        total = torch.zeros((), device=self.device)
        for i in range(batches):
            x, y = self._local(HELD_OUT + i)
            total += ((self.model(x).float() - y) ** 2).sum()
        self.dp.all_reduce(total, tag="metrics")
        return {"held_out_mse": float(total) / (batches * self.cfg.train.global_batch)}

    def summary(self) -> dict:
        return {"params": sum(p.numel() for p in build(self.cfg).parameters())}


class RegressionReference:
    """One process, plain PyTorch: the whole global batch, the mean squared error, clip_grad_norm_,
    torch.optim.AdamW with decay on matrices (as the engine decays them) at the schedule's rate."""

    def __init__(self, cfg, device="cpu"):
        self.cfg, self.device, self.step = cfg, torch.device(device), 0
        self.model = build(cfg, "cpu")
        init = seeded_init(cfg, self.model)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(init(name, tuple(p.shape)))
        self.model.to(self.device)
        o, params = cfg.optim, list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)

    @staticmethod
    def problems(cfg) -> list[str]:
        """What this reference does not state (bigtrain check refuses it before launch)."""
        out = []
        if cfg.optim.name != "adamw":
            out.append(f"optim.name = '{cfg.optim.name}': the regression reference steps torch's AdamW only")
        if cfg.precision.mode != "fp32":
            out.append(f"precision.mode = '{cfg.precision.mode}': the regression reference computes in fp32 only")
        return out

    def learning_rate(self, step: int) -> float:
        return reference_learning_rate(self.cfg, step)

    def train_step(self, capture: bool = False) -> ReferenceStep:
        x, y = (t.to(self.device) for t in batch(self.cfg, self.step, 0, self.cfg.train.global_batch))
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        grads = {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()} if capture else {}
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        result = ReferenceStep(loss=float(loss.detach()), grad_norm=norm, skipped=False, grads=grads)
        if capture:
            result.weights = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        return result


register_family(Family(name="regression", summary="a regression MLP of float features (examples/own_family)",
                       own_step=RegressionStep, reads_tokens=False, reference=RegressionReference))
