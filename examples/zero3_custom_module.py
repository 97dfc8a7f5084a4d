"""ZeRO-3 on your own module: a plain residual MLP, sharded block by block over the ranks.

    torchrun --standalone --nproc-per-node=2 examples/zero3_custom_module.py
    python examples/zero3_custom_module.py          # one rank: the same engine, nothing to shard

The model is built on the meta device (no memory), then ZeroEngine allocates and initializes only
this rank's shard of every parameter, all-gathers each block just before it runs and frees it
after, and reduce-scatters its gradients while backward goes on. Each block is a unit; whatever
is left over (here the head) forms the root unit.
"""

import argparse
import zlib

import torch
from torch import nn

from bigtrain.config import OptimConfig
from bigtrain.distributed.launch import init_distributed, shutdown_distributed
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.zero import ZeroEngine
from bigtrain.precision import Precision


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, n_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).squeeze(-1)


def init_fn(name: str, shape: tuple) -> torch.Tensor:
    """The full fp32 value of parameter ``name``: depends on the name only, so every layout agrees."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # LayerNorm gain
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) / shape[1] ** 0.5


def batch(step: int, rank: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression: y = sum(sin(x W)) for a fixed W, fresh x for every (step, rank)."""
    teacher = torch.randn(dim, 4, generator=torch.Generator().manual_seed(1234)) / dim ** 0.5
    x = torch.randn(size, dim, generator=torch.Generator().manual_seed(step * 1000 + rank))
    return x, torch.sin(x @ teacher).sum(-1)


def train(rank: int, world_size: int, steps: int = 60, dim: int = 64, blocks: int = 4, size: int = 128,
          lr: float = 2e-3, log=print) -> list[float]:
    """Train on ``world_size`` ranks (torch.distributed already up when > 1); returns the global losses."""
    mesh = Mesh({"dp": world_size}, rank)
    with torch.device("meta"):
        model = ResidualMLP(dim, 4 * dim, blocks)
    n_params = sum(p.numel() for p in model.parameters())
    engine = ZeroEngine(model, mesh.comm("dp"), stage=3, precision=Precision(torch.float32, torch.float32),
                        optim=OptimConfig(lr=lr, weight_decay=0.0), init_fn=init_fn, device="cpu",
                        unit_modules=list(model.blocks))
    losses = []
    for step in range(steps):
        x, y = batch(step, rank, size, dim)
        loss_sum = (model(x) - y).pow(2).sum()
        engine.backward(loss_sum / (size * world_size))  # normalize by the GLOBAL count: grads are summed
        engine.finish_grad_sync()
        engine.step(lr, max_norm=1.0)
        engine.zero_grad()
        total = loss_sum.detach() / (size * world_size)
        mesh.comm("dp").all_reduce(total, tag="metrics")
        losses.append(float(total))
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            log(f"step {step:3d}  loss {losses[-1]:.4f}")
    state = torch.zeros(world_size, 3, dtype=torch.float64)  # each rank fills its row; rank 0 prints
    state[rank] = torch.tensor([engine.state_bytes()[k] for k in ("params", "grads", "optimizer")])
    mesh.comm("dp").all_reduce(state, tag="metrics")
    for r, (p, g, o) in enumerate(state.tolist() if rank == 0 else []):
        log(f"rank {r}: params {p:.0f} B, grads {g:.0f} B, optimizer {o:.0f} B "
            f"(unsharded fp32 params alone: {4 * n_params} B)")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    info = init_distributed("cpu")
    train(info.rank, info.world_size, args.steps, log=lambda s: print(s, flush=True))
    shutdown_distributed()
