"""HSDP's replica all-reduce on a slow replica link: how much of the link's time the step waits for.

On a cluster the replica axis (``parallel.dp_replicate``) is the inter-node link: each unit's
reduced gradient shard crosses it once per reduction. On one machine Gloo's all-reduce of a small
shard takes well under a millisecond, so this makes that link slow on purpose: each unit's
``replicas`` comm is wrapped (for the measurement only) in a link of ``--link-mbps`` MB/s on which
each all-reduce occupies the link for its sent bytes (2 (R-1)/R of the payload) / bandwidth, one
after another (an all-reduce asked for at t is done at max(t, the previous one's end) + its
time). A synchronous call sleeps until then; an asynchronous one's ``wait`` does. "exposed" is the
time the step slept on the link: the part of the link's work ("busy") the backward did not hide
(the real Gloo collective's own time, mostly ranks waiting for each other, is left out: on a
loaded machine it is skew between the ranks, not the link). Step times are printed too, but on a
shared, oversubscribed CPU (4 ranks on 2 cores) their noise exceeds the difference.

HSDP 2x2 (4 Gloo ranks forked by ``bigtrain.testing.run_ranks``), ZeRO-2, fp32, a Llama of dim 256 x 4
blocks on 64-token sequences, one micro-batch of 4 a rank. Before/after: run it once on this tree and
once with PYTHONPATH on a checkout of the runtime before the overlap (the script's wrapper serves both):

    PYTHONPATH=. .venv/bin/python benchmarks/measure_hsdp_overlap.py --steps 12   (20 s)
    mkdir /tmp/base && git archive a7eab26 | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/measure_hsdp_overlap.py --steps 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch.distributed as dist  # noqa: E402

from bigtrain.testing import run_ranks  # noqa: E402
from helpers import tiny_config, trainer_on_rank  # noqa: E402

MODEL = ["--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--data.seq_len=64", "--model.max_seq_len=64", "--train.micro_batch=4", "--train.global_batch=16",
         "--parallel.dp=4", "--parallel.dp_replicate=2", "--logging.log_every=1000"]


class _Link:
    """One rank's simulated replica link: when it is free again, and what the step waited on it."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s, self.free_at, self.busy, self.exposed = bytes_per_s, 0.0, 0.0, 0.0

    def occupy(self, nbytes: float) -> float:
        """Queue a transfer of ``nbytes``; returns when it is done."""
        seconds = nbytes / self.bytes_per_s
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        self.busy += seconds
        return self.free_at

    def wait_until(self, done: float) -> None:
        left = done - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.exposed += left


class _Slowed:
    """A collective's work handle that is done when the slow link says so."""

    def __init__(self, work, link: _Link, done: float):
        self._work, self._link, self._done = work, link, done

    def wait(self, *args, **kwargs):
        if self._work is not None:
            self._work.wait(*args, **kwargs)
        self._link.wait_until(self._done)

    def __getattr__(self, name):
        return getattr(self._work, name)


class _SlowReplicas:
    """A unit's replica comm whose all-reduces go over ``link``."""

    def __init__(self, comm, link: _Link):
        self._comm, self._link = comm, link

    def all_reduce(self, tensor, *args, async_op: bool = False, **kwargs):
        work = self._comm.all_reduce(tensor, *args, async_op=async_op, **kwargs)
        done = self._link.occupy(2 * (self._comm.size - 1) / self._comm.size * tensor.numel() * tensor.element_size())
        if async_op:
            return _Slowed(work, self._link, done)
        self._link.wait_until(done)
        return work

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _measure(rank: int, world_size: int, cfg, run_dir: str, bytes_per_s: float, warmup: int, steps: int):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    link = _Link(bytes_per_s)
    for unit in trainer.engine.units:
        unit.replicas = _SlowReplicas(unit.replicas, link)
    rows = []
    for i in range(warmup + steps):
        dist.barrier()
        link.busy = link.exposed = 0.0
        start = time.perf_counter()
        trainer.train_step()
        if i >= warmup:
            rows.append((time.perf_counter() - start, link.busy, link.exposed))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--link-mbps", type=float, default=50.0, help="the replica link's MB/s (simulated)")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(str(Path(tmp) / "corpus"), *MODEL, f"--parallel.zero={args.zero}")
        ranks = run_ranks(_measure, 4, cfg, str(Path(tmp) / "run"), args.link_mbps * 1e6, args.warmup, args.steps,
                          timeout=600)
    # a step's figures: the slowest rank's
    step, busy, exposed = (statistics.median(max(r[i][k] for r in ranks) for i in range(args.steps)) for k in range(3))
    print(f"HSDP 2x2 ZeRO-{args.zero}, replica link {args.link_mbps:g} MB/s: replica link busy {busy * 1e3:.0f} ms "
          f"a step, exposed {exposed * 1e3:.0f} ms; step {step * 1e3:.0f} ms (medians of {args.steps}; load "
          f"average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
