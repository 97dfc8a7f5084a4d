"""Peak resident memory of each rank while saving and while loading a sharded checkpoint.

A ~100M-parameter Llama (dim 1024, 8 layers, byte vocabulary) at dp=4, ZeRO-3, fp32, in forked Gloo
ranks (``bigtrain.testing.run_ranks``). Each rank trains one step (so the optimizer state exists),
then reads its training-time level: RSS after ``gc.collect()`` and ``malloc_trim(0)`` (from
``/proc/self/statm``). It resets the kernel's peak (``echo 5 > /proc/self/clear_refs`` resets
``VmHWM``), saves, and reads ``VmHWM`` from ``/proc/self/status``: the peak while saving. Then the
same for loading the checkpoint back into the trained engine (the worst case: the old optimizer
state is alive until the loaded one replaces it). The bound of the issue is 16P/4 bytes + 64 MiB
above the training-time level; the script exits with an error when a rank exceeds it.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_checkpoint_memory.py --json ckpt_mem.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bigtrain import checkpoint as ckpt  # noqa: E402
from bigtrain.checkpoint.sharded import ChunkReader  # noqa: E402
from bigtrain.models.llama import count_parameters  # noqa: E402
from bigtrain.testing import run_ranks  # noqa: E402
from helpers import tiny_config, trainer_on_rank  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MODEL = ["--model.dim=1024", "--model.n_layers=8", "--model.n_heads=8", "--model.n_kv_heads=0",
         "--train.micro_batch=1", "--train.global_batch=4", "--data.seq_len=16", "--model.max_seq_len=16"]


def _rss() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _measure(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    base_save = _rss()
    _reset_peak()
    start = time.perf_counter()
    trainer.save()
    save_s = time.perf_counter() - start
    peak_save = _peak()
    path = ckpt.list_checkpoints(trainer.checkpoint_root)[0]
    base_load = _rss()
    _reset_peak()
    start = time.perf_counter()
    trainer.parallel.load_sharded(ChunkReader(path))
    load_s = time.perf_counter() - start
    peak_load = _peak()
    state = sum(trainer.engine.state_bytes().values())
    return {"rank": rank, "base_save": base_save, "peak_save": peak_save, "base_load": base_load,
            "peak_load": peak_load, "state_bytes": state, "save_s": save_s, "load_s": load_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(str(Path(tmp) / "corpus"), *MODEL, f"--parallel.dp={args.ranks}", "--parallel.zero=3")
        from bigtrain.models.llama import build_model
        P = count_parameters(build_model(cfg.model))
        rows = run_ranks(_measure, args.ranks, cfg, str(Path(tmp) / "run"), timeout=1200)
    bound = 16 * P / args.ranks + 64 * 2**20
    mib = 2**20
    print(f"P = {P / 1e6:.1f} M parameters, dp = {args.ranks}, ZeRO-3, fp32; "
          f"bound 16P/{args.ranks} + 64 MiB = {bound / mib:.0f} MiB above the training-time level")
    print("| rank | training-time RSS MiB | save: peak above MiB | load: peak above MiB | save s | load s |")
    print("|---:|---:|---:|---:|---:|---:|")
    ok = True
    for r in rows:
        up_save, up_load = r["peak_save"] - r["base_save"], r["peak_load"] - r["base_load"]
        ok &= up_save <= bound and up_load <= bound
        print(f"| {r['rank']} | {r['base_save'] / mib:.0f} | {up_save / mib:.1f} | {up_load / mib:.1f} | "
              f"{r['save_s']:.1f} | {r['load_s']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"params": P, "ranks": args.ranks, "bound": bound, "rows": rows}, indent=1))
    if not ok:
        print("FAIL: a rank's peak exceeded the bound", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
