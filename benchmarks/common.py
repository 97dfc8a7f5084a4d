"""What every benchmark's entry point does: run the ranks once, summarize, print, save JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import subprocess

import torch

# Benchmarks time the checkout they belong to. An editable install of bigtrain points at one
# checkout, and ``python benchmarks/bench_x.py`` puts benchmarks/, not the working directory, on the
# path: without this line a benchmark run in another worktree would time the installed checkout's
# code. Every benchmark imports this module before bigtrain.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [ROOT]:
    sys.path.insert(0, ROOT)

from bigtrain.testing import run_ranks  # noqa: E402


def checkout() -> dict:
    """Which bigtrain this process runs: its directory, and the commit of its checkout (with
    ``dirty`` when tracked files differ from it), for the record of every result."""
    import bigtrain

    path = os.path.dirname(os.path.dirname(os.path.abspath(bigtrain.__file__)))

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", "-C", path, *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"bigtrain": path, "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def run_and_report(rank_main: Callable, args: Any, summarize: Callable, print_report: Callable) -> int:
    """``rank_main`` on ``args.ranks`` forked ranks, then ``summarize(args, results, wall_s)`` -> a
    dict with a ``machine`` entry, ``print_report(args, out)`` and ``--json``. Exit status 1 when a
    rank failed (a traceback, a failed equivalence check, a timeout)."""
    torch.set_num_threads(1)  # the parent stays idle; each forked rank runs one thread
    load_before = os.getloadavg()
    start = time.perf_counter()
    try:
        results = run_ranks(rank_main, args.ranks, args, timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - a rank's traceback, a verification failure, a timeout
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    out = summarize(args, results, time.perf_counter() - start)
    out["machine"]["loadavg_1min_before_after"] = [load_before[0], os.getloadavg()[0]]
    out["machine"]["checkout"] = code = checkout()
    print(f"bigtrain from {code['bigtrain']} at {code['commit']}{' (modified)' if code['dirty'] else ''}")
    print_report(args, out)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def write_json(path: str, out: dict) -> None:
    """``out`` as indented JSON at ``path`` (its folder made if missing): a benchmark's --json."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
