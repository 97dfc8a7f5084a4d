"""What every benchmark's entry point does: run the ranks once, summarize, print, save JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import torch

from bigtrain.testing import run_ranks


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
    print_report(args, out)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
