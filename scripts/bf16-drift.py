"""How far two correct bf16 runs drift apart: the yardstick for what bf16 parity can prove.

One process, the independent reference loop (bigtrain/check/reference.py), the same model, seed and
data, trained twice in bf16: once with the global batch in one micro-batch (accumulation 1), once in
two (accumulation 2). Both are correct; they differ only in the order bf16 products are summed, so
their loss difference per step is what bf16 rounding alone does to a run over time. The fp32 pair is
printed beside it as the floor. docs/correctness.md quotes this table.

Usage: PYTHONPATH=. python scripts/bf16-drift.py [--steps 40] [--preset tiny] [--lr 3e-3]
"""

from __future__ import annotations

import argparse

import torch

from bigtrain.check.reference import ReferenceRun
from bigtrain.config import load_config


def losses(preset: str, steps: int, mode: str, micro: int, lr: float, seed: int) -> list[float]:
    cfg = load_config(preset, overrides=[f"--train.steps={steps}", f"--precision.mode={mode}",
                                         f"--train.micro_batch={micro}", f"--optim.lr={lr}",
                                         f"--train.seed={seed}"])
    run = ReferenceRun(cfg)
    return [run.train_step().loss for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="train seeds; each step's column is the largest difference over them")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = load_config(args.preset).train.global_batch
    rel = {}
    for mode in ("fp32", "bf16"):
        per_seed = []
        for seed in args.seeds:
            one = losses(args.preset, args.steps, mode, batch, args.lr, seed)
            two = losses(args.preset, args.steps, mode, batch // 2, args.lr, seed)
            per_seed.append([abs(a - b) / abs(a) for a, b in zip(one, two)])
        rel[mode] = [max(column) for column in zip(*per_seed)]
    print(f"{args.preset}, lr {args.lr}, seeds {args.seeds}: relative loss difference, largest over the seeds")
    print("| step | fp32 accum 1 vs 2 | bf16 accum 1 vs 2 | bf16 max so far |")
    print("|---|---|---|---|")
    worst = 0.0
    for step in range(args.steps):
        worst = max(worst, rel["bf16"][step])
        if step < 5 or step % 5 == 4:
            print(f"| {step + 1} | {rel['fp32'][step]:.1e} | {rel['bf16'][step]:.1e} | {worst:.1e} |")
    first = next((s + 1 for s, r in enumerate(rel["bf16"]) if r > 1e-3), None)
    print(f"\nfirst step whose bf16 pair differs by more than 1e-3: {first or 'none within ' + str(args.steps)}")


if __name__ == "__main__":
    main()
