"""Peak resident memory of a ZeRO training step with the fp32 gradients kept for the whole run and
with them freed between steps (bigtrain/parallel/zero/lazy_grads.py), and the planner's peaks.

A Llama of dim 768 x 8 blocks (byte vocabulary, ~57M parameters), bf16 with fp32 masters and AdamW,
ZeRO stage 0/1/2, one rank, one micro-batch of 2 x 256 tokens (fp32 gradients 194 MiB, saved
activations 132 MiB: with the gradients lazy, the peak is the end of the backward). Each variant runs in its own forked process (``bigtrain.testing.run_ranks``), trains
one step (the optimizer's state exists from then on), returns freed heap pages to the OS and maps
every allocation of 128 KiB or more afresh (so a freed buffer leaves the RSS), resets the kernel's
peak (``echo 5 > /proc/self/clear_refs``) and reads ``VmHWM`` after the next step: the step's peak
resident bytes. "kept" is the engine as it was (every unit's fp32 gradient buffer allocated for the
run; selected here by replacing the engine's choice, for the measurement only).

    PYTHONPATH=. .venv/bin/python benchmarks/measure_grad_memory.py   (16 minutes on a shared 2-core CPU)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bigtrain.plan import PRESETS, Layout, ModelSpec, estimate_memory  # noqa: E402
from bigtrain.testing import run_ranks  # noqa: E402
from helpers import tiny_config, trainer_on_rank  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
MODEL = ["--model.dim=768", "--model.n_layers=8", "--model.n_heads=12", "--model.n_kv_heads=4",
         "--data.seq_len=256", "--model.max_seq_len=256", "--train.micro_batch=2", "--train.global_batch=2",
         "--precision.mode=bf16"]
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _measure(rank, world_size, cfg, run_dir, lazy):
    if not lazy:
        import bigtrain.parallel.zero.engine as engine_module
        from bigtrain.parallel.zero.lazy_grads import KeptGrads

        engine_module.gradient_buffers = lambda *args: KeptGrads()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    gc.collect()
    libc.malloc_trim(0)
    between = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    trainer.train_step()
    return {"between_steps": between, "step_peak": _status("VmHWM"), "grads": trainer.engine.state_bytes()["grads"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="0,1,2")
    args = parser.parse_args()
    mib = 2**20
    print("| ZeRO | fp32 grads | RSS between steps MiB | step peak RSS MiB | planner peak MiB (kept -> lazy) |")
    print("|---:|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (int(s) for s in args.stages.split(",")):
            cfg = tiny_config(str(Path(tmp) / "corpus"), *MODEL, f"--parallel.zero={stage}")
            layout = Layout(zero=stage, precision="bf16", micro_batch=cfg.train.micro_batch)
            pred = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), layout,
                                   PRESETS["cpu"], cfg.train.global_batch)
            kept_peak = dataclasses.replace(pred, lazy_grads=None).peak  # the planner's rule for kept gradients
            for lazy in (False, True):
                row, = run_ranks(_measure, 1, cfg, str(Path(tmp) / f"run{stage}{lazy}"), lazy, timeout=1200)
                plan = pred.peak if lazy else kept_peak
                print(f"| {stage} | {'lazy' if lazy else 'kept'} | {row['between_steps'] / mib:.0f} | "
                      f"{row['step_peak'] / mib:.0f} | {plan / mib:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
