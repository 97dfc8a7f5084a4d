"""One compiled llama block, forward and backward, with float8 linears: where the quantization's time goes.

Issue 27 wants ``precision.fp8 = "rowwise"`` at >= 1.30x the compiled transformers peer on one
H100/H200; on an H200 the float8 GEMMs saved 29 ms a step and inductor's quantization kernels took
23 ms (tensorwise) to 34 ms (rowwise) of it back (docs/precision.md, "Performance"). This times the
part that changed: one block of ``--preset`` (bigtrain's ``TransformerBlock``, its weights in bf16
as the trainer's compute copies are, the fp32 rotary tables, ``--batch`` x ``--seq`` tokens),
wrapped in the trainer's ``CompiledRegion`` with the trainer's inductor options, its forward and
backward (input and weight gradients, from a fixed output gradient) timed with CUDA events (median
of ``--iters`` after ``--warmup``), then profiled to split the device time into Triton kernels
(norms, rotary, SwiGLU, the float8 quantization), float8 GEMMs, bf16 GEMMs, attention and the rest.

Variants: ``bf16`` (no float8), and for each recipe the current formulation (bigtrain/fp8) and
the previous one (``benchmarks/fp8_previous.py``; bit for bit the same float8 values and results,
more passes over memory): ``tensorwise-previous``, ``tensorwise``, ``rowwise-previous``,
``rowwise``; and ``rowwise-features``, an experiment (``benchmarks/fp8_feature_scaled.py``: x and dY
quantized once per feature, the scales folded into the weight operands; rowwise's results bit for
bit where no value is subnormal). Each variant's output and gradients are also measured against the
block computed in fp32, on the random input and on one with outlier features and massive first
tokens (where the scalings' windows of exponents differ). Without a CUDA device it prints "no CUDA device: skipped"; ``--allow-cpu`` runs it on
the CPU (the ``tiny`` preset, 2 x 64 tokens, float8 emulated: a smoke test of this script; the
times there say little about a GPU).

    python benchmarks/bench_fp8_block.py --json runs/bench/fp8_block.json     # GPU: llama-1b, 4 x 2048 (~1-2 min)
    python benchmarks/bench_fp8_block.py --allow-cpu                          # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import common  # noqa: F401 - puts this checkout first on the path

import torch
from torch.profiler import ProfilerActivity, profile

from bigtrain.config import load_config
from bigtrain.fp8.linear import convert_to_float8, float8_backend
from bigtrain.fp8.scaling import Float8Recipe
from bigtrain.models.llama import build_model, init_value
from bigtrain.models.rope import rotary_tables_for
from bigtrain.parallel.compile import CompiledRegion, CompileFallbackWarning, inductor_options
from fp8_feature_scaled import use_feature_scaled
from fp8_previous import use_previous_formulation
from profile_gpu_step import kind_of as step_kind_of

SKIPPED = "no CUDA device: skipped"  # what the GPU lane's scripts print without one (bench_gpu.py)
VARIANTS = ("bf16", "tensorwise-previous", "tensorwise", "rowwise-previous", "rowwise", "rowwise-features")
# How each variant's formulation is put in after the swap (the current one: nothing to do)
FORMULATIONS = {"previous": use_previous_formulation, "features": use_feature_scaled}

# Device kernels by kind as the step's profile sorts them (its classifier: "fused" is inductor's Triton
# kernels, whatever ops they fused); optimizer and copy kernels count as other here
TABLE_KINDS = ("fused", "gemm (fp8)", "gemm (bf16)", "attention")


def kind_of(name: str) -> str:
    kind = step_kind_of(name)
    return kind if kind in TABLE_KINDS else "other"


def build_block(preset: str, variant: str, device: str):
    """(block, cos, sin): layer 0 of ``preset``'s Llama in bf16 on ``device``, its linears float8
    as ``variant`` says, initialized as the model initializes it."""
    cfg = load_config(preset=preset).model
    model = build_model(cfg)  # on the meta device: only the block is materialized below
    if variant != "bf16":
        scaling, _, formulation = variant.partition("-")
        convert_to_float8(model, Float8Recipe(scaling), float8_backend(device, emulate=device != "cuda"))
        if formulation:
            FORMULATIONS[formulation](model.layers[0])
    block = model.layers[0].to_empty(device=device)
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.copy_(init_value(f"layers.0.{name}", tuple(param.shape), 0, cfg))
    cos, sin = rotary_tables_for(cfg, device)
    return block.to(torch.bfloat16), cos, sin


def run_variant(preset: str, variant: str, device: str, batch: int, seq: int, warmup: int, iters: int,
                profiled: int) -> dict:
    torch._dynamo.reset()
    block, cos, sin = build_block(preset, variant, device)
    dim = block.attention_norm.weight.shape[0]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq, dim, device=device, generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(batch, seq, dim, device=device, generator=gen).bfloat16() * 1e-3
    exact = fp32_results(preset, device, x, grad, cos, sin)
    x_outliers = with_outliers(x)
    exact_outliers = fp32_results(preset, device, x_outliers, grad, cos, sin)
    region = CompiledRegion(block, options=inductor_options(device, sixteen_bit=True))
    params = list(block.parameters())
    cuda = device == "cuda"

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        region(x, cos[:seq], sin[:seq]).backward(grad)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    step()  # compiles the forward and (CompiledRegion) the backward
    sync()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            begin_s = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin_s) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            step()
        sync()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (not cuda or event.device_type == torch.autograd.DeviceType.CUDA):
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e3 / profiled  # ms per step
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
    triton = sorted(((n, ms) for n, ms in kernels.items() if kind_of(n) == "fused"), key=lambda kv: -kv[1])
    out = {"variant": variant, "median_ms": statistics.median(times), "min_ms": min(times),
           "max_ms": max(times), "compile_s": compile_s, "kernel_ms": sum(kernels.values()), "kinds": kinds,
           "top_triton": triton[:8], "errors": errors_against(exact, region, block, x, grad, cos, sin),
           "errors_outliers": errors_against(exact_outliers, region, block, x_outliers, grad, cos, sin)}
    del region, block, x, grad
    if cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def with_outliers(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a trained model's kinds of outliers: every 64th feature 64x (outlier channels, which
    the attention norm passes on) and each sequence's first token 256x (a massive activation, which
    the norm scales back but the residual carries): where the scalings' windows of float8 exponents
    differ."""
    out = x.detach().clone()
    out[..., ::64] *= 64
    out[:, 0] *= 256
    return out.requires_grad_()


def fp32_results(preset: str, device: str, x: torch.Tensor, grad: torch.Tensor, cos, sin) -> dict[str, torch.Tensor]:
    """The block's output, input gradient and weight gradients computed eagerly in fp32 from the same
    weights (the bf16 ones, widened), input and output gradient: what each variant's error is of."""
    block, _, _ = build_block(preset, "bf16", device)
    block = block.float()
    x32 = x.detach().float().requires_grad_()
    out = block(x32, cos[:x.shape[1]], sin[:x.shape[1]])
    out.backward(grad.float())
    found = {"output": out.detach(), "input grad": x32.grad}
    found.update({f"{n} grad": p.grad for n, p in block.named_parameters()})
    return found


def errors_against(exact: dict[str, torch.Tensor], region, block, x, grad, cos, sin) -> dict[str, float]:
    """Each of the block's results relative to the fp32 ones (|a - b| / |b| over the whole tensor):
    the output, the input gradient, and the largest and median of the weight gradients'."""
    x.grad = None
    for p in block.parameters():
        p.grad = None
    out = region(x, cos[:x.shape[1]], sin[:x.shape[1]])
    out.backward(grad)
    mine = {"output": out.detach(), "input grad": x.grad}
    mine.update({f"{n} grad": p.grad for n, p in block.named_parameters()})

    def rel(a, b):
        return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))

    weights = sorted(rel(mine[k], exact[k]) for k in exact if k not in ("output", "input grad"))
    return {"output": rel(mine["output"], exact["output"]), "input grad": rel(mine["input grad"], exact["input grad"]),
            "weight grads max": weights[-1], "weight grads median": statistics.median(weights)}


def report(result: dict) -> None:
    rows = result["results"]
    base = next((r["median_ms"] for r in rows if r["variant"] == "bf16"), None)
    print(f"\n{result['preset']} block, {result['batch']} x {result['seq']} tokens, forward + backward, compiled, on "
          f"{result['device_name']} (torch {result['torch']}); median of {result['iters']} after {result['warmup']}; "
          f"kernel times: ms per step from torch.profiler over {result['profiled']} steps\n")
    kinds = (*TABLE_KINDS, "other")
    print("| variant | median ms | vs bf16 | compile s | " + " | ".join(f"{k} ms" for k in kinds) + " |")
    print("|---|---|---|---|" + "---|" * len(kinds))
    for r in rows:
        ratio = f"{base / r['median_ms']:.2f}x" if base else "-"
        cells = " | ".join(f"{r['kinds'].get(k, 0.0):.2f}" for k in kinds)
        print(f"| {r['variant']} | {r['median_ms']:.2f} | {ratio} | {r['compile_s']:.0f} | {cells} |")
    for key, title in (("errors", "random normal input"), ("errors_outliers", "input with outliers")):
        print(f"\nError against the block in fp32, {title} (whole-tensor relative):\n")
        print("| variant | output | input grad | weight grads, largest | weight grads, median |")
        print("|---|---|---|---|---|")
        for r in rows:
            e = r[key]
            print(f"| {r['variant']} | {e['output']:.2e} | {e['input grad']:.2e} | {e['weight grads max']:.2e} | "
                  f"{e['weight grads median']:.2e} |")
    by_name = {r["variant"]: r for r in rows}
    for scaling in ("tensorwise", "rowwise"):
        new, old = by_name.get(scaling), by_name.get(f"{scaling}-previous")
        if new and old:
            print(f"\n- {scaling}: {old['median_ms']:.2f} -> {new['median_ms']:.2f} ms a block "
                  f"({old['median_ms'] - new['median_ms']:+.2f}); Triton kernels {old['kinds'].get('fused', 0):.2f} -> "
                  f"{new['kinds'].get('fused', 0):.2f} ms")
    for r in rows:
        if r["top_triton"]:
            print(f"\nCostliest Triton kernels, {r['variant']} (ms per step):\n")
            for name, ms in r["top_triton"]:
                print(f"- {ms:.3f}  {name[:150]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help="default llama-1b on a GPU, tiny with --allow-cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=None, help="default 4 on a GPU, 2 on the CPU")
    p.add_argument("--seq", type=int, default=None, help="default 2048 on a GPU, 64 on the CPU")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        device = "cuda"
    elif args.allow_cpu:
        device = "cpu"
    else:
        print(f"bench_fp8_block: {SKIPPED}")
        return 0
    cuda = device == "cuda"
    preset = args.preset or ("llama-1b" if cuda else "tiny")
    batch, seq = args.batch or (4 if cuda else 2), args.seq or (2048 if cuda else 64)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (use {', '.join(VARIANTS)})")
    warnings.simplefilter("error", CompileFallbackWarning)  # an eager fallback would time the wrong thing
    results = []
    for variant in variants:
        results.append(run_variant(preset, variant, device, batch, seq, args.warmup, args.iters, args.profiled))
        print(f"{variant}: {results[-1]['median_ms']:.2f} ms (compiled in {results[-1]['compile_s']:.0f} s)",
              flush=True)
    result = {"preset": preset, "batch": batch, "seq": seq, "device": device,
              "device_name": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__,
              "warmup": args.warmup, "iters": args.iters, "profiled": args.profiled, "results": results,
              "checkout": common.checkout()}
    report(result)
    if args.json:
        common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
