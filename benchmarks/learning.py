"""Learning-curve runs shared by the quality benchmarks: a preset trained through the CLI exactly as
a user types it, every step logged, one run after another (never in parallel: they share the
machine's cores), and the figures they are compared by.

A run whose directory already holds all its steps is read, not re-run (unless ``rerun``): the
comparisons can be re-drawn, or extended by one setting, without training everything again.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import common

ROOT = common.ROOT


def train_command(overrides: list[str], steps: int, out_dir: str, preset: str = "small") -> list[str]:
    return [sys.executable, "-m", "bigtrain", "train", "--preset", preset, *overrides, f"--train.steps={steps}",
            "--logging.log_every=1", "--logging.report=false", "--logging.measure_memory=false",
            "--output-dir", out_dir, "--overwrite"]


def read_losses(run_dir: str) -> list[float]:
    """The training loss of every logged step, in step order ([] if the run has not started)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"]) if "loss" in r]


def train(label: str, overrides: list[str], steps: int, out: str, threads: int = 1, tail: int = 20,
          preset: str = "small", rerun: bool = False) -> dict:
    """Train (or read) run ``label`` under ``out``; its losses, last-step loss and the mean of the
    last ``tail`` steps (one step's loss is one batch's: noisy)."""
    run_dir = os.path.join(out, label)
    cmd = train_command(overrides, steps, run_dir, preset)
    shown = " ".join(["PYTHONPATH=.", ".venv/bin/python"] + cmd[1:])
    losses = read_losses(run_dir)
    wall = None
    if rerun or len(losses) != steps:
        print(f"== {label}: {shown}", flush=True)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=str(threads))
        start = time.perf_counter()
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{label}.log"), "w") as log:
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        wall = time.perf_counter() - start
        losses = read_losses(run_dir)
    return {"label": label, "overrides": overrides, "command": shown, "wall_s": wall, "losses": losses,
            "final_loss": losses[-1], "tail_mean_loss": statistics.fmean(losses[-tail:])}


def add_arguments(p, out: str, labels: list[str], plot: str, smooth: int) -> None:
    """The command-line options every quality benchmark takes."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=out, help="run directories (one per label) and their logs")
    p.add_argument("--only", nargs="*", help=f"labels to run or read (of {', '.join(labels)})")
    p.add_argument("--tail", type=int, default=20, help="steps whose mean loss is the figure compared")
    p.add_argument("--rerun", action="store_true", help="run again even where a run directory is complete")
    p.add_argument("--plot", default=plot, help="'' for no plot")
    p.add_argument("--smooth", type=int, default=smooth, help="moving-average window of the plotted curves")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of each run (1: on a shared machine, two threads per run stall each other)")
    p.add_argument("--json", help="also write every number here")


def save_figure(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out
