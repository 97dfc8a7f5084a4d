"""A long sequence trained at cp ranks (ring attention), measured against the planner (issue 31):
each rank's saved-activation bytes and the step time, with the planner's prediction and the ratios.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_long_context.py                  # 64k tokens, cp 4
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_long_context.py --seq 8192 --steps 2

The ``small`` preset's shape (dim 128, 4 layers, 4 heads, vocab 256), one sequence of ``--seq``
tokens per step (global batch 1), fp32, ``--cp`` forked Gloo ranks of one intra-op thread each
(bigtrain.testing.run_ranks). Per rank: a probe step first (forward and backward of the step's
micro-batch with ``SavedActivations`` counting what autograd saves, the count the planner's
activation memory is tested against in tests/test_plan.py), then ``--steps`` training steps timed
by the trainer (``StepResult.step_time_s``; the slowest rank's, as the step waits for it).

The planner (``plan.evaluate``) predicts on a profile calibrated here, in the same run
(``hardware.calibrate``, one thread: one rank's rates, the CPU flash attention kernel's share of the
matmul peak included), each rank's rates scaled by its measured share of a core while ``cp`` ranks
run at once (``calibrate.measure_shared_rate``, taken before and after the steps: the machine is
shared, so both predictions are printed and the ratio uses their mean). ``--hardware-file`` skips
the calibration. Each step's CPU seconds per rank are printed too, against the planner at a whole
core per rank: what the step would take with no other load, as the planner's one accelerator per
rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config import load_config  # noqa: E402
from bigtrain.distributed.mesh import Mesh  # noqa: E402
from bigtrain.memory.accounting import SavedActivations  # noqa: E402
from bigtrain.plan.calibrate import measure_shared_rate  # noqa: E402
from bigtrain.plan.fit import _layout  # noqa: E402
from bigtrain.plan.hardware import calibrate, load_profile, sharing_cores  # noqa: E402
from bigtrain.plan.layout import Cluster  # noqa: E402
from bigtrain.plan.model import ModelSpec  # noqa: E402
from bigtrain.plan.search import evaluate  # noqa: E402
from bigtrain.testing import run_ranks  # noqa: E402
from bigtrain.train import Trainer  # noqa: E402


@dataclasses.dataclass
class RankResult:
    rank: int
    activations: int  # peak bytes autograd saved in the probe step
    probe_s: float  # the probe step's forward and backward (no update)
    step_s: list[float]  # each timed training step
    cpu_s: list[float]  # each timed step's CPU seconds of this rank's process (its threads, Gloo's too)


def config(seq: int, cp: int, token_file: str, steps: int, overrides=()):
    return load_config(preset="small", overrides=[
        "--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false",
        "--checkpoint.every=0", f"--data.source={token_file}", f"--model.max_seq_len={seq}", f"--data.seq_len={seq}",
        "--train.global_batch=1", "--train.micro_batch=1", f"--train.steps={steps + 1}", f"--parallel.cp={cp}",
        *overrides])


def token_file(directory: str, seq: int) -> str:
    path = Path(directory) / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 4 * seq + 1, dtype=np.uint16))
    return str(path)


def _train_on_rank(rank: int, world_size: int, cfg, run_dir: str, steps: int) -> RankResult:
    trainer = Trainer(cfg, Path(run_dir), Mesh.from_config(cfg.parallel, rank, world_size))
    tracker = SavedActivations(trainer.model)
    batches = trainer.sampler.micro_batches(trainer.step, trainer.mesh.coord("dp"), trainer.mesh.size("dp"),
                                            cfg.train.micro_batch)
    start = time.perf_counter()
    for i, (tokens, targets) in enumerate(batches):
        trainer._forward_backward(tokens, targets, sync=i == trainer.accum - 1, tracker=tracker)
    trainer.engine.finish_grad_sync()
    probe = time.perf_counter() - start
    trainer.engine.zero_grad()
    times, cpu = [], []
    for _ in range(steps):
        began = time.process_time()
        times.append(trainer.train_step().step_time_s)
        cpu.append(time.process_time() - began)
    return RankResult(rank, tracker.peak, probe, times, cpu)


def measure(seq: int, cp: int, steps: int, overrides=(), timeout: float = 3600) -> list[RankResult]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(seq, cp, token_file(tmp, seq), steps, overrides)
        return run_ranks(_train_on_rank, cp, cfg, tmp, steps, timeout=timeout, group_timeout=timeout)


def predict(seq: int, cp: int, hardware, share: float = 1.0, overrides=()):
    """The planner's (activation bytes per rank, step seconds) for this run on ``hardware`` with
    each rank's rates scaled by ``share``."""
    cfg = config(seq, cp, "unused.npy", 1, overrides)  # the planner reads no data
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    plan = evaluate(model, _layout(cfg), Cluster.build(cp, sharing_cores(hardware, share)), cfg.train.global_batch)
    return plan.memory.activations, plan.time.step_time_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="timed training steps after the probe step")
    ap.add_argument("--hardware-file", help="a calibrated profile (default: calibrate here first)")
    args, overrides = ap.parse_known_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    load = os.getloadavg()
    if args.hardware_file:
        hardware = load_profile(args.hardware_file)
    else:
        started = time.perf_counter()
        hardware = calibrate(threads=1)
        print(f"calibrated in {time.perf_counter() - started:.0f} s: fp32 peak {hardware.peak_flops_fp32 / 1e9:.1f} "
              f"GFLOP/s, attention_fraction {hardware.attention_fraction:.2f}, gemm_fraction "
              f"{hardware.gemm_fraction:.2f}, memory {hardware.hbm_bandwidth / 1e9:.1f} GB/s", flush=True)
    before = measure_shared_rate(args.cp)
    print(f"share of a core with {args.cp} ranks at once, before: {before:.2f}", flush=True)
    results = measure(args.seq, args.cp, args.steps, overrides)
    after = measure_shared_rate(args.cp)
    share = (before + after) / 2
    print(f"... and after: {after:.2f}; load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    act_pred, time_pred = predict(args.seq, args.cp, hardware, share, overrides)
    span = [predict(args.seq, args.cp, hardware, s, overrides)[1] for s in (before, after)]
    print(f"seq {args.seq}, cp {args.cp}, small shape (dim 128, 4 layers, 4 heads, vocab 256), fp32, 1 thread per rank")
    for r in results:
        print(f"  rank {r.rank}: saved activations {r.activations:,} B, planner {act_pred:,} B, "
              f"ratio {act_pred / r.activations:.4f}; probe step {r.probe_s:.1f} s; steps "
              + ", ".join(f"{s:.1f}" for s in r.step_s) + " s (CPU " + ", ".join(f"{s:.1f}" for s in r.cpu_s) + " s)")
    per_step = [max(r.step_s[i] for r in results) for i in range(args.steps)]
    measured = statistics.median(per_step)
    print(f"step time (slowest rank, median of {args.steps}): {measured:.2f} s; planner {time_pred:.2f} s "
          f"at a share of {share:.2f} ({span[0]:.2f} s at {before:.2f}, {span[1]:.2f} s at {after:.2f}); "
          f"ratio {time_pred / measured:.3f}")
    cpu = statistics.median(max(r.cpu_s[i] for r in results) for i in range(args.steps))
    alone = predict(args.seq, args.cp, hardware, 1.0, overrides)[1]
    print(f"CPU seconds per step (a core to itself; slowest rank, median): {cpu:.2f} s; planner at a share of 1: "
          f"{alone:.2f} s; ratio {alone / cpu:.3f}")
    worst = max(abs(act_pred / r.activations - 1) for r in results)
    print(f"activations: worst rank within {worst:.2%} of the planner's; step time within "
          f"{abs(time_pred / measured - 1):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
