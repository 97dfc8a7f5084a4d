"""Offload on this machine: the host optimizer's speed, and training beyond memory.

``--case speed``: the offloaded optimizer step (``offload.optimizer = cpu``: the ZeRO engine steps
its flat master shard unit by unit with torch's fused CPU AdamW) on ``--params`` fp32 parameters
(default 100M, in 10 units), against torch's foreach AdamW over the same tensors, and DeepSpeed's
published claim (CPU Adam 5-7x torch's). Same gradients for both; timed steps alternate; medians.

``--case rss``: one process, ZeRO-3 fp32, a wide model (``--dim``, ``--layers``) trained for
``--steps`` steps with ``offload.optimizer = nvme`` and ``offload.params = nvme`` (and, for the
record, without): each run in a fresh subprocess, whose peak RSS (``getrusage``) is compared with
the model states' 16 bytes per parameter (weights, gradients, two moments in fp32).

``--case overlap``: one process, ZeRO-1 fp32, ``offload.optimizer = cpu``, a model of ``--dim`` and
``--layers`` trained ``--steps`` steps with and without ``offload.delayed_update``: per step the host
step's time (``offload_step_ms``) and the fraction of it that ran during the forward and backward
(``offload_hidden``), as the trainer writes them to metrics.jsonl; medians over the steps after the
first two. On a CPU device the "device work" and the host step share the same cores: the issue's
>= 70% hidden target is about a GPU, where the forward and backward do not need the CPU.

    .venv/bin/python benchmarks/bench_offload.py --case speed
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_offload.py --case overlap
    .venv/bin/python benchmarks/bench_offload.py --case gpu --preset llama-7b

``--case gpu``: on one CUDA device, a Llama of ``--preset`` (llama-7b by default) trained one process
in bf16 with ``offload.optimizer = cpu`` (``--delayed`` adds ``offload.delayed_update``) at the
planner's fit: the fastest layout ``bigtrain plan --preset <preset> --gpus 1 --hardware <--hardware>
--global-batch <--global-batch> --layout offload_optimizer=cpu`` finds that fits the device, the
host's memory and its NVMe (``--hardware``: this GPU's profile by default, from its name and memory as
``bigtrain.plan.hardware.local_hardware`` reads them: h200-141g on an H200; ``--hw`` sets the profile's
fields, e.g. ``host_memory_bytes``; ``--optim adamw8bit`` for smaller state). After ``--warmup`` untimed steps, each of ``--steps`` steps is
bracketed by ``torch.cuda.synchronize()``; medians. Prints the build time, the first step against
the steady one, tokens/s, MFU (tokens/s x the planner's ``ModelSpec.model_flops_per_token`` / the
device's dense bf16 peak, as benchmarks/bench_gpu.py), the planner's device peak against
``torch.cuda.max_memory_allocated``, its host figure against the host RSS (now and peak), the
engine's bytes per tier against the planner's, the share of the host step hidden (with
``--delayed``) and the bytes the offload copied each way. Without a CUDA device it says so and
exits 0; ``--device cpu`` runs the same path on the CPU with the host tier kept apart (the tests'
``separate_host``), for a small preset (what the test of this benchmark runs).
    .venv/bin/python benchmarks/bench_offload.py --case gpu --preset llama-7b --delayed --global-batch 16
    .venv/bin/python benchmarks/bench_offload.py --case gpu --preset llama-13b --optim adamw8bit \
        --hw host_memory_bytes=134000000000
    .venv/bin/python benchmarks/bench_offload.py --case rss --nvme-dir /tmp/bigtrain-nvme
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401 - puts this checkout first on sys.path

import torch


def _speed(params: int, units: int, steps: int) -> dict:
    from bigtrain.config import OptimConfig
    from bigtrain.optim import build_optimizer

    torch.manual_seed(0)
    per = params // units
    ours = [torch.nn.Parameter(torch.randn(per)) for _ in range(units)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grads = [torch.randn(per) for _ in range(units)]
    cfg = OptimConfig()
    fused = build_optimizer(torch.nn.ParameterList(ours), cfg)  # what the engine builds: fused on CPU
    foreach = torch.optim.AdamW(theirs, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0,
                                foreach=True)  # vectors: no decay, as build_optimizer gives them
    assert fused.defaults.get("fused"), "torch has no fused CPU AdamW here"

    def offloaded_step():
        for p, g in zip(ours, grads):  # unit by unit, as UnitOffload.step does
            p.grad = g
            fused.step()
            p.grad = None

    def foreach_step():
        for p, g in zip(theirs, grads):
            p.grad = g
        foreach.step()

    times = {"offloaded fused": [], "foreach": []}
    for i in range(steps + 2):
        order = [("offloaded fused", offloaded_step), ("foreach", foreach_step)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    diff = max(float((a.detach() - b.detach()).norm() / b.detach().norm()) for a, b in zip(ours, theirs))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"params": params, "units": units, "ms": med, "foreach_over_offloaded": med["foreach"] / med["offloaded fused"],
            "max_relative_difference": diff, "threads": torch.get_num_threads()}


def _rss_child(args) -> None:
    """Run in a fresh process: train, then print peak RSS and the model's parameter count."""
    from pathlib import Path

    from bigtrain.config import load_config
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.train import Trainer

    overrides = [f"--model.dim={args.dim}", f"--model.n_layers={args.layers}", "--model.n_heads=8",
                 "--model.n_kv_heads=0", "--data.seq_len=16", "--train.micro_batch=1", "--train.global_batch=1",
                 f"--train.steps={args.steps}", "--parallel.zero=3", "--precision.mode=fp32",
                 "--checkpoint.every=0", "--model.max_seq_len=16"]
    if args.offload:
        overrides += ["--offload.optimizer=nvme", "--offload.params=nvme", f"--offload.nvme_dir={args.nvme_dir}"]
    cfg = load_config(preset="tiny", overrides=overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-offload-"))
    trainer = Trainer(cfg, run_dir, Mesh({"dp": 1}, 0))
    params = sum(p.numel() for p in trainer.model.parameters())
    t0 = time.perf_counter()
    losses = [trainer.train_step().loss for _ in range(args.steps)]
    seconds = (time.perf_counter() - t0) / args.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    nvme = trainer.engine.offload.offloaded_bytes()["nvme"] if trainer.engine.offload is not None else 0
    print(json.dumps({"params": params, "peak_rss": peak, "model_states_16P": 16 * params, "nvme_bytes": nvme,
                      "s_per_step": seconds, "losses": losses}))


def _overlap(args) -> dict:
    from pathlib import Path

    from bigtrain.config import load_config
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.train import Trainer

    out = {"threads": torch.get_num_threads()}
    for delayed in (False, True):
        overrides = [f"--model.dim={args.dim}", f"--model.n_layers={args.layers}", "--model.n_heads=8",
                     "--model.n_kv_heads=0", f"--data.seq_len={args.seq}", f"--model.max_seq_len={args.seq}",
                     f"--train.micro_batch={args.batch}", f"--train.global_batch={args.batch}",
                     f"--train.steps={args.steps}", "--parallel.zero=1", "--precision.mode=fp32",
                     "--checkpoint.every=0", "--offload.optimizer=cpu", f"--offload.delayed_update={delayed}"]
        cfg = load_config(preset="tiny", overrides=overrides)
        trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="bench-offload-")), Mesh({"dp": 1}, 0))
        results = [trainer.train_step() for _ in range(args.steps)]
        trainer.engine.finish_update()
        timed = [r for r in results[2:] if r.offload]
        out["delayed" if delayed else "synchronous"] = {
            "params": sum(p.numel() for p in trainer.model.parameters()),
            "s_per_step": statistics.median(r.step_time_s for r in results[2:]),
            "offload_step_ms": statistics.median(r.offload["step_ms"] for r in timed),
            "offload_hidden": statistics.median(r.offload["hidden"] for r in timed),
            "losses": [round(r.loss, 4) for r in results]}
    return out


def _planned(args):
    """The planner's fit for ``--preset`` on one ``--hardware`` (with ``--hw`` overrides) at
    ``--global-batch`` sequences a step, with the optimizer on the host (and ``--delayed``): the
    fastest layout it finds that fits the device, the host's memory and its NVMe (``bigtrain plan
    --preset P --gpus 1 --global-batch B --layout offload_optimizer=cpu[,delayed_update=on]``)."""
    from bigtrain.plan.cli import add_plan_parser, resolve
    from bigtrain.plan.search import search

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    layout = "offload_optimizer=cpu" + (",delayed_update=on" if args.delayed else "")
    argv = ["plan", "--preset", args.preset, "--gpus", "1", "--hardware", args.hardware, "--layout", layout,
            "--global-batch", str(args.global_batch), "--optim", args.optim]
    argv += [x for hw in args.hw for x in ("--hw", hw)]
    model, cluster, global_batch, fixed = resolve(parser.parse_args(argv))
    result = search(model, cluster, global_batch, fixed, precision="bf16", optimizer=args.optim)
    if result.best is None:
        raise SystemExit(f"bench_offload --case gpu: the planner finds no layout of {args.preset} with the optimizer "
                         f"on the host that fits one {args.hardware} (device, host memory and NVMe; set them with "
                         f"--hw host_memory_bytes=... --hw nvme_bytes=...)")
    return result.best


def _host_rss() -> dict:
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"host_rss_gib": now / 2**30, "host_peak_rss_gib": peak / 2**30}


def _trainer(cfg, run_dir, device: str):
    """The Trainer; on a CPU device with the host tier kept apart (``OffloadPlan.separate_host``), so
    the GPU path's logic runs: every copy, the gradient buckets, the host accumulators."""
    from dataclasses import replace
    from pathlib import Path

    import bigtrain.train
    import bigtrain.train_step
    from bigtrain.distributed.mesh import Mesh

    if device == "cpu":
        original = bigtrain.train_step.parallel_plan

        def separate(cfg, run_dir=None, **kwargs):
            plan = original(cfg, run_dir, **kwargs)
            return replace(plan, engine=replace(plan.engine, offload=replace(plan.engine.offload, separate_host=True)))

        bigtrain.train_step.parallel_plan = separate
    return bigtrain.train.Trainer(cfg, Path(run_dir), Mesh({}), device)


def _gpu(args) -> dict:
    """Offload on a GPU at the planner's fit: one process, bf16, the host optimizer step (see the
    module's docstring); predicted against measured memory. ``--device cpu`` runs the same path on
    the CPU (the tests' separate host tier), for a small ``--preset``."""
    from bench_gpu import detect_peak

    from bigtrain.config import load_config
    from bigtrain.plan.memory import rank_units
    from bigtrain.plan.model import ModelSpec
    from bigtrain.plan.tiers import tier_bytes
    from bigtrain.validation import validate

    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    plan = _planned(args)
    layout = plan.layout
    steps = args.warmup + args.steps
    overrides = layout.to_overrides() + [
        f"--train.device={device}", f"--train.global_batch={args.global_batch}", f"--train.steps={steps}",
        f"--optim.name={args.optim}", f"--offload.grad_buckets={args.grad_buckets}",
        "--logging.progress=false", "--logging.report=false", "--logging.measure_memory=false",
        "--checkpoint.save_final=false", "--checkpoint.every=0"]
    overrides += [f"--data.cache_dir={args.cache_dir}"] if args.cache_dir else []
    overrides += [f"--data.max_bytes={args.max_bytes}"] if args.max_bytes else []
    cfg = load_config(preset=args.preset, overrides=overrides)
    validate(cfg, world_size=1, cuda_available=device == "cuda")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="bench-offload-gpu-") as run_dir:
        start = time.perf_counter()
        trainer = _trainer(cfg, run_dir, device)
        if cuda:
            torch.cuda.synchronize()
        build_s = time.perf_counter() - start
        results, times = [], []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            results.append(trainer.train_step())
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        trainer.engine.finish_update()
        held = trainer.engine.tier_bytes()
        copied = trainer.engine.offload.link.counted()
        measured_peak = torch.cuda.max_memory_allocated() if cuda else None
        rss = _host_rss()
        trainer.engine.offload.close()
    seq = cfg.data.seq_len
    spec = ModelSpec.from_model_config(cfg.model, seq)
    root, blocks = rank_units(spec, layout, 0)
    predicted_tiers = tier_bytes([root] + blocks, layout, args.optim, cfg.optim.block_size,
                                 grad_buckets=args.grad_buckets)
    tokens = cfg.train.global_batch * seq
    timed = times[args.warmup:]
    median = statistics.median(timed)
    tokens_per_s = tokens / median
    peak, peak_source = detect_peak(torch.cuda.get_device_name(), args.peak_tflops) if cuda else (None, "cpu")
    mem = plan.memory
    hidden = [r.offload["hidden"] for r in results[args.warmup:] if r.offload]
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (the GPU path, host tier apart)",
        "preset": args.preset, "params": spec.params, "optimizer": args.optim,
        "planner_layout": layout.describe(), "overrides": layout.to_overrides(),
        "tokens_per_step": tokens, "build_s": build_s, "first_step_s": times[0], "step_s": times,
        "median_step_s": median, "first_over_steady": times[0] / median, "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * spec.model_flops_per_token() / peak if peak else None, "peak_source": peak_source,
        "predicted": {"device_peak_gib": mem.peak / 2**30, "device_total_gib": mem.total / 2**30,
                      "host_gib": mem.host / 2**30, "host_states_gib": mem.detail["host_states"] / 2**30,
                      "tiers": predicted_tiers, "step_s": plan.time.step_time_s if plan.time else None,
                      "mfu": plan.time.mfu if plan.time else None},
        "measured": {"max_memory_allocated_gib": measured_peak / 2**30 if measured_peak is not None else None,
                     "tiers": held, **rss},
        "device_peak_over_predicted": measured_peak / mem.peak if measured_peak else None,
        "host_rss_over_predicted": rss["host_peak_rss_gib"] * 2**30 / mem.host,
        "tiers_equal": held == predicted_tiers,
        "offload_hidden_median": statistics.median(hidden) if hidden else None,
        "bytes_copied": copied, "losses": [round(r.loss, 4) for r in results]}


def _rss(args) -> dict:
    out = {}
    for offload in (True, False) if not args.offload_only else (True,):
        cmd = [sys.executable, __file__, "--case", "rss-child", "--dim", str(args.dim), "--layers", str(args.layers),
               "--steps", str(args.steps), "--nvme-dir", args.nvme_dir] + (["--offload"] if offload else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["states_over_peak_rss"] = row["model_states_16P"] / row["peak_rss"]
        out["nvme" if offload else "none"] = row
    return out


def default_hardware(device: str) -> str:
    """The profile the gpu case plans for without ``--hardware``: this machine's accelerator's (it
    planned for an h100-80g on an H200, 80 GiB of its 141 GiB); with ``--device cpu``, the cpu's."""
    from bigtrain.plan.hardware import local_hardware

    return "cpu" if device == "cpu" else local_hardware()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("speed", "rss", "rss-child", "overlap", "gpu"), default="speed")
    p.add_argument("--preset", default="llama-7b", help="gpu: the model")
    p.add_argument("--hardware", default=None, help="gpu: the planner's profile of the device (default: this "
                                                      "machine's, bigtrain.plan.hardware.local_hardware: h200-141g on "
                                                      "an H200)")
    p.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help="gpu: a profile field for the planner, e.g. host_memory_bytes=134000000000")
    p.add_argument("--global-batch", type=int, default=16, help="gpu: sequences a step (the planner picks the "
                                                                  "micro-batch)")
    p.add_argument("--optim", default="adamw", help="gpu: optim.name (adamw8bit: 2 bytes of state a parameter)")
    p.add_argument("--grad-buckets", type=int, default=4, help="gpu: offload.grad_buckets")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="gpu: 'cpu' runs the GPU path on the CPU (a small --preset; the tests' separate host)")
    p.add_argument("--warmup", type=int, default=2, help="gpu: untimed steps")
    p.add_argument("--delayed", action="store_true", help="gpu: offload.delayed_update = true")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="gpu: dense bf16 peak (default: detected)")
    p.add_argument("--cache-dir", help="gpu: data.cache_dir")
    p.add_argument("--max-bytes", type=int, default=0, help="gpu: data.max_bytes (0: the preset's)")
    p.add_argument("--params", type=int, default=100_000_000)
    p.add_argument("--units", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128, help="overlap: sequence length")
    p.add_argument("--batch", type=int, default=4, help="overlap: sequences per step")
    p.add_argument("--nvme-dir", default=os.path.join(tempfile.gettempdir(), "bigtrain-nvme"))
    p.add_argument("--offload", action="store_true")
    p.add_argument("--offload-only", action="store_true", help="rss: skip the run without offload")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    args.hardware = args.hardware or default_hardware(args.device)
    if args.case == "rss-child":
        _rss_child(args)
        return 0
    if args.case == "gpu" and args.device != "cpu" and not torch.cuda.is_available():
        print("bench_offload --case gpu: no CUDA device: skipped (this case trains on a GPU; --device cpu runs its "
              "path on the CPU for a small --preset; the CPU cases are speed, rss and overlap)")
        return 0
    cases = {"speed": lambda: _speed(args.params, args.units, args.steps), "rss": lambda: _rss(args),
             "overlap": lambda: _overlap(args), "gpu": lambda: _gpu(args)}
    result = cases[args.case]()
    result["checkout"] = common.checkout()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
