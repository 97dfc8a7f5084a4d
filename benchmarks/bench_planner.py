"""Predicted vs measured tokens/s on this machine, for >= 10 layouts (issue 19).

    PYTHONPATH=. python -m bigtrain bench --calibrate --output /tmp/cpu.json
    PYTHONPATH=. python benchmarks/bench_planner.py --hardware-file /tmp/cpu.json [--steps 8] [--json out.json]

Each layout trains the ``tiny`` preset (or ``--preset small``) for ``--steps`` steps with ``bigtrain train`` (its own
torchrun, Gloo); measured = the median tokens/s of the logged steps after the first two. Every rank,
the one-process layouts' included, runs one intra-op thread (``OMP_NUM_THREADS=1``, torchrun's
default), and the profile is one thread's (``bench --calibrate --threads 1``, the default): one rank
is one core, as the planner's one accelerator per rank. Predicted = ``bigtrain.plan.evaluate`` on the
calibrated profile, each rank's rates (GEMM, memory, dispatch) scaled by its share when the layout's
ranks run at once: measured here first (``calibrate.measure_shared_rate``: that many one-thread
GEMM loops at once, the slowest against one alone), or with ``--shared cores`` min(1, cores / ranks);
and the collectives of each rank count measured here too (``--links measured``: 4 ranks on 2 cores
wait longer than 2), or the profile's with ``--links profile``.
``--rounds N`` measures every layout N times in turn and takes the median. Reports each ratio, how
many are within 25%, and whether the planner's top 3 equals the measured top 3. The machine is
shared: say how loaded it was next to any figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config import load_config  # noqa: E402
from bigtrain.plan.calibrate import measure_shared_rate  # noqa: E402
from bigtrain.plan.calibrate_comm import CollectiveRates, measure_collectives  # noqa: E402
from bigtrain.plan.fit import _layout  # noqa: E402
from bigtrain.plan.hardware import get_profile, host_share, load_profile, sharing_cores  # noqa: E402
from bigtrain.plan.layout import Cluster  # noqa: E402
from bigtrain.plan.model import ModelSpec  # noqa: E402
from bigtrain.plan.search import evaluate  # noqa: E402

BASE = ["--train.global_batch=16", "--train.micro_batch=4", "--logging.log_every=1", "--checkpoint.every=0"]
LAYOUTS = {
    "single": [],
    "ckpt full": ["--memory.checkpointing=full"],
    "mb 2": ["--train.micro_batch=2"],
    "dp 2": ["--parallel.dp=2"],
    "dp 2 zero 1": ["--parallel.dp=2", "--parallel.zero=1"],
    "dp 2 zero 2": ["--parallel.dp=2", "--parallel.zero=2"],
    "dp 2 zero 3": ["--parallel.dp=2", "--parallel.zero=3"],
    "tp 2": ["--parallel.tp=2"],
    "pp 2": ["--parallel.pp=2"],
    "dp 2 ckpt full": ["--parallel.dp=2", "--memory.checkpointing=full"],
    "dp 4": ["--parallel.dp=4"],
}


PRESET = "tiny"


def measure(overrides: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "bigtrain", "train", "--preset", PRESET, f"--train.steps={steps}", *BASE,
               *overrides, "--output-dir", f"{tmp}/run"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=env)
        records = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r.get("step", 0) > 2]
    return statistics.median(rates)


def world_size(overrides: list[str]) -> int:
    return load_config(preset=PRESET, overrides=BASE + overrides).parallel.world_size


def predict(overrides: list[str], hardware, shared_rates: dict[int, float] | None = None,
            links: dict[int, CollectiveRates] | None = None) -> float:
    cfg = load_config(preset=PRESET, overrides=BASE + overrides)
    ranks = cfg.parallel.world_size
    shared = (shared_rates or {}).get(ranks, host_share(ranks))
    if links and ranks in links:  # the collectives of this many ranks on this machine
        hardware = dataclasses.replace(hardware, **links[ranks].profile_fields())
    hw = sharing_cores(hardware, shared)
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    plan = evaluate(model, _layout(cfg), Cluster.build(ranks, hw), cfg.train.global_batch)
    return plan.tokens_per_s


def main() -> int:
    global PRESET
    parser = argparse.ArgumentParser()
    parser.add_argument("--hardware-file")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument("--preset", default="tiny", help="tiny (default) or small")
    parser.add_argument("--shared", choices=("measured", "cores"), default="measured",
                        help="each rank's share of its rates when several run at once: measured here "
                             "(calibrate.measure_shared_rate), or min(1, cores / ranks)")
    parser.add_argument("--links", choices=("measured", "profile"), default="measured",
                        help="the collectives of each layout's rank count measured here first "
                             "(calibrate_comm.measure_collectives), or the profile's (measured at 2 ranks)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every layout this many times, in turn, and take the median")
    args = parser.parse_args()
    PRESET = args.preset
    hardware = load_profile(args.hardware_file) if args.hardware_file else get_profile("cpu")
    load = os.getloadavg()[0]
    rank_counts = sorted({world_size(o) for o in LAYOUTS.values()})
    shared_rates = None
    if args.shared == "measured":
        shared_rates = {r: measure_shared_rate(r) for r in rank_counts}
        print("one rank's share of its lone rate, by ranks running at once:",
              ", ".join(f"{r}: {v:.2f}" for r, v in shared_rates.items()), flush=True)
    links = None
    if args.links == "measured":
        links = {r: measure_collectives(r) for r in rank_counts if r > 1}
        for r, rates in links.items():
            print(rates.describe(r, 16 * 2**20), flush=True)
    measured = {name: [] for name in LAYOUTS}
    for _ in range(args.rounds):  # in turn, so a slow minute of the machine hits every layout alike
        for name, overrides in LAYOUTS.items():
            measured[name].append(measure(overrides, args.steps))
    rows = []
    for name, overrides in LAYOUTS.items():
        predicted, median = predict(overrides, hardware, shared_rates, links), statistics.median(measured[name])
        rows.append({"layout": name, "predicted": predicted, "measured": median, "rounds": measured[name],
                     "ratio": predicted / median})
        print(f"{name:16s} predicted {predicted:9,.0f}  measured {median:9,.0f} tokens/s  ratio {predicted / median:.2f}"
              f"  (rounds: {', '.join(f'{v:,.0f}' for v in measured[name])})", flush=True)
    within = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    top = lambda key: [r["layout"] for r in sorted(rows, key=lambda r: -r[key])[:3]]  # noqa: E731
    print(f"\n{within} of {len(rows)} within 25%; top 3 predicted {top('predicted')}, measured {top('measured')}: "
          f"{'same' if top('predicted') == top('measured') else 'different'}; load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "within_25": within, "load": load,
                                               "shared_rates": shared_rates,
                                               "links": {r: dataclasses.asdict(v) for r, v in (links or {}).items()}},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
