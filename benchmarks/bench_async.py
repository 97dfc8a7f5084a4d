"""PipeDream-2BW vs 1F1B: steady-state step time in one run, simulated vs measured bubbles, CPU use.

Three variants run as full training steps of the ``Trainer`` (pipeline, gradient norm, AdamW) on the
same forked Gloo ranks, each on a mesh of its own (its own process groups, so the 2BW pipeline's
transfers and reductions still in flight between its steps never meet another's), from the same
weights and data:

* ``1f1b``: the synchronous schedule (a flush every step);
* ``2bw-sync``: PipeDream-2BW with the synchronous step boundary (``Trainer.train_step``: the loss
  and gradient-norm all-reduces wait for every rank at the end of each step);
* ``2bw``: PipeDream-2BW with the deferred boundary (``Trainer.train_step_deferred``, what ``fit``
  runs): reductions posted asynchronously, each update applied when its weights are first needed.

A step is only timed inside a *block* of ``--block`` consecutive steps of one variant: a barrier
starts the block, and its time is the slowest rank's elapsed time to the end of its last step, over
the block's steps. Timing single steps needs a collective per step, a barrier that would hide what
the deferred boundary removes. After ``--warmup`` untimed steps of each, blocks alternate A B C C B A
... so drift (other processes on a shared machine) hits all alike. Reported: the median per-step time
of each, the ratios to 1F1B of the medians and the median per-round ratio.

CPU saturation: per rank, the process CPU time (``time.process_time``: user + sys of all its
threads, Gloo's included) over the timed blocks, summed over ranks, divided by the blocks' wall time
x ``os.cpu_count()``. Near 1, the ranks already keep every core busy, so no schedule can make a step
much faster (a rank idle in a bubble lends its core to the busy ones). Next to it, the machine's busy
fraction over the same blocks (``/proc/stat``, every process): when it is near 1 and the ranks' share
is not, other processes took the rest, and the timings are theirs as much as ours.

The simulator is fed the measured mean forward and backward times (all ranks, all timed steps) and
gives each schedule's steady-state step time (``steady_step_time``) and bubble, next to the measured
bubble (1 - a rank's compute time / the block's time, the mean over ranks). ``--png`` draws the
last step's timelines, measured (top) and simulated (bottom), one column per variant.

    python benchmarks/bench_async.py --ranks 4 --microbatches 4 --steps 12 --json bench_async.json --png async.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import run_and_report  # noqa: E402  (before bigtrain: this checkout's)

import torch  # noqa: E402

from bigtrain.config import load_config  # noqa: E402
from bigtrain.distributed.mesh import Mesh  # noqa: E402
from bigtrain.parallel.pipeline import align_timelines, build_schedule, draw_timeline, simulate  # noqa: E402
from bigtrain.parallel.pipeline.simulate import steady_step_time  # noqa: E402
from bigtrain.train import Trainer  # noqa: E402
from bigtrain.validation import validate  # noqa: E402

# variant -> (parallel.pp_schedule, deferred boundary)
VARIANTS = {"1f1b": ("1f1b", False), "2bw-sync": ("pipedream-2bw", False), "2bw": ("pipedream-2bw", True)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks (pp)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (m)")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=8, help="model.n_layers (a multiple of --ranks)")
    p.add_argument("--steps", type=int, default=12, help="timed steps of each variant (a multiple of --block)")
    p.add_argument("--block", type=int, default=4, help="consecutive steps of one variant timed together")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    args = p.parse_args(argv)
    if args.steps % args.block:
        p.error(f"--steps {args.steps} must be a multiple of --block {args.block}")
    return args


def _config(args, kind: str, run_dir: str):
    global_batch = 16
    cfg = load_config(preset=args.preset, overrides=[
        f"--parallel.pp={args.ranks}", f"--parallel.pp_schedule={kind}", f"--model.n_layers={args.layers}",
        f"--train.global_batch={global_batch}", f"--train.micro_batch={global_batch // args.microbatches}",
        "--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false",
        f"--data.cache_dir={run_dir}/corpus", "--data.max_bytes=400000"])
    validate(cfg)
    return cfg


def _machine_cpu() -> tuple[float, float] | None:
    """(busy, total) jiffies of every core since boot (Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            values = [float(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    return sum(values) - idle, sum(values)


def rank_main(rank: int, world_size: int, args) -> dict:
    torch.manual_seed(0)
    run_dir = tempfile.mkdtemp(prefix=f"bench_async_{rank}_")
    trainers = {}
    for name, (kind, deferred) in VARIANTS.items():
        cfg = _config(args, kind, "/tmp/bench_async_data")
        trainers[name] = Trainer(cfg, Path(run_dir) / name, Mesh.from_config(cfg.parallel, rank, world_size))
        if deferred:
            assert trainers[name].start_deferred_updates(), "the deferred boundary does not apply to this layout"

    def step(name: str) -> None:
        trainer = trainers[name]
        trainer.train_step_deferred() if trainer.deferred is not None else trainer.train_step()

    for _ in range(args.warmup):
        for name in VARIANTS:
            step(name)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}  # per-step time of each block (slowest rank)
    cpu: dict[str, list[float]] = {n: [] for n in names}  # CPU seconds of each block, summed over ranks
    busy: dict[str, list[float]] = {n: [] for n in names}  # this rank's compute seconds of each block
    machine: dict[str, list[float]] = {n: [0.0, 0.0] for n in names}  # (busy, total) jiffies over the blocks
    durations: dict[str, dict[str, list[float]]] = {n: {"F": [], "B": []} for n in names}
    for round_ in range(args.steps // args.block):
        for name in names if round_ % 2 == 0 else names[::-1]:  # A B C C B A ...
            world = trainers[name].mesh.comm("world")
            world.max(torch.zeros(1))  # the block starts together on every rank
            started, cpu_started, computing = time.perf_counter(), time.process_time(), 0.0
            machine_started = _machine_cpu()
            for _ in range(args.block):
                step(name)
                for label, start, end in trainers[name].executor.timeline:
                    computing += end - start
                    durations[name][label[0]].append(end - start)
            measured = torch.tensor([time.perf_counter() - started, time.process_time() - cpu_started])
            machine_ended = _machine_cpu()
            if machine_started is not None and machine_ended is not None:
                for i in range(2):
                    machine[name][i] += machine_ended[i] - machine_started[i]
            world.max(measured[:1])
            world.all_reduce(measured[1:], tag="metrics")  # summed
            times[name].append(float(measured[0]) / args.block)
            cpu[name].append(float(measured[1]))
            busy[name].append(computing)
    for trainer in trainers.values():
        trainer.flush_update()
    timelines = {name: trainers[name].executor.timeline for name in names}
    return {"times": times, "cpu": cpu, "busy": busy, "timelines": timelines, "durations": durations,
            "machine": machine}


def summarize(args, results, wall_s: float) -> dict:
    times, cpu = results[0]["times"], results[0]["cpu"]
    medians = {name: statistics.median(times[name]) for name in VARIANTS}
    cpus = os.cpu_count()
    out = {"ranks": args.ranks, "microbatches": args.microbatches, "preset": args.preset, "layers": args.layers,
           "steps": args.steps, "block": args.block, "median_step_s": medians,
           "ratio_of_medians": {n: medians[n] / medians["1f1b"] for n in VARIANTS if n != "1f1b"},
           "median_pair_ratio": {n: statistics.median(b / a for a, b in zip(times["1f1b"], times[n]))
                                 for n in VARIANTS if n != "1f1b"},
           # CPU seconds over every timed block / (their wall seconds x cores)
           "cpu_saturation": {n: sum(cpu[n]) / (sum(times[n]) * args.block * cpus) for n in VARIANTS},
           "machine_busy": {n: busy / total if total else None
                            for n, (busy, total) in results[0]["machine"].items()},
           "block_step_s": times, "wall_s": wall_s, "machine": {"cpus": cpus}}
    measured = {n: align_timelines([r["timelines"][n] for r in results]) for n in VARIANTS}
    simulated, bubbles = {}, {}
    for name, (kind, _) in VARIANTS.items():
        # every rank's every timed step: one step's mean is at the mercy of the machine's other processes
        durations = {op: statistics.mean([d for r in results for d in r["durations"][name][op]]) for op in "FB"}
        schedule = build_schedule(kind, args.ranks, args.microbatches)
        sim = simulate(schedule, cost_f=durations["F"], cost_b=durations["B"])
        simulated[name] = sim
        step = steady_step_time(schedule, sim)
        busy_sim = args.microbatches * (durations["F"] + durations["B"])
        block_times = [t * args.block for t in times[name]]
        measured_bubble = statistics.mean(1 - statistics.median(r["busy"][name]) / statistics.median(block_times)
                                          for r in results)
        bubbles[name] = {"mean_F_s": durations["F"], "mean_B_s": durations["B"], "simulated_step_s": step,
                         "simulated_bubble": 1 - busy_sim / step, "measured_bubble": measured_bubble}
    out["bubbles"] = bubbles
    out["simulated_ratio"] = bubbles["2bw"]["simulated_step_s"] / bubbles["1f1b"]["simulated_step_s"]
    if args.png:
        _draw(args, measured, simulated, bubbles)
    return out


def _draw(args, measured, simulated, bubbles) -> None:
    """The last step's timelines in one figure: measured (top) and simulated (bottom), a column per variant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    panels = []
    with tempfile.TemporaryDirectory() as tmp:
        for row, source in (("measured", measured), ("simulated", simulated)):
            for name in VARIANTS:
                lines = source[name] if row == "measured" else source[name].timelines
                bubble = bubbles[name][f"{row}_bubble"]
                path = draw_timeline(lines, Path(tmp) / f"{row}_{name}.png",
                                     f"{row}: {name}, p={args.ranks}, m={args.microbatches}, bubble {bubble:.0%}")
                panels.append(imread(path))
    figure = Figure(figsize=(10 * len(VARIANTS), 7))
    FigureCanvasAgg(figure)
    for i, image in enumerate(panels):
        axes = figure.add_subplot(2, len(VARIANTS), i + 1)
        axes.imshow(image)
        axes.axis("off")
    figure.tight_layout()
    figure.savefig(args.png, dpi=100)


def print_report(args, out) -> None:
    m = out["median_step_s"]
    print(f"pp={args.ranks} m={args.microbatches} {args.preset} ({args.layers} layers), {args.steps} timed steps "
          f"each in blocks of {args.block}, {out['machine']['cpus']} cpus")
    print("  median step: " + ", ".join(f"{n} {m[n] * 1e3:.1f} ms" for n in VARIANTS))
    for n in out["ratio_of_medians"]:
        print(f"  {n} / 1f1b: {out['ratio_of_medians'][n]:.3f} (medians), {out['median_pair_ratio'][n]:.3f} "
              f"(median pair)")
    print(f"  simulated 2bw / 1f1b: {out['simulated_ratio']:.3f}")
    for n, b in out["bubbles"].items():
        print(f"  {n}: bubble simulated {b['simulated_bubble']:.1%}, measured {b['measured_bubble']:.1%}; "
              f"CPU saturation {out['cpu_saturation'][n]:.2f} (machine busy {_fraction(out['machine_busy'][n])})")


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(run_and_report(rank_main, parse_args(), summarize, print_report))
