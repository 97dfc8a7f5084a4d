"""PipeDream-2BW vs 1F1B: steady-state step time in one run, and simulated vs measured bubbles.

Both run as full training steps of the ``Trainer`` (pipeline, gradient norm, AdamW) on the same
forked Gloo ranks, each on a mesh of its own (its own process groups, so the 2BW pipeline's
transfers still in flight between its steps never meet 1F1B's), from the same weights and data.
After ``--warmup`` untimed steps of each, steps alternate A B B A ... so drift (other processes on a
shared machine) hits both alike; a step's time is the slowest rank's ``step_time_s``. Reported: the
median step time of each, the ratio 2BW / 1F1B of the medians and the median per-pair ratio.

The simulator is fed the measured mean forward and backward times (all ranks, all timed steps) and
gives each schedule's steady-state step time (``steady_step_time``) and bubble, next to the measured
bubble (1 - a rank's compute time / its step time, the mean over ranks). ``--png`` draws the four
timelines (measured and simulated, 1F1B and 2BW) in one figure, side by side.

    python benchmarks/bench_async.py --ranks 4 --microbatches 4 --steps 12 --json bench_async.json --png async.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
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

KINDS = ("1f1b", "pipedream-2bw")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks (pp)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (m)")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=8, help="model.n_layers (a multiple of --ranks)")
    p.add_argument("--steps", type=int, default=12, help="timed steps of each kind (A B B A ...)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    return p.parse_args(argv)


def _config(args, kind: str, run_dir: str):
    global_batch = 16
    cfg = load_config(preset=args.preset, overrides=[
        f"--parallel.pp={args.ranks}", f"--parallel.pp_schedule={kind}", f"--model.n_layers={args.layers}",
        f"--train.global_batch={global_batch}", f"--train.micro_batch={global_batch // args.microbatches}",
        "--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false",
        f"--data.cache_dir={run_dir}/corpus", "--data.max_bytes=400000"])
    validate(cfg)
    return cfg


def rank_main(rank: int, world_size: int, args) -> dict:
    torch.manual_seed(0)
    run_dir = tempfile.mkdtemp(prefix=f"bench_async_{rank}_")
    trainers = {kind: Trainer(_config(args, kind, "/tmp/bench_async_data"), Path(run_dir) / kind,
                              Mesh.from_config(_config(args, kind, "/tmp/bench_async_data").parallel, rank, world_size))
                for kind in KINDS}
    for _ in range(args.warmup):
        for trainer in trainers.values():
            trainer.train_step()
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    busy: dict[str, list[float]] = {kind: [] for kind in KINDS}
    durations: dict[str, dict[str, list[float]]] = {kind: {"F": [], "B": []} for kind in KINDS}
    order = [KINDS[(i // 2 + i) % 2] for i in range(2 * args.steps)]  # A B B A A B ...
    for kind in order:
        trainer = trainers[kind]
        result = trainer.train_step()
        step_time = torch.tensor([result.step_time_s])
        trainer.mesh.comm("world").max(step_time)
        times[kind].append(float(step_time))
        busy[kind].append(sum(end - start for _, start, end in trainer.executor.timeline))
        for label, start, end in trainer.executor.timeline:
            durations[kind][label[0]].append(end - start)
    timelines = {kind: trainers[kind].executor.timeline for kind in KINDS}
    return {"times": times, "busy": busy, "timelines": timelines, "durations": durations}


def summarize(args, results, wall_s: float) -> dict:
    times = results[0]["times"]
    sync, two_bw = (statistics.median(times[k]) for k in KINDS)
    pairs = [b / a for a, b in zip(times["1f1b"], times["pipedream-2bw"])]
    out = {"ranks": args.ranks, "microbatches": args.microbatches, "preset": args.preset, "layers": args.layers,
           "steps": args.steps, "median_step_s": {"1f1b": sync, "pipedream-2bw": two_bw},
           "ratio_of_medians": two_bw / sync, "median_pair_ratio": statistics.median(pairs), "wall_s": wall_s,
           "machine": {"cpus": os.cpu_count()}}
    measured = {kind: align_timelines([r["timelines"][kind] for r in results]) for kind in KINDS}
    simulated, bubbles = {}, {}
    for kind in KINDS:
        # every rank's every timed step: one step's mean is at the mercy of the machine's other processes
        durations = {op: statistics.mean([d for r in results for d in r["durations"][kind][op]]) for op in "FB"}
        schedule = build_schedule(kind, args.ranks, args.microbatches)
        sim = simulate(schedule, cost_f=durations["F"], cost_b=durations["B"])
        simulated[kind] = sim
        step = steady_step_time(schedule, sim)
        busy_sim = args.microbatches * (durations["F"] + durations["B"])
        measured_bubble = statistics.mean(1 - statistics.median(r["busy"][kind]) / statistics.median(times[kind])
                                          for r in results)
        bubbles[kind] = {"mean_F_s": durations["F"], "mean_B_s": durations["B"], "simulated_step_s": step,
                         "simulated_bubble": 1 - busy_sim / step, "measured_bubble": measured_bubble}
    out["bubbles"] = bubbles
    out["simulated_ratio"] = bubbles["pipedream-2bw"]["simulated_step_s"] / bubbles["1f1b"]["simulated_step_s"]
    if args.png:
        _draw(args, measured, simulated, bubbles)
    return out


def _draw(args, measured, simulated, bubbles) -> None:
    """The four timelines in one figure: measured (top) and simulated (bottom), 1F1B left, 2BW right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    panels = []
    with tempfile.TemporaryDirectory() as tmp:
        for row, source in (("measured", measured), ("simulated", simulated)):
            for kind in KINDS:
                lines = source[kind] if row == "measured" else source[kind].timelines
                bubble = bubbles[kind][f"{row}_bubble"]
                path = draw_timeline(lines, Path(tmp) / f"{row}_{kind}.png",
                                     f"{row}: {kind}, p={args.ranks}, m={args.microbatches}, bubble {bubble:.0%}")
                panels.append(imread(path))
    figure = Figure(figsize=(20, 7))
    FigureCanvasAgg(figure)
    for i, image in enumerate(panels):
        axes = figure.add_subplot(2, 2, i + 1)
        axes.imshow(image)
        axes.axis("off")
    figure.tight_layout()
    figure.savefig(args.png, dpi=100)


def print_report(args, out) -> None:
    m = out["median_step_s"]
    print(f"pp={args.ranks} m={args.microbatches} {args.preset} ({args.layers} layers), {args.steps} timed steps each")
    print(f"  median step: 1f1b {m['1f1b'] * 1e3:.1f} ms, pipedream-2bw {m['pipedream-2bw'] * 1e3:.1f} ms")
    print(f"  2bw / 1f1b: {out['ratio_of_medians']:.3f} (medians), {out['median_pair_ratio']:.3f} (median pair); "
          f"simulated {out['simulated_ratio']:.3f}")
    for kind, b in out["bubbles"].items():
        print(f"  {kind}: bubble simulated {b['simulated_bubble']:.1%}, measured {b['measured_bubble']:.1%}")


if __name__ == "__main__":
    sys.exit(run_and_report(rank_main, parse_args(), summarize, print_report))
