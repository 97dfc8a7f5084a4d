"""Causal load balance of ring attention: each cp rank's attention arithmetic, timed, with the
balanced chunks (rank i holds chunks i and 2cp-1-i) and with a contiguous cut (chunks 2i, 2i+1).

One process times every rank's share in turn on the same core (the ring's steps without their
transfers: ``ring_attention.attend_block`` on the blocks rank r would receive), so the ranks'
times differ only by the work the layout gives them, not by the machine's other load. Repeats are
interleaved (rank 0..cp-1, balanced then contiguous, ``--repeats`` times) and each rank's median
is reported; the headline is the slowest rank's time over the mean. Smoke run (seconds):

    .venv/bin/python benchmarks/bench_context_balance.py --cp 4 --seq 2048 --heads 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bigtrain.parallel.context import chunks_of
from bigtrain.parallel.ring_attention import attend_block


def contiguous(cp: int, rank: int) -> tuple[int, int]:
    return 2 * rank, 2 * rank + 1


def rank_time(q, k, v, cp: int, rank: int, layout) -> float:
    """Seconds of rank ``rank``'s ring forward arithmetic under ``layout`` (chunk size from q)."""
    pieces = [t.chunk(2 * cp, dim=2) for t in (q, k, v)]

    def held(t, r):
        return torch.cat([t[c] for c in layout(cp, r)], dim=2)

    mine = layout(cp, rank)
    qs = held(pieces[0], rank).chunk(2, dim=2)
    blocks = [torch.stack((held(pieces[1], s), held(pieces[2], s))) for s in range(cp)]
    out, lse = [None, None], [None, None]
    start = time.perf_counter()
    for step in range(cp):
        source = (rank - step) % cp
        attend_block(qs, blocks[source], mine, layout(cp, source), q.shape[-1] ** -0.5, out, lse)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.seq, args.head_dim, generator=gen)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, generator=gen) for _ in range(2))
    layouts = {"balanced": chunks_of, "contiguous": contiguous}
    times = {name: [[] for _ in range(args.cp)] for name in layouts}
    for rank in range(args.cp):  # warm-up, untimed: the allocator's first blocks
        for layout in layouts.values():
            rank_time(q, k, v, args.cp, rank, layout)
    for _ in range(args.repeats):
        for rank in range(args.cp):
            for name, layout in layouts.items():
                times[name][rank].append(rank_time(q, k, v, args.cp, rank, layout))
    print(f"cp {args.cp}, seq {args.seq}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, fp32, "
          f"{args.threads} thread(s), median of {args.repeats}")
    for name in layouts:
        medians = [statistics.median(t) * 1e3 for t in times[name]]
        mean = statistics.mean(medians)
        ranks = " ".join(f"{m:.1f}" for m in medians)
        print(f"  {name:10s} per rank ms: {ranks}   slowest / mean = {max(medians) / mean:.3f}")


if __name__ == "__main__":
    main()
