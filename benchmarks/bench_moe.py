"""One MoE layer's step (forward + backward): grouped GEMM vs the per-expert loop vs a dense SwiGLU of
equal active parameters, in one run.

The MoE layer is bigtrain's ``MoEFeedForward`` (fp32 router, softmax top-k, dropless): E experts of
SwiGLU size F, each token through top_k of them. The dense peer is the model's ``FeedForward`` of
size top_k x F: the same multiply-adds per token (3 x dim x top_k F), no routing. The three are
built first and timed in turn, round after round (so load from other processes hits them alike);
the figures are medians of wall and CPU time of this process (``--threads``, default 1: on a shared
machine CPU time is the fairer one). Before timing, grouped GEMM's outputs and gradients must equal
the loop's within 1e-5 relative (or it exits 1).

    .venv/bin/python benchmarks/bench_moe.py                          # dim 256, F 512, E 8, top-2, 4096 tokens
    .venv/bin/python benchmarks/bench_moe.py --rounds 3 --warmup 1    # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bigtrain.models.feed_forward import FeedForward
from bigtrain.models.moe import LocalExperts, MoEFeedForward


def _moe(dim: int, hidden: int, experts: int, top_k: int, grouped: bool, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(dim, hidden, experts, top_k)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, dim ** -0.5)
    layer.dispatcher = LocalExperts(grouped)
    return layer


def _step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    layer(x).square().mean().backward()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_grouped_equals_loop(loop: MoEFeedForward, grouped: MoEFeedForward, x: torch.Tensor) -> float:
    """Largest relative difference of outputs and gradients (the two share their weights' values)."""
    worst = 0.0
    out_loop, out_grouped = loop(x), grouped(x)
    worst = max(worst, _relative(out_grouped, out_loop))
    _step(loop, x)
    _step(grouped, x)
    for (name, a), (_, b) in zip(grouped.named_parameters(), loop.named_parameters()):
        worst = max(worst, _relative(a.grad, b.grad))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="each expert's SwiGLU size F")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="batch x sequence of one micro-batch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    x = torch.randn(args.tokens // args.seq, args.seq, args.dim, generator=torch.Generator().manual_seed(1))
    variants = {
        "moe grouped GEMM": _moe(args.dim, args.hidden, args.experts, args.top_k, grouped=True),
        "moe loop over experts": _moe(args.dim, args.hidden, args.experts, args.top_k, grouped=False),
        f"dense SwiGLU {args.top_k * args.hidden}": FeedForward(args.dim, args.top_k * args.hidden),
    }
    names = list(variants)
    try:
        worst = check_grouped_equals_loop(variants[names[1]], variants[names[0]], x)
    except (RuntimeError, NotImplementedError) as e:  # torch._grouped_mm not on this build / device
        print(f"bench_moe: grouped GEMM does not run here ({e}); only the loop and dense are timed")
        del variants[names[0]]
        names, worst = names[1:], 0.0
    if worst > 1e-5:
        print(f"bench_moe: grouped GEMM differs from the loop by {worst:.2e} (> 1e-5)")
        return 1
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        for name in names:
            w0, c0 = time.perf_counter(), time.process_time()
            _step(variants[name], x)
            if r >= args.warmup:
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
    dense = names[-1]
    flops = 6 * args.tokens * 3 * args.dim * args.top_k * args.hidden  # forward 2, backward 4, per multiply-add
    print(f"MoE layer: dim {args.dim}, {args.experts} experts of F = {args.hidden}, top-{args.top_k}, "
          f"{args.tokens} tokens, {args.threads} thread(s), median of {args.rounds} rounds after {args.warmup}")
    print(f"{'variant':<26}{'wall ms':>10}{'cpu ms':>10}{'cpu / dense':>13}{'GFLOP/s (cpu)':>15}")
    figures = {}
    for name in names:
        w, c = statistics.median(wall[name]) * 1e3, statistics.median(cpu[name]) * 1e3
        ratio = c / (statistics.median(cpu[dense]) * 1e3)
        figures[name] = {"wall_ms": w, "cpu_ms": c, "cpu_vs_dense": ratio, "gflops_cpu": flops / (c / 1e3) / 1e9}
        print(f"{name:<26}{w:>10.2f}{c:>10.2f}{ratio:>13.2f}{figures[name]['gflops_cpu']:>15.1f}")
    print(f"grouped GEMM vs loop: outputs and gradients within {worst:.1e} relative")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "figures": figures, "grouped_vs_loop": worst}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
