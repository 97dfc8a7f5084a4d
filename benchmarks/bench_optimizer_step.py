"""AdamW step: torch's fused kernel against its foreach implementation, as bigtrain runs them.

bigtrain's AdamW (``bigtrain.optim.adamw``) takes the fused kernel where the device has one and
foreach otherwise. Two shapes of work, both in fp32, in one process:

- ``flat shard``: what the ZeRO engine hands the optimizer: one rank's flat master shard of
  ``--numel`` elements (default 50M) in two pieces, decayed and not (99% / 1%);
- ``tiny model``: what the replicated engine hands it: every parameter of a preset's model
  (``--preset``, default tiny), one tensor each.

Both optimizers start from the same parameters and take the same gradients; timed steps alternate
(fused, foreach, foreach, fused, ...) so load from other processes hits both alike; the figure is
the median ms per step. After the last step the script checks that the two agree (relative
difference of their total updates <= 1e-5) and exits 1 otherwise. ``--device cuda`` runs the same
on a GPU.

    .venv/bin/python benchmarks/bench_optimizer_step.py                 # both cases
    .venv/bin/python benchmarks/bench_optimizer_step.py --numel 1000000 --steps 5   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bigtrain.config import OptimConfig, load_config
from bigtrain.models.llama import build_model, init_value
from bigtrain.optim import decay_groups, get_optimizer
from bigtrain.optim.adamw import build_adamw_optimizer, fused_available


def _flat_shard(numel: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(decayed pieces, non-decayed pieces) of one flat shard, as the ZeRO engine cuts it."""
    master = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02
    cut = int(numel * 0.99)
    return [master[:cut]], [master[cut:]]


def _model_params(preset: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cfg = load_config(preset=preset)
    model = build_model(cfg.model)
    params = [init_value(n, tuple(p.shape), cfg.train.seed, cfg.model) for n, p in model.named_parameters()]
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def _copies(pieces: tuple[list[torch.Tensor], list[torch.Tensor]], device: torch.device) -> tuple[list, list]:
    return tuple([torch.nn.Parameter(t.to(device, copy=True)) for t in group] for group in pieces)


def _with_grads(decay: list, no_decay: list) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in decay + no_decay:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _relative_difference(a: list[torch.Tensor], b: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """||update of a - update of b|| / ||update of b|| over all tensors: the updates, not the
    weights, so the initial values cannot hide a difference."""
    num = sum(float(torch.linalg.vector_norm((x - y).double()) ** 2) for x, y in zip(a, b))
    den = sum(float(torch.linalg.vector_norm((y.cpu() - s).double()) ** 2) for y, s in zip(b, start))
    return (num / den) ** 0.5


def bench_case(name: str, pieces, args, steps: int) -> dict:
    cfg, device = OptimConfig(), torch.device(args.device)
    runs = {}
    for kind in ("fused", "foreach"):
        decay, no_decay = _copies(pieces, device)
        _with_grads(decay, no_decay)
        optimizer = build_adamw_optimizer(decay_groups(decay, no_decay, cfg), cfg, fused=kind == "fused")
        runs[kind] = (optimizer, decay + no_decay, [])
    order = ["fused", "foreach"]
    for step in range(args.warmup + steps):
        for kind in order if step % 2 == 0 else order[::-1]:
            optimizer, _, times = runs[kind]
            _sync(device)
            start = time.perf_counter()
            optimizer.step()
            _sync(device)
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times.append(elapsed * 1e3)
    difference = _relative_difference(runs["fused"][1], runs["foreach"][1], pieces[0] + pieces[1])
    numel = sum(p.numel() for p in runs["fused"][1])
    out = {"case": name, "elements": numel, "tensors": len(runs["fused"][1]),
           "relative_update_difference": difference}
    for kind, (_, _, times) in runs.items():
        out[f"{kind}_ms_median"] = statistics.median(times)
        out[f"{kind}_ms_all"] = times
    out["foreach_over_fused"] = out["foreach_ms_median"] / out["fused_ms_median"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000, help="elements of the flat shard")
    p.add_argument("--preset", default="tiny", help="the model whose parameters form the second case")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each optimizer on the flat shard")
    p.add_argument("--model-steps", type=int, default=200, help="timed steps of each on the model")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: as one forked rank runs)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    cases = [bench_case(f"flat shard {args.numel / 1e6:g}M", _flat_shard(args.numel), args, args.steps),
             bench_case(f"{args.preset} model", _model_params(args.preset), args, args.model_steps)]
    chosen = "fused" if fused_available(torch.device(args.device)) else "foreach"
    print(f"AdamW step, fp32, {args.device}, {args.threads} thread(s), torch {torch.__version__}; bigtrain's "
          f"'{get_optimizer('adamw').name}' picks {chosen} here; load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'case':>20} {'elements':>12} {'tensors':>8} {'fused ms':>9} {'foreach ms':>11} {'foreach/fused':>14} "
          f"{'update diff':>11}")
    failed = False
    for c in cases:
        print(f"{c['case']:>20} {c['elements']:>12,} {c['tensors']:>8} {c['fused_ms_median']:>9.2f} "
              f"{c['foreach_ms_median']:>11.2f} {c['foreach_over_fused']:>14.2f} "
              f"{c['relative_update_difference']:>11.1e}")
        failed |= not c["relative_update_difference"] <= 1e-5
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "cases": cases}, f, indent=1)
    if failed:
        print("fused and foreach AdamW differ by more than 1e-5", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
