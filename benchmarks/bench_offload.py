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
in bf16 with ``offload.optimizer = cpu`` (``--delayed`` adds ``offload.delayed_update``), at the ZeRO
stage, micro-batch and recomputation of the planner's offload fit (what ``bigtrain plan --preset
<preset> --gpus 1 --hardware <--hardware>`` prints after "With offload it fits"; ZeRO-2, micro-batch
2, no recomputation for llama-7b on h100-80g), ``--accum`` micro-batches a step. After ``--warmup``
untimed steps, each of ``--steps`` steps is bracketed by ``torch.cuda.synchronize()``; medians.
Prints tokens/s, MFU (tokens/s x the planner's ``ModelSpec.model_flops_per_token`` / the device's
dense bf16 peak, as benchmarks/bench_gpu.py), the peak device memory
(``torch.cuda.max_memory_allocated``), the host RSS (now and peak) and the bytes the offload copied
each way. Without a CUDA device it says so and exits 0.
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


def _planned_layout(preset: str, hardware: str):
    """The layout of the planner's offload fit for ``preset`` on one GPU of ``hardware`` (the
    search's best layout if the model fits without offload)."""
    from bigtrain.plan.cli import add_plan_parser, resolve
    from bigtrain.plan.search import offload_fit, search

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    plan_args = parser.parse_args(["plan", "--preset", preset, "--gpus", "1", "--hardware", hardware])
    model, cluster, global_batch, fixed = resolve(plan_args)
    result = search(model, cluster, global_batch, fixed, precision="bf16")
    if result.best is None:
        result = offload_fit(model, cluster, global_batch, fixed, "bf16")
    if result is None or result.best is None:
        raise SystemExit(f"bench_offload --case gpu: the planner finds no layout of {preset} for one {hardware}, "
                         f"even with offload")
    return result.best.layout


def _host_rss() -> dict:
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"host_rss_gib": now / 2**30, "host_peak_rss_gib": peak / 2**30}


def _gpu(args) -> dict:
    """Offload on a GPU: one process, bf16, the host optimizer step (see the module's docstring)."""
    from pathlib import Path

    from bench_gpu import detect_peak

    from bigtrain.config import load_config
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.plan.model import ModelSpec
    from bigtrain.train import Trainer
    from bigtrain.validation import validate

    layout = _planned_layout(args.preset, args.hardware)
    peak, peak_source = detect_peak(torch.cuda.get_device_name(), args.peak_tflops)
    seq = load_config(preset=args.preset).data.seq_len
    overrides = ["--precision.mode=bf16", "--train.device=cuda", f"--parallel.zero={max(1, layout.zero)}",
                 f"--train.micro_batch={layout.micro_batch}", f"--train.global_batch={layout.micro_batch * args.accum}",
                 f"--memory.checkpointing={layout.recompute}", f"--memory.checkpoint_every={layout.every}",
                 "--offload.optimizer=cpu", "--offload.params=none",
                 f"--offload.delayed_update={str(args.delayed).lower()}",
                 f"--train.steps={args.warmup + args.steps}", "--logging.progress=false", "--logging.report=false",
                 "--logging.measure_memory=false", "--checkpoint.save_final=false", "--checkpoint.every=0"]
    overrides += [f"--data.cache_dir={args.cache_dir}"] if args.cache_dir else []
    cfg = load_config(preset=args.preset, overrides=overrides)
    validate(cfg, world_size=1, cuda_available=True)
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="bench-offload-gpu-") as run_dir:
        trainer = Trainer(cfg, Path(run_dir), Mesh({}), "cuda")
        losses = [trainer.train_step().loss for _ in range(args.warmup)]
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses.append(trainer.train_step().loss)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        trainer.engine.finish_update()
        copied = trainer.engine.offload.link.counted()
    spec = ModelSpec.from_model_config(cfg.model, seq)
    tokens = cfg.train.global_batch * seq
    median = statistics.median(times)
    tokens_per_s = tokens / median
    return {"device": torch.cuda.get_device_name(), "preset": args.preset, "params": spec.params,
            "planner_layout": layout.to_overrides(), "zero": cfg.parallel.zero, "micro_batch": cfg.train.micro_batch,
            "accum": args.accum, "seq": seq, "recompute": cfg.memory.checkpointing, "delayed_update": args.delayed,
            "tokens_per_step": tokens, "step_s": times, "median_step_s": median, "tokens_per_s": tokens_per_s,
            "flops_per_token": spec.model_flops_per_token(),
            "mfu": tokens_per_s * spec.model_flops_per_token() / peak if peak else None, "peak_source": peak_source,
            "peak_device_memory_gib": torch.cuda.max_memory_allocated() / 2**30, **_host_rss(),
            "bytes_copied": copied, "losses": [round(x, 4) for x in losses]}


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("speed", "rss", "rss-child", "overlap", "gpu"), default="speed")
    p.add_argument("--preset", default="llama-7b", help="gpu: the model")
    p.add_argument("--hardware", default="h100-80g", help="gpu: the planner's profile of the device")
    p.add_argument("--accum", type=int, default=8, help="gpu: micro-batches per step")
    p.add_argument("--warmup", type=int, default=2, help="gpu: untimed steps")
    p.add_argument("--delayed", action="store_true", help="gpu: offload.delayed_update = true")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="gpu: dense bf16 peak (default: detected)")
    p.add_argument("--cache-dir", help="gpu: data.cache_dir")
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
    if args.case == "rss-child":
        _rss_child(args)
        return 0
    if args.case == "gpu" and not torch.cuda.is_available():
        print("bench_offload --case gpu: no CUDA device: skipped (this case trains on a GPU; the CPU cases are "
              "speed, rss and overlap)")
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
