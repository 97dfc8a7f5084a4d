"""Train your own nn.Module from Python with a plan object: no Config, no model family.

    torchrun --standalone --nproc-per-node=2 examples/parallelize_custom_module.py   # dp 2, ZeRO-3
    python examples/parallelize_custom_module.py                                    # one rank

The model is plain PyTorch, built on the meta device: a classifier over sequences of feature
vectors, with sinusoidal position features (a buffer its constructor computes: on the meta device it
holds nothing yet) and a stack of residual MLP blocks. ``parallelize(model, mesh, plan, init_fn=...)``
materializes only this rank's shards (ZeRO-3: each block a unit, gathered just before it runs and
freed after), recomputes each block in backward (``ActivationPlan(policy="full", blocks=...)``:
the plan names the blocks, whatever the model calls them), and gives every parameter and buffer its
full initial value from ``init_fn`` by name (the model needs no method of a special name). The
training loop is yours: forward through ``parallel.model``, ``engine.backward``, ``engine.step``.
The losses and final weights equal a plain one-process loop on the same model and batches
(``reference``: ``torch.optim.AdamW``, ``clip_grad_norm_``) within fp32 1e-5 (``tests/test_examples.py``).
"""

from __future__ import annotations

import argparse
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config import OptimConfig
from bigtrain.distributed.launch import init_distributed, shutdown_distributed
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.build import parallelize
from bigtrain.parallel.parallel_plan import ActivationPlan, EnginePlan, ParallelPlan

FEATURES, DIM, HIDDEN, BLOCKS, SEQ, CLASSES = 12, 32, 64, 3, 8, 4
BATCH = 16  # the global batch: each of the dp ranks takes BATCH / dp of its rows
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0)


def positions(seq: int, dim: int) -> torch.Tensor:
    """Sinusoidal position features [seq, dim] (computed, not learned)."""
    position = torch.arange(seq, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
    return torch.cat([torch.sin(position * frequency), torch.cos(position * frequency)], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class SequenceClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM)
        self.register_buffer("positions", positions(SEQ, DIM), persistent=False)
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, SEQ, FEATURES] -> logits [B, CLASSES]
        h = self.embed(x) + self.positions
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


def init_fn(name: str, shape: tuple) -> torch.Tensor:
    """The full fp32 value of parameter or buffer ``name``: it depends on the name only, so every
    layout (and the reference) starts alike."""
    if name == "positions":
        return positions(SEQ, DIM)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # a LayerNorm's gain
        return torch.ones(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) / shape[1] ** 0.5


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: features and the class a fixed linear teacher gives their mean."""
    x = torch.randn(BATCH, SEQ, FEATURES, generator=torch.Generator().manual_seed(1000 + step))
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7))
    return x, (x.mean(dim=1) @ teacher).argmax(dim=-1)


def plan(zero: int = 3) -> ParallelPlan:
    return ParallelPlan(optim=OPTIM, engine=EnginePlan(zero=zero),
                        activations=ActivationPlan(policy="full", blocks=lambda model: model.blocks))


def train(rank: int, world_size: int, steps: int = 20, zero: int = 3, log=print) -> tuple[list[float], dict]:
    """``steps`` steps on ``world_size`` data-parallel ranks; (the global losses, the full weights)."""
    mesh = Mesh({"dp": world_size}, rank)
    with torch.device("meta"):
        model = SequenceClassifier()
    parallel = parallelize(model, mesh, plan(zero), init_fn=init_fn)
    dp, engine = mesh.comm("dp"), parallel.engine
    losses = []
    for step in range(steps):
        x, y = (t.chunk(dp.size)[dp.rank] for t in batch(step))  # this replica's rows
        loss_sum = F.cross_entropy(parallel.model(x), y, reduction="sum")
        engine.backward(loss_sum / BATCH)  # normalized by the GLOBAL count: the ranks' gradients are summed
        parallel.finish_grad_sync()
        engine.step(OPTIM.lr, OPTIM.grad_clip)
        engine.zero_grad()
        total = loss_sum.detach() / BATCH
        dp.all_reduce(total, tag="metrics")
        losses.append(float(total))
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            log(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses, parallel.full_weights()  # collective: every rank calls it


def reference(steps: int = 20) -> tuple[list[float], dict]:
    """The same model, batches and optimizer in one process, plain PyTorch (no bigtrain)."""
    model = SequenceClassifier()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_fn(name, tuple(p.shape)))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM.weight_decay},
                                   {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y, reduction="sum") / BATCH
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    info = init_distributed("cpu")
    train(info.rank, info.world_size, args.steps, log=lambda s: print(s, flush=True))
    shutdown_distributed()
