"""Where the CPU step's time goes, eager against compiled: ``perf`` samples of the trainer's steps,
grouped by what ran (MKL's GEMM, the attention kernel, inductor's generated kernels, ATen's
element-wise kernels, the Python interpreter, ...).

The trainers are ``bench_compile.py``'s (``small`` preset, one process, one thread, fp32): each takes
``--warmup`` steps, then ``perf record`` attaches to this process for ``--steps`` steps of it. perf
samples CPU time, so a loaded machine stretches nothing here but the wall clock (cache contention
still slows memory-bound work); the figure per group is milliseconds of CPU time per step. Needs
``perf`` (linux-tools) and permission to attach to one's own process.

    python benchmarks/profile_compile.py                  # eager and compiled, 10 steps each
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import common  # noqa: F401 - puts this checkout first on the path

import torch

from bench_compile import _trainer

# (group, test on (shared object, symbol)), first match wins.
GROUPS = [
    ("MKL GEMM: kernel", lambda dso, sym: "sgemm_kernel" in sym),
    ("MKL GEMM: packing, scaling C", lambda dso, sym: sym.startswith("mkl_")),
    ("attention (the flash kernel)", lambda dso, sym: "flash_attention" in sym),
    ("exp (Sleef: SiLU, attention's softmax)", lambda dso, sym: "Sleef" in sym),
    ("inductor's generated kernels",
     lambda dso, sym: dso.endswith(".main.so") or re.fullmatch(r"c\w{51}\.so", dso)),
    ("ATen element-wise kernels",
     lambda dso, sym: "Vectorized" in sym or "cat_serial" in sym or "serial_for_each" in sym),
    ("fused AdamW", lambda dso, sym: "fused_adam" in sym),
    ("Python interpreter and bindings", lambda dso, sym: "python" in dso),
    ("OS (page faults, scheduling)", lambda dso, sym: dso == "[kernel.kallsyms]"),
    ("malloc, c10", lambda dso, sym: dso.startswith(("libc.so", "libc10"))),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=10, help="profiled steps of each side (default 10)")
    p.add_argument("--warmup", type=int, default=4, help="steps of each side first (default 4)")
    p.add_argument("--cache-dir", default="", help="data.cache_dir")
    return p.parse_args(argv)


def groups(data: str) -> Counter:
    """Share of the samples in ``data`` per group (percent)."""
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "--stdio",
                             "-g", "none"], capture_output=True, text=True, check=True).stdout
    shares: Counter = Counter()
    for line in report.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)", line)
        if m:
            pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
            shares[next((g for g, test in GROUPS if test(dso, sym)), "other (ATen, dispatch, autograd)")] += pct
    return shares


def profile(args, compiled: bool, tmp: str) -> tuple[float, Counter]:
    """(CPU seconds per step, percent per group) of ``--steps`` steps of one side."""
    trainer = _trainer(args, compiled, f"{tmp}/{'compiled' if compiled else 'eager'}")
    for _ in range(args.warmup):
        trainer.train_step()
    data = f"{tmp}/perf-{'compiled' if compiled else 'eager'}.data"
    perf = subprocess.Popen(["perf", "record", "-F", "2000", "-o", data, "-p", str(os.getpid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    start = time.thread_time()
    for _ in range(args.steps):
        trainer.train_step()
    per_step = (time.thread_time() - start) / args.steps
    perf.send_signal(signal.SIGINT)
    perf.wait()
    return per_step, groups(data)


def main(argv=None) -> int:
    args = parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("profile_compile: needs perf (linux-tools) on the PATH")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="profile-compile-") as tmp:
        results = {side: profile(args, side == "compiled", tmp) for side in ("eager", "compiled")}
    names = sorted({g for _, shares in results.values() for g in shares},
                   key=lambda g: -results["eager"][1].get(g, 0) * results["eager"][0])
    print(f"{args.preset}, CPU ms per step ({args.steps} steps each, load average {os.getloadavg()[0]:.1f}):")
    print("| | eager | compiled |\n|---|---|---|")
    for g in names:
        print(f"| {g} | " + " | ".join(f"{results[s][0] * results[s][1].get(g, 0) * 10:.1f}" for s in results) + " |")
    print("| total | " + " | ".join(f"{results[s][0] * 1e3:.1f}" for s in results) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
