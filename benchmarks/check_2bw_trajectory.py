"""A long 2BW run against the one-process delayed-gradient reference, and the reference without delay.

Tells apart the update rule's own learning curve from an implementation error: the 2BW trainer
(pp = 2, the ``small`` preset) must follow ``ReferenceRun(cfg, gradient_delay=1)`` step for step;
the synchronous reference shows what the one-step delay costs.

    PYTHONPATH=. .venv/bin/python benchmarks/check_2bw_trajectory.py --steps 60
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (before bigtrain: this checkout's)

import torch  # noqa: E402

from bigtrain.check.reference import ReferenceRun  # noqa: E402
from bigtrain.config import load_config  # noqa: E402
from bigtrain.distributed.mesh import Mesh  # noqa: E402
from bigtrain.testing import run_ranks  # noqa: E402
from bigtrain.train import Trainer  # noqa: E402
from bigtrain.validation import validate  # noqa: E402


def _losses(rank, world_size, cfg, run_dir, steps):
    trainer = Trainer(cfg, run_dir, Mesh.from_config(cfg.parallel, rank, world_size))
    return [trainer.train_step().loss for _ in range(steps)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--preset", default="small")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(preset=args.preset, overrides=[
        "--logging.progress=false", "--checkpoint.save_final=false", "--parallel.pp=2", "--train.micro_batch=4",
        "--parallel.pp_schedule=pipedream-2bw"])
    validate(cfg)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = run_ranks(_losses, 2, cfg, run_dir, args.steps, timeout=3600)[0]
    delayed, plain = ReferenceRun(cfg, gradient_delay=1), ReferenceRun(cfg, gradient_delay=0)
    reference = [delayed.train_step().loss for _ in range(args.steps)]
    synchronous = [plain.train_step().loss for _ in range(args.steps)]
    print("step  2bw trainer  delayed reference  synchronous reference")
    for step in range(0, args.steps, 5):
        print(f"{step:4d}  {trainer[step]:11.5f}  {reference[step]:17.5f}  {synchronous[step]:21.5f}")
    first = next((s for s, (a, b) in enumerate(zip(trainer, reference)) if abs(a - b) > 1e-5 * abs(b)), None)
    worst = max(abs(a - b) / abs(b) for a, b in zip(trainer, reference))
    print(f"trainer vs delayed reference: within 1e-5 up to step {first if first is not None else args.steps}, "
          f"largest relative difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
