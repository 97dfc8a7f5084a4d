"""bigtrain's DLRM against TorchRec's on the same model, over Gloo ranks (CPU).

The issue's setting: 26 tables of 100k x 64, 13 dense features, bottom MLP 512-256-64, top MLP
512-512-256-1, one id per feature, batch 512 per rank, 2 ranks, table-wise sharding, row-wise
Adagrad on the tables (applied in backward on both sides), Adam on the dense part. Both models are
built in the same ranks and stepped in turn (one bigtrain step, one TorchRec step, ...) so load from
other processes hits them alike; the figures are the median milliseconds per step after
``--warmup`` steps, each timed from a barrier to a barrier (the slowest rank's step), and
samples/s = ranks x batch / median. ``--sharding row`` runs bigtrain
alone (TorchRec's CPU sharder has no row-wise: torchrec #1252).

TorchRec is an optional extra, installed without touching torch:
    pip install fbgemm-gpu-cpu==1.8.0 && pip install --no-deps torchrec tensordict torchmetrics==1.0.3 \\
        lightning-utilities pyre-extensions typing-inspect mypy_extensions iopath portalocker pyvers \\
        cloudpickle orjson
or, leaving a shared venv as it is, all of them with ``pip install --target .extra --no-deps ...`` and
``PYTHONPATH=.:.extra`` (torchrec==1.9.2 was measured). Without it the script measures bigtrain
alone and says so.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dlrm.py                    # table-wise, both
    PYTHONPATH=. .venv/bin/python benchmarks/bench_dlrm.py --sharding row     # bigtrain alone
    PYTHONPATH=. .venv/bin/python benchmarks/bench_dlrm.py --phases           # + forward / backward / step
    PYTHONPATH=. .venv/bin/python benchmarks/bench_dlrm.py --steps 4 --warmup 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from bigtrain.config import load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.dlrm import bce_loss_sum
from bigtrain.recsys.train import DlrmStep
from bigtrain.testing import run_ranks

TABLES, ROWS, DIM, DENSE = 26, 100_000, 64, 13
BOTTOM, TOP = [512, 256], [512, 512, 256]


def have_torchrec() -> bool:
    try:
        import torchrec  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present but not loadable on this torch
        return False
    return True


def bigtrain_trainer(rank: int, world: int, batch: int, sharding: str, steps: int) -> DlrmStep:
    cfg = load_config(preset="dlrm-tiny", overrides=[
        f"--parallel.dp={world}", f"--embedding.tables={TABLES}x{ROWS}", f"--embedding.dim={DIM}",
        "--embedding.hotness=1", f"--embedding.sharding={sharding}", "--embedding.optimizer=rowwise_adagrad",
        f"--model.dlrm_bottom_mlp={','.join(map(str, BOTTOM))}", f"--model.dlrm_top_mlp={','.join(map(str, TOP))}",
        f"--train.global_batch={batch * world}", f"--train.steps={steps}", "--optim.grad_clip=0",
        "--optim.weight_decay=0"])
    return DlrmStep(cfg, Mesh.from_config(cfg.parallel, rank, world))  # the step the Trainer takes


class TorchRecDLRM:
    """TorchRec's DLRM under DistributedModelParallel, table-wise, fused row-wise Adagrad in backward."""

    def __init__(self, rank: int, world: int, batch: int):
        import torch.distributed as dist
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.models.dlrm import DLRM, DLRMTrain
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        self.batch, self.rank, self.world = batch, rank, world
        self.keys = [f"f{t}" for t in range(TABLES)]
        tables = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[k])
                  for t, k in enumerate(self.keys)]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE,
                               dense_arch_layer_sizes=[*BOTTOM, DIM], over_arch_layer_sizes=[*TOP, 1],
                               dense_device=torch.device("cpu")))
        apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
        constraints = {f"t{t}": ParameterConstraints(sharding_types=["table_wise"]) for t in range(TABLES)}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                           constraints=constraints)
        sharders = [EmbeddingBagCollectionSharder()]
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
        self.model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
        dense = [p for n, p in self.model.named_parameters() if "sparse_arch" not in n]
        self.optimizer = torch.optim.Adam(dense, lr=1e-3)

    def batch_of(self, dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor):
        from torchrec import KeyedJaggedTensor
        from torchrec.datasets.utils import Batch

        values = ids[:, :, 0].t().reshape(-1)  # key-major, one id per sample and key
        kjt = KeyedJaggedTensor.from_lengths_sync(self.keys, values, torch.ones(values.numel(), dtype=torch.int32))
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)

    def step(self, batch) -> None:
        loss, _ = self.model(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def bigtrain_phases(trainer: DlrmStep, batch) -> dict[str, float]:
    """One step of ``trainer`` as its train_step runs it, each phase timed on this rank."""
    dense, ids, labels = batch
    marks = [time.perf_counter()]
    loss_sum = bce_loss_sum(trainer.model(dense, ids), labels)
    marks.append(time.perf_counter())
    trainer.engine.backward(loss_sum / trainer.cfg.train.global_batch)
    trainer.engine.finish_grad_sync()
    marks.append(time.perf_counter())
    trainer.engine.step(1e-3, float("inf"))
    trainer.parallel.embeddings.finish_update(apply=True)  # the tables' sparse update
    trainer.engine.zero_grad()
    marks.append(time.perf_counter())
    return dict(zip(("forward", "backward", "step"), (b - a for a, b in zip(marks, marks[1:]))))


def torchrec_phases(theirs: "TorchRecDLRM", batch) -> dict[str, float]:
    marks = [time.perf_counter()]
    loss, _ = theirs.model(batch)
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    theirs.optimizer.step()
    theirs.optimizer.zero_grad()
    marks.append(time.perf_counter())
    return dict(zip(("forward", "backward", "step"), (b - a for a, b in zip(marks, marks[1:]))))


def bench(rank: int, world: int, batch: int, sharding: str, steps: int, warmup: int, with_torchrec: bool,
          phases: bool = False) -> dict:
    torch.manual_seed(0)
    ours = bigtrain_trainer(rank, world, batch, sharding, steps + warmup)
    theirs = TorchRecDLRM(rank, world, batch) if with_torchrec else None
    times: dict[str, list[float]] = {}

    def timed(name: str, step_fn) -> None:  # from a common start to the last rank's end
        dist.barrier()
        start = time.perf_counter()
        parts = step_fn()
        dist.barrier()
        times.setdefault(name, []).append(time.perf_counter() - start)
        for part, seconds in (parts or {}).items():
            times.setdefault(f"{name}_{part}", []).append(seconds)

    for step in range(steps + warmup):  # the batches are drawn outside the timed steps
        ours_batch = ours.local_batch_of(step)
        timed("bigtrain", (lambda: bigtrain_phases(ours, ours_batch)) if phases else
              (lambda: ours.train_step(step, 1e-3, batch=ours_batch) and None))
        if theirs is not None:
            torchrec_batch = theirs.batch_of(*ours_batch)
            timed("torchrec", (lambda: torchrec_phases(theirs, torchrec_batch)) if phases else
                  (lambda: theirs.step(torchrec_batch)))
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512, help="samples per rank")
    parser.add_argument("--sharding", default="table", choices=("table", "row", "column", "data"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--phases", action="store_true",
                        help="also time forward, backward and the step (the dense update and the tables' sparse one), per rank")
    args = parser.parse_args()
    with_torchrec = args.sharding == "table" and have_torchrec()
    if args.sharding == "table" and not with_torchrec:
        print("torchrec is not installed (or does not load): measuring bigtrain alone")
    per_rank = run_ranks(bench, args.ranks, args.batch, args.sharding, args.steps, args.warmup, with_torchrec,
                         args.phases, timeout=3600)
    result = {"ranks": args.ranks, "batch_per_rank": args.batch, "sharding": args.sharding}
    for name in [n for n in per_rank[0] if "_" in n]:  # phases: the slowest rank's median, ms
        result[f"{name}_ms"] = round(max(r[name] for r in per_rank) * 1e3, 1)
    for name in [n for n in per_rank[0] if "_" not in n]:
        seconds = max(r[name] for r in per_rank)  # the slowest rank sets the pace
        result[f"{name}_ms_per_step"] = round(seconds * 1e3, 1)
        result[f"{name}_samples_per_s"] = round(args.ranks * args.batch / seconds)
    if "torchrec_samples_per_s" in result:
        result["ratio_bigtrain_over_torchrec"] = round(result["bigtrain_samples_per_s"]
                                                       / result["torchrec_samples_per_s"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
