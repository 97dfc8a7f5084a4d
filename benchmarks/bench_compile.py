"""Regional compilation on the CPU, in one run: the compiled ``small`` step against the eager one,
and the layout fuzzer with every decoder sample compiled, against the independent eager reference.

Speed: one process (one thread, as every rank here), the real trainer (``Trainer`` on a one-rank
mesh, fp32, the ``small`` preset: d128 x 4 blocks, 16 x 128 tokens a step in two micro-batches), an
eager trainer and a compiled one (``compile.enabled = true``) built on the same weights and data.
After ``--warmup`` steps of each (the compiled one's first step compiles), timed steps alternate
eager, compiled, compiled, eager, ... so that load drift hits both alike; the report gives each
side's median step and their ratio (eager / compiled: above 1 the compiled step is faster), the
compile time and the steps it takes to pay for itself. The step is wall time; each step's CPU time
(this thread's, ``time.thread_time``) is reported beside it, with the load average: on a shared
machine a preempted step's wall time grows and its CPU time does not, so the CPU ratio is the one
that two runs under different loads can be compared by. Losses of the two agree within fp32's
1e-5 at every step (checked; compile changes the order of float reductions, not the math).

Parity: ``python -m bigtrain.check.fuzz N SEED --compile-share 1`` (each decoder sample compiled;
DLRMs, which have no blocks, unchanged): every sample is rejected before launch naming a field or
trains like the independent reference (fp32 1e-5 relative; bf16/fp16 at their tolerances).

    python benchmarks/bench_compile.py --json runs/bench/compile.json
    python benchmarks/bench_compile.py --fuzz 0          # the speed part only
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401 - puts this checkout first on the path

import torch

from bigtrain.check import fuzz
from bigtrain.config import load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.train import Trainer
from bigtrain.validation import validate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each side (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each side first (default 3)")
    p.add_argument("--fuzz", type=int, default=8, help="fuzzer samples, all decoders compiled (default 8; 0: none)")
    p.add_argument("--seed", type=int, default=20261201, help="the fuzzer's seed")
    p.add_argument("--max-world", type=int, default=4, help="most ranks a fuzzer sample may use (default 4)")
    p.add_argument("--cache-dir", default="", help="data.cache_dir")
    p.add_argument("--json", default="", help="also write every number to this file")
    return p.parse_args(argv)


def _trainer(args, compiled: bool, run_dir: str) -> Trainer:
    overrides = [f"--compile.enabled={str(compiled).lower()}", "--train.device=cpu", "--logging.progress=false",
                 "--logging.report=false", "--logging.measure_memory=false", "--checkpoint.save_final=false",
                 f"--train.steps={args.warmup + args.steps}"]
    if args.cache_dir:
        overrides.append(f"--data.cache_dir={args.cache_dir}")
    cfg = load_config(preset=args.preset, overrides=overrides)
    validate(cfg, world_size=1)
    return Trainer(cfg, Path(run_dir), Mesh({}), "cpu")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def speed(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        eager, compiled = _trainer(args, False, f"{tmp}/eager"), _trainer(args, True, f"{tmp}/compiled")
        losses = {"eager": [], "compiled": []}
        times = {"eager": [], "compiled": []}
        cpu = {"eager": [], "compiled": []}
        faults = {"eager": [], "compiled": []}  # minor page faults: memory the allocator gave back, touched again
        compile_s = 0.0
        for side, trainer in (("eager", eager), ("compiled", compiled)):
            for _ in range(args.warmup):
                result = trainer.train_step()
                losses[side].append(result.loss)
                compile_s += result.compile_s
        for i in range(args.steps):
            for side in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
                trainer = eager if side == "eager" else compiled
                start, start_cpu, start_faults = time.perf_counter(), time.thread_time(), _minor_faults()
                result = trainer.train_step()
                times[side].append(time.perf_counter() - start)
                cpu[side].append(time.thread_time() - start_cpu)
                faults[side].append(_minor_faults() - start_faults)
                losses[side].append(result.loss)
                compile_s += result.compile_s if side == "compiled" else 0.0
    errors = [abs(a - b) / abs(b) for a, b in zip(losses["compiled"], losses["eager"])]
    if max(errors) > 1e-5:
        raise SystemExit(f"bench_compile: compiled losses differ from eager by {max(errors):.1e} > 1e-5")
    med = {side: statistics.median(t) for side, t in times.items()}
    med_cpu = {side: statistics.median(t) for side, t in cpu.items()}
    saved = med["eager"] - med["compiled"]
    return {"preset": args.preset, "tokens_per_step": eager.global_tokens, "median_step_s": med,
            "step_s": times, "speedup": med["eager"] / med["compiled"], "median_step_cpu_s": med_cpu,
            "step_cpu_s": cpu, "cpu_speedup": med_cpu["eager"] / med_cpu["compiled"],
            "median_minor_faults": {side: statistics.median(f) for side, f in faults.items()}, "compile_s": compile_s,
            "break_even_steps": compile_s / saved if saved > 0 else None, "loss_max_rel_diff": max(errors),
            "losses": losses}


def parity(args) -> dict:
    cache = args.cache_dir or tempfile.mkdtemp(prefix="bench-compile-corpus-")
    outcomes = []
    for i in range(args.fuzz):
        sample = fuzz.draw_sample(args.seed, i, args.max_world, fuzz.DLRM_SHARE, compile_share=1.0)
        outcome = fuzz.run_sample(sample, cache, steps=3)
        outcomes.append({"overrides": sample, "verdict": outcome.verdict, "seconds": outcome.seconds,
                         "detail": outcome.detail if not outcome.ok else ""})
        print(f"[{i + 1}/{args.fuzz}] {outcome.verdict:9s} {outcome.seconds:6.1f}s {' '.join(sample)}", flush=True)
        if not outcome.ok:
            print("    " + outcome.detail.replace("\n", "\n    "), flush=True)
    return {"seed": args.seed, "samples": outcomes,
            "verdicts": {v: sum(o["verdict"] == v for o in outcomes) for v in sorted({o["verdict"] for o in outcomes})}}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    out = {"command": "python benchmarks/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {"torch": torch.__version__, "cpus": os.cpu_count(), "checkout": common.checkout()}}
    s = out["speed"] = speed(args)
    print(f"{args.preset}: eager {s['median_step_s']['eager'] * 1e3:.1f} ms/step, compiled "
          f"{s['median_step_s']['compiled'] * 1e3:.1f} ms/step: {s['speedup']:.2f}x; compile {s['compile_s']:.1f} s, "
          f"paid back after {s['break_even_steps'] or float('inf'):.0f} steps; losses within "
          f"{s['loss_max_rel_diff']:.1e}", flush=True)
    print(f"  CPU time: eager {s['median_step_cpu_s']['eager'] * 1e3:.1f} ms/step, compiled "
          f"{s['median_step_cpu_s']['compiled'] * 1e3:.1f} ms/step: {s['cpu_speedup']:.2f}x; minor page faults "
          f"{s['median_minor_faults']['eager']:.0f} / {s['median_minor_faults']['compiled']:.0f} a step; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after", flush=True)
    if args.fuzz:
        p = out["parity"] = parity(args)
        print(f"fuzz: {args.fuzz} samples, seed {args.seed}, decoders compiled: "
              + ", ".join(f"{n} {v}" for v, n in p["verdicts"].items()))
    out["machine"]["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]
    if args.json:
        common.write_json(args.json, out)
    bad = [o for o in out.get("parity", {}).get("samples", []) if o["verdict"] not in ("agree", "rejected")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
