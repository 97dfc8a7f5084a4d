"""How much a one-step-stale gradient costs the `small` preset, under several optimizer settings
(issue 17: PipeDream-2BW's rule, W(t+1) = W(t) - lr * g(W(t-1))).

Each setting trains the one-process reference twice for ``--steps`` steps, without and with the
delay (``ReferenceRun(cfg, gradient_delay=0 | 1)``: plain PyTorch, the trainer is not involved),
and prints the mean loss of the last 10 steps of each. The 2BW trainer follows the delayed
reference step for step (``check_2bw_trajectory.py``), so what this prints is the rule's own cost.

    PYTHONPATH=. .venv/bin/python benchmarks/delay_sensitivity.py --steps 80
"""

from __future__ import annotations

import argparse
import statistics
import sys

import common  # noqa: F401 - puts this checkout first on sys.path
import torch

from bigtrain.check.reference import ReferenceRun
from bigtrain.config import load_config

SETTINGS = {
    "preset (lr 3e-3, betas 0.9 / 0.95, warm-up 30)": [],
    "lr 1e-3": ["--optim.lr=1e-3"],
    "beta1 0.5": ["--optim.beta1=0.5"],
    "betas 0.8 / 0.99": ["--optim.beta1=0.8", "--optim.beta2=0.99"],
    "betas 0.5 / 0.8": ["--optim.beta1=0.5", "--optim.beta2=0.8"],
    "warm-up 100": ["--optim.warmup_steps=100"],
}


def tail_loss(overrides: list[str], steps: int, delay: int) -> float:
    cfg = load_config(preset="small", overrides=["--logging.progress=false", f"--train.steps={steps}", *overrides])
    run = ReferenceRun(cfg, gradient_delay=delay)
    losses = [run.train_step().loss for _ in range(steps)]
    return statistics.fmean(losses[-10:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--only", nargs="*", help="settings to run (their names, as listed)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"small preset, {args.steps} steps; mean loss of the last 10 steps")
    print(f"{'setting':>48} {'no delay':>9} {'delay 1':>9} {'gap':>7}")
    for name, overrides in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        plain, stale = (tail_loss(overrides, args.steps, d) for d in (0, 1))
        print(f"{name:>48} {plain:9.4f} {stale:9.4f} {stale / plain - 1:+7.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
