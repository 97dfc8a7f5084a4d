"""One optimizer step of each memory-efficient optimizer against torch's AdamW and the peers' 8-bit
AdamW, on ~50M fp32 parameters shaped like a transformer block, CPU, in one process.

The parameters are one Llama block at width ``d`` chosen so the total is about ``--numel``
(default 50M: d 2048, ffn 5632, as TinyLlama-1.1B's: q, k, v, o 2048 x 2048; gate, up, down
5632 x 2048; two norm gains of 2048, not decayed). Every optimizer gets its own copy of the
parameters and the same gradients (one set, shared; checked unchanged at the end). Optimizers:

- ``adamw fused`` / ``adamw foreach``: ``torch.optim.AdamW``'s two CPU implementations (bigtrain's
  ``adamw`` is the fused one);
- ``adamw8bit``, ``adafactor``, ``lion``: bigtrain's (:mod:`bigtrain.optim`);
- ``torch adafactor``: ``torch.optim.Adafactor`` (the reference of bigtrain's);
- ``torchao adamw8bit`` (``torchao.optim.AdamW8bit``, torch.compile'd per shape: its first step
  compiles and is left out with the warm-up) and ``bnb adamw8bit`` (``bitsandbytes.optim.AdamW8bit``),
  where importable.

Timed steps are interleaved (every optimizer once per round, the order reversed every other round)
so load from other processes hits all alike; the figure is the median ms per step. State bytes
per parameter are measured from the live storages of ``optimizer.state`` (a tensor subclass,
torchao's, counted by its inner tensors) and set against bigtrain's declared figure
(``OptimizerSpec.state_bytes``, the planner's). Each optimizer's total update is compared with
its reference's (``vs``): AdamW fused for the AdamW family, ``torch adafactor`` for Adafactor;
the 8-bit ones differ by their quantization error (a few %), the others by rounding (foreach
AdamW <= 1e-5, Adafactor <= 1e-3 as ``TOLERANCE`` explains; else the script exits 1).
``--profile`` also prints where bigtrain's adamw8bit step spends its time.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_optimizers.py                    # ~50M, 10 steps
    PYTHONPATH=. .venv/bin/python benchmarks/bench_optimizers.py --numel 1000000 --steps 3   # a smoke run
    PYTHONPATH=. .venv/bin/python benchmarks/bench_optimizers.py --only adamw8bit "adamw fused" --profile
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

import common  # noqa: F401 - puts this checkout first on sys.path
import torch

from bigtrain.config import OptimConfig
from bigtrain.memory.accounting import optimizer_tensors, tensor_bytes
from bigtrain.optim import decay_groups, get_optimizer
from bigtrain.optim.adamw import build_adamw_optimizer

# Each optimizer's learning rate on its own scale (the speed does not depend on it).
CONFIGS = {"adamw": OptimConfig(), "adamw8bit": OptimConfig(name="adamw8bit"),
           "adafactor": OptimConfig(name="adafactor", lr=1e-2),
           "lion": OptimConfig(name="lion", lr=3e-4, beta2=0.99, weight_decay=1.0)}


def block_shapes(numel: int) -> dict[str, tuple[int, ...]]:
    """One Llama block (ffn 2.75 x width, both multiples of 64) of about ``numel`` parameters."""
    d = max(64, round(math.sqrt(numel / 12.25) / 64) * 64)
    f = round(2.75 * d / 64) * 64
    return {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (f, d), "w_up": (f, d),
            "w_down": (d, f), "attn_norm": (d,), "ffn_norm": (d,)}


def _ours(name: str):
    return lambda groups: get_optimizer(name).build(groups, CONFIGS[name])


def _adamw(fused: bool):
    return lambda groups: build_adamw_optimizer(groups, CONFIGS["adamw"], fused=fused)


def _torch_adafactor(groups):
    return torch.optim.Adafactor(groups, lr=CONFIGS["adafactor"].lr)


def _torchao(groups):
    from torchao.optim import AdamW8bit

    cfg = CONFIGS["adamw8bit"]
    return AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, block_size=cfg.block_size)


def _bnb(groups):
    import bitsandbytes as bnb

    cfg = CONFIGS["adamw8bit"]
    return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


# name -> (build from param groups, the CONFIGS entry (lr, weight decay), whether it is bigtrain's
# (its declared state bytes shown), reference name or None, the module it needs)
OPTIMIZERS = {
    "adamw fused": (_adamw(True), "adamw", True, None, None),
    "adamw foreach": (_adamw(False), "adamw", False, "adamw fused", None),
    "adamw8bit": (_ours("adamw8bit"), "adamw8bit", True, "adamw fused", None),
    "torchao adamw8bit": (_torchao, "adamw8bit", False, "adamw fused", "torchao"),
    "bnb adamw8bit": (_bnb, "adamw8bit", False, "adamw fused", "bitsandbytes"),
    "adafactor": (_ours("adafactor"), "adafactor", True, "torch adafactor", None),
    "torch adafactor": (_torch_adafactor, "adafactor", False, None, None),
    "lion": (_ours("lion"), "lion", True, None, None),
}
# Largest relative update difference from the reference, where one is enforced (the 8-bit ones
# differ from fp32 AdamW by their code maps: shown, not checked). Adafactor: torch.optim.Adafactor
# takes the parameter's RMS from ``Tensor.norm``, whose fp32 sum over an 11.5M-element matrix on
# CPU is off by 4e-4 relative (bigtrain's, 4e-6 from an fp64 transcription of the same rule).
TOLERANCE = {"adamw foreach": 1e-5, "adafactor": 1e-3}


def importable(module: str | None) -> bool:
    if module is None:
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            __import__(module)
        return True
    except Exception:  # noqa: BLE001 - a peer that is absent or broken is left out, and said so
        return False


def storage_tensors(tensors: list) -> list[torch.Tensor]:
    """Plain tensors behind ``tensors``: a wrapper subclass (torchao's 8-bit state) by its inner ones."""
    out = []
    for t in tensors:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            out += storage_tensors([getattr(t, n) for n in names])
        else:
            out.append(t)
    return out


@torch.no_grad()
def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """||update of a - update of b|| / ||update of b||."""
    num = sum(float(torch.linalg.vector_norm((x - y).double()) ** 2) for x, y in zip(a, b))
    den = sum(float(torch.linalg.vector_norm((y - s).double()) ** 2) for y, s in zip(b, start))
    return math.sqrt(num / den)


def profile_step(optimizer: torch.optim.Optimizer, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000, help="parameters, about (one Llama block's shapes)")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each optimizer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (torchao compiles in its first)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: as one forked rank runs)")
    p.add_argument("--only", nargs="*", help=f"optimizers to run, of: {', '.join(OPTIMIZERS)}")
    p.add_argument("--profile", action="store_true", help="profile one more step of bigtrain's adamw8bit")
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="torch")  # torch.compile's notes on torchao's subclass
    shapes = block_shapes(args.numel)
    gen = torch.Generator().manual_seed(0)
    start = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    grad_sums = {n: float(g.double().sum()) for n, g in grads.items()}
    numel = sum(t.numel() for t in start.values())
    chosen = [n for n in OPTIMIZERS if not args.only or n in args.only]
    skipped = [n for n in chosen if not importable(OPTIMIZERS[n][4])]
    runs = {}
    for name in (n for n in chosen if n not in skipped):
        params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
        for n, p_ in params.items():
            p_.grad = grads[n]
        cfg = CONFIGS[OPTIMIZERS[name][1]]
        groups = decay_groups([p_ for p_ in params.values() if p_.ndim >= 2],
                              [p_ for p_ in params.values() if p_.ndim < 2], cfg)
        runs[name] = {"optimizer": OPTIMIZERS[name][0](groups), "params": list(params.values()), "times": [],
                      "first_step_ms": None}
    load_before = os.getloadavg()[0]
    order = list(runs)
    for step in range(args.warmup + args.steps):
        for name in order if step % 2 == 0 else order[::-1]:
            run = runs[name]
            began = time.perf_counter()
            run["optimizer"].step()
            elapsed = (time.perf_counter() - began) * 1e3
            if step == 0:
                run["first_step_ms"] = elapsed
            if step >= args.warmup:
                run["times"].append(elapsed)
    load_after = os.getloadavg()[0]
    changed = [n for n, g in grads.items() if float(g.double().sum()) != grad_sums[n]]
    if changed:
        print(f"an optimizer changed the shared gradients of {changed}: figures invalid", file=sys.stderr)
        return 1

    base = runs.get("adamw fused")
    failed = False
    rows = []
    for name, run in runs.items():
        _, family, ours, ref, _ = OPTIMIZERS[name]
        measured = tensor_bytes(storage_tensors(optimizer_tensors(run["optimizer"])))
        declared = None
        if ours:
            declared = get_optimizer(family).state_bytes(numel, len(shapes), CONFIGS[family], shapes=shapes.values())
        difference = None
        if ref in runs:
            difference = relative_difference(run["params"], runs[ref]["params"], list(start.values()))
            failed |= name in TOLERANCE and not difference <= TOLERANCE[name]
        median = statistics.median(run["times"])
        rows.append({"optimizer": name, "ms_median": median, "ms_all": run["times"],
                     "first_step_ms": run["first_step_ms"],
                     "over_adamw_fused": median / statistics.median(base["times"]) if base else None,
                     "state_bytes": measured, "state_bytes_per_param": measured / numel,
                     "declared_bytes_per_param": declared / numel if declared is not None else None,
                     "reference": ref if ref in runs else None, "relative_update_difference": difference})

    print(f"optimizer step, {numel:,} fp32 parameters in {len(shapes)} tensors ({shapes['wq'][0]} wide, ffn "
          f"{shapes['w_gate'][0]}), cpu, {args.threads} thread(s), torch {torch.__version__}, {args.steps} timed "
          f"steps interleaved; load average {load_before:.1f} -> {load_after:.1f}")
    print(f"{'optimizer':>18} {'ms/step':>9} {'x fused':>8} {'B/param':>8} {'declared':>9} {'vs':>16} "
          f"{'update diff':>11}")
    for r in rows:
        declared = f"{r['declared_bytes_per_param']:.3f}" if r["declared_bytes_per_param"] is not None else "-"
        ratio = f"{r['over_adamw_fused']:.2f}" if r["over_adamw_fused"] is not None else "-"
        diff = f"{r['relative_update_difference']:.1e}" if r["relative_update_difference"] is not None else "-"
        print(f"{r['optimizer']:>18} {r['ms_median']:>9.1f} {ratio:>8} {r['state_bytes_per_param']:>8.3f} "
              f"{declared:>9} {r['reference'] or '-':>16} {diff:>11}")
    for name in skipped:
        print(f"{name:>18} not run: {OPTIMIZERS[name][4]} is not importable")
    if "torchao adamw8bit" in runs:
        print(f"(torchao's first step, compiling: {runs['torchao adamw8bit']['first_step_ms'] / 1e3:.1f} s)")
    profile = None
    if args.profile and "adamw8bit" in runs:
        profile = profile_step(runs["adamw8bit"]["optimizer"], rows=15)
        print("bigtrain adamw8bit, one step, by operator:\n" + profile)
    if args.json:
        common.write_json(args.json, {
            "args": vars(args), "torch": torch.__version__, "machine": {
                "loadavg_1min_before_after": [load_before, load_after], "checkout": common.checkout()},
            "elements": numel, "shapes": shapes, "optimizers": rows, "skipped": skipped, "adamw8bit_profile": profile})
    if failed:
        print(f"an optimizer's update differs from its reference by more than {TOLERANCE}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
