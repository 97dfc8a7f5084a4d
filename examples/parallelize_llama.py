"""Parallelize a Llama you built yourself, without a bigtrain Config, and train it with your own loop.

    torchrun --standalone --nproc-per-node=4 examples/parallelize_llama.py   # dp 2 x tp 2, ZeRO-1
    python examples/parallelize_llama.py                                    # one rank

The model is plain PyTorch built on the meta device; ``parallelize(model, mesh, plan)`` applies
the steps the plan names (tensor + sequence parallel over tp, ZeRO over dp) and materializes only
this rank's part. Each step is also a public function (``apply_tensor_parallel``,
``build_pipeline``, ``apply_zero``...) taking its own part of the plan. The losses equal a plain
one-process loop on the same model and batches (``reference``; ``tests/test_examples.py`` checks it).
"""

import argparse

import torch

from bigtrain.config import ModelConfig, OptimConfig
from bigtrain.distributed.launch import init_distributed, shutdown_distributed
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import Llama
from bigtrain.optim import build_adamw
from bigtrain.parallel.build import parallelize, token_loss_sum
from bigtrain.parallel.parallel_plan import EnginePlan, ParallelPlan, TensorParallelPlan
from bigtrain.precision import Precision

MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=256)
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0)
BATCH, SEQ, SEED = 8, 32, 0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens and next-token targets of a synthetic copy task."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=gen)
    tokens[:, SEQ // 2 + 1:] = tokens[:, 1:SEQ // 2 + 1]  # the second half repeats the first: learnable
    return tokens[:, :-1], tokens[:, 1:]


def train(rank: int, world_size: int, steps: int = 20, tp: int = 2, log=print) -> list[float]:
    """``steps`` steps on ``world_size`` ranks (dp = world_size / tp); returns the global losses."""
    tp = min(tp, world_size)
    mesh = Mesh({"dp": world_size // tp, "tp": tp}, rank)
    with torch.device("meta"):
        model = Llama(MODEL)
    plan = ParallelPlan(optim=OPTIM, tensor=TensorParallelPlan(sequence_parallel=True),
                        engine=EnginePlan(zero=1, precision=Precision(torch.float32, torch.float32)), seed=SEED)
    parallel = parallelize(model, mesh, plan)
    dp = mesh.comm("dp")
    losses = []
    for step in range(steps):
        tokens, targets = (t.chunk(dp.size)[dp.rank] for t in batch(step))  # this replica's rows
        loss_sum = parallel.forward_loss(tokens, targets)
        parallel.engine.backward(loss_sum / (BATCH * SEQ))  # normalized by the GLOBAL count: grads are summed
        parallel.finish_grad_sync()
        parallel.engine.step(OPTIM.lr, OPTIM.grad_clip)
        parallel.engine.zero_grad()
        total = loss_sum.detach() / (BATCH * SEQ)
        dp.all_reduce(total, tag="metrics")  # every tp rank of a replica computed the same loss sum
        losses.append(float(total))
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            log(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


def reference(steps: int = 20) -> list[float]:
    """The same model, batches and optimizer in one process, plain PyTorch."""
    model = Llama(MODEL)
    model.init_weights(SEED)
    optimizer = build_adamw(model, OPTIM, OPTIM.lr)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        loss = token_loss_sum(model(tokens), targets) / (BATCH * SEQ)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    info = init_distributed("cpu")
    train(info.rank, info.world_size, args.steps, log=lambda s: print(s, flush=True))
    shutdown_distributed()
