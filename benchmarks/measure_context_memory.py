"""Saved activations per rank and bytes sent over cp in one training step, at several cp degrees,
on the same sequence (the tiny model, 1024 tokens, one micro-batch of one sequence; docs/context-parallel.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/measure_context_memory.py                      # ring
    PYTHONPATH=$PWD .venv/bin/python benchmarks/measure_context_memory.py --parallel.cp_mode=all-to-all

Extra arguments are config overrides. Each degree runs on forked Gloo ranks (bigtrain.testing).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bigtrain.config import load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.testing import run_ranks
from bigtrain.train import Trainer

BASE = ["--logging.progress=false", "--logging.report=false", "--data.max_bytes=400000", "--checkpoint.save_final=false",
        "--train.global_batch=1", "--train.micro_batch=1", "--model.max_seq_len=1024", "--data.seq_len=1024"]


def one_step(rank: int, world_size: int, cfg, run_dir: str):
    trainer = Trainer(cfg, Path(run_dir), Mesh.from_config(cfg.parallel, rank, world_size))
    result = trainer.train_step(measure=True)
    return result.mem["activations"], result.comm_ops.get("cp", {})


def main() -> None:
    overrides = sys.argv[1:]
    one = None
    for cp in (1, 2, 4):
        cfg = load_config(preset="tiny", overrides=[*BASE, *overrides, f"--parallel.cp={cp}"])
        saved, sent = run_ranks(one_step, cp, cfg, tempfile.mkdtemp(), timeout=600)[0]
        one = saved if cp == 1 else one
        sent = {k: int(v) for k, v in sent.items() if not k.startswith(("all_reduce:grads", "all_reduce:metrics"))}
        print(f"cp {cp}: saved activations per rank {saved:,} B ({saved / (one / cp):.4f} of 1/cp); sent over cp {sent}")


if __name__ == "__main__":
    main()
