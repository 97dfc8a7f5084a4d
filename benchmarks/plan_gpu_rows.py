"""The planner's step time and peak memory for ``bench_gpu.py``'s rows, on a named hardware profile,
without the GPU: each variant's config as bench_gpu builds it (its ``VARIANTS`` overrides, bf16, the
preset's shape, ``--micro-batch`` x 1), priced as ``bigtrain.run_info.prediction`` prices a finished
row. docs/benchmarks.md puts these beside the H200's measured rows.

    PYTHONPATH=. python benchmarks/plan_gpu_rows.py --preset llama-1b --hardware h200-141g --micro-batch 4
"""

from __future__ import annotations

import argparse

import common  # noqa: F401 - puts this checkout first on the path

from bench_gpu import VARIANTS
from bigtrain.config import load_config
from bigtrain.plan.fit import _layout
from bigtrain.plan.hardware import get_profile
from bigtrain.plan.layout import Cluster
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.search import evaluate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--hardware", default="h200-141g")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--variants", default="eager,compiled,fp8-tensorwise,fp8")
    args = p.parse_args(argv)
    mb = args.micro_batch
    print("| variant | planned step ms | planned peak GiB | compute ms | optimizer step ms |")
    print("|---|---|---|---|---|")
    for variant in args.variants.split(","):
        cfg = load_config(preset=args.preset, overrides=["--precision.mode=bf16", f"--train.micro_batch={mb}",
                                                         f"--train.global_batch={mb}", *VARIANTS[variant]])
        plan = evaluate(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg, True),
                        Cluster.build(1, get_profile(args.hardware)), mb)
        t = plan.time
        print(f"| {variant} | {t.step_time_s * 1e3:.1f} | {plan.memory.peak / 2**30:.2f} | "
              f"{t.breakdown['compute'] * 1e3:.1f} | {t.breakdown['optimizer_step'] * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
