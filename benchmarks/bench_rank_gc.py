"""The CPU of ranks forked by ``bigtrain.testing.run_ranks`` with and without ``gc.freeze()`` at the
fork (docs/benchmarks.md, "The extended lane").

A test process that imported torch's compiler holds ~300k objects; a forked rank inherits them, and
each full collection of its own walked them all (and copied the parent's pages to write their
headers). ``run_ranks`` freezes them at the fork. This runs three 2-rank checks (dp2 ZeRO-3, tp2 +
SP, pp2) back to back with the freeze and with it stubbed out, in pairs, and prints the ranks' CPU
seconds (``RUSAGE_CHILDREN``) of each:

    PYTHONPATH=. python benchmarks/bench_rank_gc.py --pairs 5
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import types

import torch
import torch._dynamo  # noqa: F401 - what the test process holds (tests/conftest.py)

import bigtrain.testing as testing
from bigtrain.check.run import check_on_rank
from bigtrain.config import load_config

LAYOUTS = (["--parallel.dp=2", "--parallel.zero=3"], ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
           ["--parallel.pp=2", "--train.micro_batch=2"])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = tempfile.mkdtemp(prefix="bench-rank-gc-")
    base = ["--logging.progress=false", "--logging.report=false", f"--data.cache_dir={cache}",
            "--data.max_bytes=400000", "--checkpoint.save_final=false"]
    cfgs = [load_config(preset="tiny", overrides=base + layout) for layout in LAYOUTS]
    testing.run_ranks(check_on_rank, 2, cfgs[0], tempfile.mkdtemp(), 1)  # the corpus, built once
    real = testing.gc
    stub = types.SimpleNamespace(freeze=lambda: None, unfreeze=lambda: None)
    seconds: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.pairs):
        for name, module in (("without", stub), ("with", real)):
            testing.gc = module
            before = _children_cpu()
            for cfg in cfgs:
                testing.run_ranks(check_on_rank, 2, cfg, tempfile.mkdtemp(), args.steps)
            seconds[name].append(_children_cpu() - before)
    testing.gc = real
    for name, values in seconds.items():
        print(f"{name:>7} gc.freeze: " + " ".join(f"{v:.2f}" for v in values)
              + f"  mean {sum(values) / len(values):.2f} CPU-s")
    lower = sum(w < wo for w, wo in zip(seconds["with"], seconds["without"]))
    print(f"pairs with the freeze lower: {lower} of {args.pairs}")


if __name__ == "__main__":
    main()
