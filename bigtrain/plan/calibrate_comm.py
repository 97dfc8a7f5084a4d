"""This machine's collectives, measured the way training calls them, for the planner's links.

``bigtrain bench --calibrate`` forks ``ranks`` Gloo ranks (one intra-op thread each, as torchrun's)
and measures, taking the median of ``repeats`` timings and the slowest rank:

* **Bandwidth per collective.** The ring all-reduce's bus bandwidth from a large buffer, and how fast
  reduce-scatter and all-gather move their (n-1)/n share against it (``reduce_scatter_efficiency``,
  ``all_gather_efficiency``). NCCL runs the three at one bus bandwidth; Gloo's reduce-scatter here
  took 1.6x an all-reduce of the same buffer, half the bytes (2026-11-23, 2 ranks, 3.7 MB).
* **Latency in place.** A layer's collective follows its GEMMs: the ranks arrive at slightly
  different times, and where every core computes, Gloo's transport threads wait for one. Timing
  tiny all-reduces back to back misses that (0.2-0.4 ms here) while training paid 1.2-2.2 ms for
  each small synchronous all-reduce (the loss, the norm, the signal agreement; counted by wrapping
  the Comm, dp 2, 2026-11-23); the measurement times a loop of compute bursts as long as a CPU
  micro-batch's forward (``burst_s``, 50 ms) each followed by a tiny all-reduce, minus the bursts
  alone.
* **Overlap.** ``comm_overlap``: how much of a large all-reduce started asynchronously hides behind
  compute on the same rank. On a GPU the copy engines and NCCL's kernels run beside the GEMMs
  (the profiles' 0.9); on a CPU whose cores all compute, Gloo's threads take the cycles from them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class CollectiveRates:
    bandwidth: float  # all-reduce bus bandwidth, bytes/s
    latency_s: float  # per (1 + log2 n) of a collective, as links.Link charges it
    reduce_scatter_efficiency: float
    all_gather_efficiency: float
    comm_overlap: float

    def profile_fields(self) -> dict[str, float]:
        """These rates as the hardware profile's fields (the link inside a node)."""
        return dict(intra_node_bandwidth=self.bandwidth, intra_node_latency_s=self.latency_s,
                    reduce_scatter_efficiency=self.reduce_scatter_efficiency,
                    all_gather_efficiency=self.all_gather_efficiency, comm_overlap=self.comm_overlap)

    def describe(self, ranks: int, nbytes: int) -> str:
        return (f"Gloo collectives of {nbytes / MIB:.0f} MiB over {ranks} forked ranks: all-reduce "
                f"{self.bandwidth / 1e9:.2f} GB/s, reduce-scatter x{self.reduce_scatter_efficiency:.2f}, "
                f"all-gather x{self.all_gather_efficiency:.2f} of it; latency after compute "
                f"{self.latency_s * 1e3:.2f} ms per (1 + log2 n); overlap with compute {self.comm_overlap:.2f}")


def _median(fn, repeats: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collectives_rank(rank: int, world: int, nbytes: int, repeats: int, burst_s: float) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from bigtrain.distributed.comm import all_gather_single, reduce_scatter_single

    torch.set_num_threads(1)
    shard_numel = max(1, nbytes // 4 // world)
    full, shard, tiny = torch.ones(shard_numel * world), torch.ones(shard_numel), torch.ones(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def burst(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    ops = {"all_reduce": lambda: dist.all_reduce(full),
           "reduce_scatter": lambda: reduce_scatter_single(shard, full),
           "all_gather": lambda: all_gather_single(full, shard),
           "tiny": lambda: dist.all_reduce(tiny)}
    for op in ops.values():  # connections and buffers
        op()
    out = {name: _median(op, repeats) for name, op in ops.items()}
    # Bursts of compute as long as a CPU micro-batch's forward or backward (~50 ms), each followed
    # by a tiny all-reduce, in a loop with no barrier between them, as training calls its
    # collectives: the cost beyond the bursts alone. The longer the compute between two
    # collectives, the further apart the ranks arrive (0.4-0.6 ms after 1 ms bursts, 0.7-1.9 ms
    # after 20 ms, 0.7-3.1 ms after 50 ms; 2 ranks, 2026-11-23).
    gemm = _median(lambda: burst(4), repeats) / 4
    short = max(1, round(burst_s / max(gemm, 1e-9)))
    loop = 6

    def extra() -> float:  # one loop with the collectives less one without, back to back: drift cancels
        with_collectives = _median(lambda: [(burst(short), dist.all_reduce(tiny)) for _ in range(loop)], 1)
        return with_collectives - _median(lambda: burst(short * loop), 1)

    out["after_compute"] = max(0.0, statistics.median(extra() for _ in range(9))) / loop
    # As much compute as the all-reduce takes, alone, and with the all-reduce running beside it.
    long = max(1, round(out["all_reduce"] / max(gemm, 1e-9)))
    out["compute"] = _median(lambda: burst(long), repeats)
    out["both"] = _median(lambda: (work := dist.all_reduce(full, async_op=True), burst(long), work.wait()),
                          repeats)
    return out


def measure_collectives(ranks: int = 2, nbytes: int = 16 * MIB, repeats: int = 7, burst_s: float = 50e-3,
                        trials: int = 3) -> CollectiveRates:
    """The rates of :class:`CollectiveRates` over ``ranks`` local Gloo ranks (the slowest rank's),
    each timing the median of ``trials`` separate measurements: on a shared machine a few seconds
    of someone else's load once turned a 1.2 ms latency into 7 ms."""
    from bigtrain.testing import run_ranks

    per_trial = []
    for _ in range(trials):
        results = run_ranks(_collectives_rank, ranks, nbytes, repeats, burst_s, timeout=600.0)
        per_trial.append({key: max(r[key] for r in results) for key in results[0]})
    t = {key: statistics.median(trial[key] for trial in per_trial) for key in per_trial[0]}
    share = (ranks - 1) / ranks
    moved = share * (nbytes // 4 // ranks) * ranks * 4  # bytes a rank sends in reduce-scatter or all-gather

    def rate(seconds: float, nbytes_moved: float) -> float:
        return nbytes_moved / max(seconds - t["tiny"], 1e-9)

    bandwidth = rate(t["all_reduce"], 2 * moved)
    hidden = t["all_reduce"] + t["compute"] - t["both"]
    return CollectiveRates(
        bandwidth=bandwidth,
        latency_s=max(t["tiny"], t["after_compute"]) / (1 + math.log2(ranks)),
        reduce_scatter_efficiency=min(1.0, rate(t["reduce_scatter"], moved) / bandwidth),
        all_gather_efficiency=min(1.0, rate(t["all_gather"], moved) / bandwidth),
        comm_overlap=min(1.0, max(0.0, hidden / min(t["all_reduce"], t["compute"]))),
    )
