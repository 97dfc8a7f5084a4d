"""Saved activations of the real trainer with and without compiled blocks, against the planner.

For each activation option (none, full, every 2, selective, int8, int8 + selective, the fused loss)
in fp32 and bf16, the ``tiny`` preset at one rank and micro-batch 2 trains one step eagerly and one
with ``compile.enabled = true``, then counts what autograd saves over one more step's forward
(``SavedActivations``: saved-tensor hooks, which see what a compiled graph saves too) and prints it
next to the planner's figure for the eager and the compiled layout (plan/activations.py). The
compiled list of docs/planner.md was read off this (14 of 14 equal, 2026-11-27, torch 2.13 CPU).
``--parallel``: compiled layouts over two forked ranks instead (tp 2, tp 2 with Megatron SP and
ZeRO-1, Ulysses 2), where the tensor-parallel collectives break the compiled graph; the worst
rank's saved bytes against the planner's.

    PYTHONPATH=. .venv/bin/python benchmarks/measure_compiled_activations.py   (~15 minutes, cold compiles)
    PYTHONPATH=. .venv/bin/python benchmarks/measure_compiled_activations.py --parallel   (~3 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401 - puts this checkout first on the path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bigtrain.memory.accounting import SavedActivations  # noqa: E402
from bigtrain.plan import PRESETS, Layout, ModelSpec, estimate_memory  # noqa: E402
from bigtrain.testing import run_ranks  # noqa: E402
from helpers import tiny_config, trainer_on_rank  # noqa: E402

OPTIONS = {"none": {}, "full": dict(recompute="full"), "every": dict(recompute="every"),
           "selective": dict(recompute="selective"), "int8": dict(compression="int8"),
           "int8-selective": dict(recompute="selective", compression="int8"), "fused_loss": dict(fused_loss=True)}


def saved_bytes(trainer) -> int:
    """The most bytes autograd holds for backward over one step's micro-batches."""
    tracker = SavedActivations(trainer.model)
    batches = trainer.sampler.micro_batches(trainer.step, trainer.mesh.coord("dp"), trainer.mesh.size("dp"),
                                            trainer.cfg.train.micro_batch)
    for i, (tokens, targets) in enumerate(batches):
        trainer._forward_backward(tokens, targets, sync=i == trainer.accum - 1, tracker=tracker)
    trainer.engine.finish_grad_sync()
    trainer.engine.zero_grad()
    return tracker.peak


PARALLEL = [Layout(tp=2, precision="bf16", micro_batch=2, compiled=True),
            Layout(tp=2, tp_sp=True, zero=1, precision="fp32", micro_batch=2, compiled=True),
            Layout(sp=2, precision="bf16", micro_batch=2, compiled=True)]


def _on_rank(rank: int, world_size: int, tokens: str, tmp: str) -> list[int]:
    out = []
    for layout in PARALLEL:
        trainer = trainer_on_rank(rank, world_size, tiny_config(tmp, f"--data.source={tokens}", *layout.to_overrides()),
                                  tmp)
        trainer.train_step()
        out.append(saved_bytes(trainer))
    return out


def parallel(tokens: str, tmp: str) -> int:
    measured = [max(per_rank) for per_rank in zip(*run_ranks(_on_rank, 2, tokens, tmp, timeout=1800))]
    cfg = tiny_config(tmp, f"--data.source={tokens}")
    spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    worst = 0.0
    for layout, saved in zip(PARALLEL, measured):
        compiled, eager = (estimate_memory(spec, dataclasses.replace(layout, compiled=c), PRESETS["cpu"],
                                           cfg.train.global_batch).activations for c in (True, False))
        worst = max(worst, abs(compiled - saved) / saved)
        print(f"{layout.describe():70s} measured {saved:>8,}   planner compiled {compiled:>8,} "
              f"({compiled / saved - 1:+.2%}), eager {eager:>8,}", flush=True)
    print(f"the planner's compiled figures within {worst:.2%} of the measured")
    return 0 if worst <= 0.05 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--options", default=",".join(OPTIONS), help=f"of {', '.join(OPTIONS)}")
    p.add_argument("--parallel", action="store_true", help="the two-rank compiled layouts instead")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp()
    tokens = f"{tmp}/tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint16))
    if args.parallel:
        return parallel(tokens, tmp)
    wrong = 0
    for precision in args.precisions.split(","):
        for name in args.options.split(","):
            layout = Layout(precision=precision, micro_batch=2, **OPTIONS[name])
            measured, predicted = {}, {}
            for compiled in (False, True):
                cfg = tiny_config(tmp, f"--data.source={tokens}", *layout.to_overrides(),
                                  f"--compile.enabled={str(compiled).lower()}")
                trainer = trainer_on_rank(0, 1, cfg, tmp)
                trainer.train_step()
                measured[compiled] = saved_bytes(trainer)
                spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
                predicted[compiled] = estimate_memory(spec, dataclasses.replace(layout, compiled=compiled),
                                                      PRESETS["cpu"], cfg.train.global_batch).activations
            wrong += sum(measured[c] != predicted[c] for c in (False, True))
            print(f"{precision} {name:15s} eager {measured[False]:>8,} (planner {predicted[False]:>8,})   "
                  f"compiled {measured[True]:>8,} (planner {predicted[True]:>8,})", flush=True)
    print("every figure equals the planner's" if not wrong else f"{wrong} figure(s) differ from the planner's")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
