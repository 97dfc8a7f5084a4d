"""Activation memory options measured: time, saved bytes, offload residency, int8, the fused loss.

Parts (``--part``, default ``time,memory``; ``int8`` is the long one):

- ``time``: step time of the ``small`` preset (one process) with ``memory.checkpointing`` none,
  selective and full, and with offload, int8 and the fused loss alone, in one run: every trainer
  is built first, then timed steps go round the trainers in turn so load from other processes hits
  them alike; the figures are the median seconds per step after ``--warmup`` steps, wall and CPU
  time of this process (``--threads``, default 1: on a shared machine CPU time is the fairer one).
  Afterwards every variant's losses must equal none's (within 1e-6; int8 within 2%), or it exits 1.
- ``memory``: on the same preset, the saved-activation bytes the trainer measures
  (``SavedActivations``, by storage) against the planner's per-micro-batch figure; with offload, the
  most saved bytes resident on the compute device (``OffloadStats.peak_resident``) against one
  block's; int8's compressed inputs against the inputs (bytes); and the fused loss's peak RSS
  against the plain loss's for V = 32000, 8192 tokens, h = 512 (each in a forked process).
- ``int8``: ``--int8-steps`` (default 300) steps of ``small`` exact and with int8 compression: final
  losses, their relative difference, and the relative error of int8's weight gradients at step 0.

    .venv/bin/python benchmarks/bench_activations.py                       # time and memory
    .venv/bin/python benchmarks/bench_activations.py --part int8           # 2 x 300 steps
    .venv/bin/python benchmarks/bench_activations.py --steps 3 --warmup 1 --part time   # smoke
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bigtrain.config import load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.compression import _Int8WeightGrad
from bigtrain.memory.fused_loss import fused_linear_cross_entropy_sum
from bigtrain.parallel.build import token_loss_sum
from bigtrain.plan import ModelSpec, PRESETS, block_activations, estimate_memory
from bigtrain.plan.fit import _layout
from bigtrain.testing import run_ranks
from bigtrain.train import Trainer

VARIANTS = {
    "none": [],
    "selective": ["--memory.checkpointing=selective"],
    "full": ["--memory.checkpointing=full"],
    "offload": ["--memory.activation_offload=true"],
    "int8": ["--memory.activation_compression=int8"],
    "fused_loss": ["--model.fused_loss=true"],
}
BASE = ["--logging.progress=false", "--logging.report=false", "--checkpoint.save_final=false"]


def _trainer(preset: str, overrides: list[str], run_dir: str, extra: list[str] = ()) -> Trainer:
    cfg = load_config(preset=preset, overrides=BASE + list(extra) + overrides)
    return Trainer(cfg, Path(run_dir), Mesh.from_config(cfg.parallel, 0, 1))


def part_time(args, run_dir: str) -> dict:
    trainers = {name: _trainer(args.preset, o, run_dir) for name, o in VARIANTS.items()}
    wall: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    losses: dict[str, list[float]] = {name: [] for name in trainers}
    for step in range(args.warmup + args.steps):
        for name, trainer in trainers.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[name].append(trainer.train_step().loss)
            if step >= args.warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    _check_same_losses(losses)
    out = {}
    for name in trainers:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        out[name] = {"median_step_s": round(w, 4), "vs_none": round(w / statistics.median(wall["none"]), 3),
                     "median_cpu_s": round(c, 4), "cpu_vs_none": round(c / statistics.median(cpu["none"]), 3)}
    return out


def _check_same_losses(losses: dict[str, list[float]]) -> None:
    """The options must not change the numbers: every variant's losses equal none's (fp32: within
    1e-6, the fused loss's chunked sums included), except int8's (approximate, within 2%)."""
    for name, curve in losses.items():
        bound = 2e-2 if name == "int8" else 1e-6
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, losses["none"]))
        if not worst <= bound:
            raise SystemExit(f"{name}: losses differ from none's by {worst:.2e} relative (bound {bound:.0e})")


def _compressed_ratio(trainer: Trainer) -> float:
    """Largest (int8 values + scales) / input bytes over the linears of one step."""
    ratios = []
    original = _Int8WeightGrad.forward

    def watch(ctx, y, weight, bias, q, scale):  # the compressed input x has q's shape and y's dtype
        ratios.append((q.numel() + 4 * scale.numel()) / (q.numel() * y.element_size()))
        return original(ctx, y, weight, bias, q, scale)

    _Int8WeightGrad.forward = staticmethod(watch)
    try:
        trainer.train_step()
    finally:
        _Int8WeightGrad.forward = staticmethod(original)
    return max(ratios)


def part_memory(args, run_dir: str) -> dict:
    out = {}
    for name, overrides in VARIANTS.items():
        trainer = _trainer(args.preset, overrides, run_dir)
        cfg = trainer.cfg
        model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
        planned = estimate_memory(model, _layout(cfg), PRESETS["cpu"], cfg.train.global_batch)
        measured = trainer.train_step(measure=True).mem["activations"]
        row = {"measured_saved_bytes": measured, "planned_saved_bytes": planned.activation_per_microbatch,
               "planned_over_measured": round(planned.activation_per_microbatch / measured, 4)}
        memory = trainer.parallel.activations
        if memory.offloader is not None:
            stats = memory.offloader.stats
            stats.reset_peak()
            trainer.train_step()
            layer = (cfg.train.micro_batch * cfg.data.seq_len
                     * block_activations(model, cfg.precision.mode).per_token())
            row = {"offloaded_bytes_per_step": stats.offloaded // (trainer.step),
                   "peak_resident_bytes": stats.peak_resident, "one_block_bytes": int(layer),
                   "peak_resident_in_blocks": round(stats.peak_resident / layer, 3),
                   "planned_device_bytes": planned.activations,
                   "note": "measured_saved_bytes counts only what no watched module saves (the loss)",
                   **row}
        if name == "int8":
            row["compressed_over_input_bytes_max"] = round(_compressed_ratio(trainer), 4)
        out[name] = row
    plain, fused = run_ranks(_loss_peaks, 1, args.fused_tokens, args.fused_hidden, args.fused_vocab,
                             args.fused_chunk, timeout=1200)[0]
    out["fused_loss_peak_rss"] = {"tokens": args.fused_tokens, "hidden": args.fused_hidden,
                                  "vocab": args.fused_vocab, "chunk": args.fused_chunk,
                                  "plain_mb": round(plain / 2**20, 1), "fused_mb": round(fused / 2**20, 1),
                                  "fused_over_plain": round(fused / plain, 4)}
    return out


def _status(key: str) -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _peak_rss_of(fn) -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM back to the current RSS
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _loss_peaks(rank, world_size, tokens, hidden_size, vocab, chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    losses = {}

    def plain():
        loss = token_loss_sum((hidden @ weight.t()).unsqueeze(0), targets.unsqueeze(0))
        loss.backward()
        losses["plain"] = float(loss.detach())
        hidden.grad = weight.grad = None

    def fused():
        loss = fused_linear_cross_entropy_sum(hidden, weight, targets, chunk)
        loss.backward()
        losses["fused"] = float(loss.detach())
        hidden.grad = weight.grad = None

    peaks = _peak_rss_of(plain), _peak_rss_of(fused)
    assert abs(losses["plain"] - losses["fused"]) <= 1e-5 * abs(losses["plain"]), losses
    return peaks


def part_int8(args, run_dir: str) -> dict:
    extra = [f"--train.steps={args.int8_steps}"]
    exact, int8 = (_trainer(args.preset, VARIANTS[n], run_dir, extra) for n in ("none", "int8"))
    grads = {}
    curves = {"exact": [], "int8": []}
    for step in range(args.int8_steps):
        for name, trainer in (("exact", exact), ("int8", int8)):
            before = (lambda t=trainer, n=name: grads.setdefault(n, t.parallel.full_grads())) if step == 0 else None
            curves[name].append(trainer.train_step(before_update=before).loss)
    errors = {n: float((grads["int8"][n] - g).norm() / g.norm()) for n, g in grads["exact"].items()}
    final = {n: statistics.mean(c[-10:]) for n, c in curves.items()}  # the last 10 steps: less noise
    return {"steps": args.int8_steps, "final_loss_exact": round(curves["exact"][-1], 5),
            "final_loss_int8": round(curves["int8"][-1], 5),
            "final_relative_difference": round(abs(curves["int8"][-1] - curves["exact"][-1]) / curves["exact"][-1], 5),
            "last10_mean_exact": round(final["exact"], 5), "last10_mean_int8": round(final["int8"], 5),
            "grad_relative_error_step0": {"max": round(max(errors.values()), 5),
                                          "median": round(statistics.median(errors.values()), 5),
                                          "worst": max(errors, key=errors.get)},
            "loss_every_50": {n: [round(c[i], 4) for i in range(0, len(c), 50)] for n, c in curves.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="time,memory", help="comma-separated: time, memory, int8")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--int8-steps", type=int, default=300)
    parser.add_argument("--fused-tokens", type=int, default=8192)
    parser.add_argument("--fused-hidden", type=int, default=512)
    parser.add_argument("--fused-vocab", type=int, default=32000)
    parser.add_argument("--fused-chunk", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    parts = {"time": part_time, "memory": part_memory, "int8": part_int8}
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "preset": args.preset}
    with tempfile.TemporaryDirectory(prefix="bench-activations-") as run_dir:
        for name in args.part.split(","):
            start = time.perf_counter()
            result[name] = parts[name](args, run_dir)
            result[name + "_seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps({name: result[name]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
