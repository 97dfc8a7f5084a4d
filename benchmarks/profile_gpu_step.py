"""Where one training step's device time goes, by kind of kernel: the reading that issue 27's fp8
work needs next (fp8 rowwise was 1.13x the compiled peer on an H200, bf16 compiled 1.16x: the
float8 GEMMs' saving went somewhere).

For each ``--variants`` row (as in bench_gpu.py: eager, compiled, fp8), the trainer of ``--preset``
takes ``--warmup`` steps, then ``--steps`` steps under ``torch.profiler``; every device kernel's time
is summed into a kind by its name:

    gemm (bf16)   cuBLAS / CUTLASS / nvjet matmul kernels that are not float8
    gemm (fp8)    the float8 ones (``_scaled_mm``: names with f8 / fp8 / e4m3 / e5m2, and
                  cuBLAS's nvjet_sm90_qqtst / qrtst kernels on Hopper)
    attention     flash / cuDNN / efficient attention, forward and backward
    fused         Triton kernels inductor generated (norms, rotary, SwiGLU, fp8 quantization),
                  whatever their names say (a quantization kernel's name carries _scaled_mm)
    optimizer     fused AdamW and other multi-tensor kernels
    copy          memcpy / memset / casts that are not inside a fused kernel
    other         the rest (eager elementwise kernels, reductions)

and the report gives each kind's milliseconds per step and share, then the 15 costliest kernels.
Without a CUDA device it prints "no CUDA device: skipped" (``--allow-cpu`` profiles CPU ops instead:
a smoke test of this script, whose kinds mean little there).

    python benchmarks/profile_gpu_step.py --preset llama-1b --variants compiled,fp8 --json prof.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401 - puts this checkout first on the path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_gpu import parse_args as bench_args, pick_device, preset_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.train import Trainer

KINDS = (  # first match wins
    # Inductor names a kernel by the ops it was fused from: one that computes a float8 GEMM's
    # operands is called triton_..._scaled_mm_..., yet the GEMM itself is a library call.
    ("fused", re.compile(r"^triton_|^cpp_fused", re.I)),
    # cuBLAS's float8 kernels on Hopper are nvjet_sm90_qqtst_* (tensorwise) / _qrtst_* (rowwise):
    # read off the H200's profile of 2026-11-28, where only the float8 runs had them.
    ("gemm (fp8)", re.compile(r"f8|fp8|e4m3|e5m2|scaled_mm|nvjet_sm\d+_q", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn.*attn|attention|sdpa", re.I)),
    ("gemm (bf16)", re.compile(r"gemm|cutlass|nvjet|xmma|sm\d+_.*mma|matmul|addmm|\bmm\b", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cast|to_copy", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def profile_variant(preset: str, variant: str, device: str, warmup: int, steps: int) -> dict:
    args = bench_args(["--steps", str(steps), "--warmup", str(warmup)])
    with tempfile.TemporaryDirectory(prefix="profile-gpu-") as run_dir:
        trainer = Trainer(preset_config(preset, args, device, variant), Path(run_dir), Mesh({}), device)
        for _ in range(warmup):
            trainer.train_step()
        activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(steps):
                trainer.train_step()
            if device == "cuda":
                torch.cuda.synchronize()
        del trainer
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if us > 0 and (device != "cuda" or event.device_type == torch.autograd.DeviceType.CUDA):
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e3 / steps  # ms per step
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    # every kernel kept, not only the top: a later classifier can sort an old profile again
    return {"preset": preset, "variant": variant, "ms_per_step": sum(kernels.values()), "kinds": kinds, "top": top,
            "kernels": kernels}


def report(rows: list[dict]) -> None:
    for r in rows:
        total = r["ms_per_step"]
        print(f"\n### {r['preset']} {r['variant']}: {total:.1f} ms of kernels a step\n")
        print("| kind | ms / step | share |\n|---|---|---|")
        for kind, ms in sorted(r["kinds"].items(), key=lambda kv: -kv[1]):
            print(f"| {kind} | {ms:.2f} | {ms / total:.1%} |")
        print("\nCostliest kernels (ms / step):\n")
        for name, ms in r["top"]:
            print(f"- {ms:.2f}  {name[:140]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--variants", default="compiled,fp8")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    device = pick_device("profile_gpu_step", args.allow_cpu)
    if device is None:
        return 0
    rows = [profile_variant(args.preset, v.strip(), device, args.warmup, args.steps)
            for v in args.variants.split(",") if v.strip()]
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
