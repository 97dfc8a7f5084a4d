"""Where a rank's model states live under offload, byte for byte: the device, the host, NVMe files.

The runtime's GPU path (``bigtrain/parallel/zero/offload.py`` and ``host.py``; on a CPU device the
tests' ``OffloadPlan.separate_host``) between two steps, per ZeRO unit of N shards, with S the
padded shard's elements, F = N S the padded unit, B the compute dtype's bytes, E the optimizer's
bytes per element and T its per-tensor state (AdamW: E = 8, T = 4 for each piece's step count):

- **device**: the compute weights (stages 1-2: the whole unit, F B; stage 3: the shard, S B, unless
  ``offload.params`` keeps it on the host), no gradient and nothing of the optimizer, and K gradient
  buckets (``offload.grad_buckets``) of the largest shard in the reduce dtype (R bytes) that every
  reduced gradient passes through on its way to the host.
- **host**: the fp32 masters (S x 4, apart from the compute weights whenever those are on the device,
  in mixed precision or with the delayed update), the optimizer's state (E S + T per piece), the
  shard with ``offload.params`` (S B, unless it is the fp32 master itself), the fp32 gradient
  accumulator (S x 4; two with the delayed update: one is stepped while the next backward fills the
  other), and pinned staging: K buckets down (the largest shard x R) and ``STAGING_SLOTS`` up (the
  largest shard x B).
- **nvme** (files): with ``offload.optimizer = nvme`` the masters and the state's tensors of one or
  more dimensions (the per-tensor scalars stay in memory), at stages 2-3 the gradient accumulator
  (and with the delayed update the handed-over one); with ``offload.params = nvme`` the shard (or
  the fp32 master that is the shard).

:func:`tier_bytes` is what ``estimate_memory`` charges to the device and adds up for the host and
the files; ``ZeroEngine.tier_bytes`` measures the same from where its buffers live, and a test
compares the two for every offload layout.

On a CPU device (``host_is_device``) the host is the device: one copy where the GPU path keeps two
(the fp32 weights are the masters, in fp32 without the delayed update), no buckets, no staging,
and every tier but the files is the device's.
"""

from __future__ import annotations

from collections import Counter

from bigtrain.config import OffloadConfig
from bigtrain.optim import get_optimizer
from bigtrain.plan.layout import BYTES, Layout

STAGING_SLOTS = 4  # HostLink's ring of pinned buffers for host -> device copies
GRAD_BUCKETS = OffloadConfig().grad_buckets  # the runtime's default


def reduce_bytes(precision: str) -> int:
    """Bytes of the reduce dtype (``precision.reduce_dtype = 'auto'``: bf16 in bf16, fp32 otherwise)."""
    return 2 if precision == "bf16" else 4
TIERS = ("device", "host", "nvme")


# -- what one rank's shard of a unit holds (shared with memory.state_bytes) -------------------------------
def shard_pieces(unit, shards: int, shard_rank: int) -> int:
    """Optimizer parameters a shard becomes: its decayed part and its non-decayed part (flat.py)."""
    shard = -(-unit.numel // shards)
    lo, hi = shard_rank * shard, (shard_rank + 1) * shard
    return int(lo < unit.decay_numel) + int(hi > max(lo, unit.decay_numel))


def piecewise_shard_bytes(unit, shards: int, rank: int, spec, block: int, mixed: bool) -> tuple[int, int]:
    """(padded elements, optimizer bytes on shard ``rank``) of a unit laid out for an optimizer that
    is not elementwise: each parameter starts at a multiple of ``block``, the unit is padded to a
    multiple of ``shards x block``; the optimizer holds a piece of every parameter (empty where
    the shard holds none: its per-tensor state only) and, per piece, element and block state."""
    offsets, at = [], 0
    for n in unit.sizes:
        at = -(-at // block) * block
        offsets.append(at)
        at += n
    padded = -(-at // (shards * block)) * shards * block
    shard = padded // shards
    lo, hi = rank * shard, (rank + 1) * shard
    per_block = sum(s.nbytes for s in spec.state if s.per == "block")
    total = 4 * mixed * shard
    for offset, n, grid in zip(offsets, unit.sizes, unit.grids):
        held = max(0, min(hi, offset + n) - max(lo, offset))
        total += spec.bytes_per_param * held + per_block * -(-held // block) + spec.bytes_per_tensor
        total += spec.factored_bytes(grid) if spec.factored_bytes else 0
    return padded, total


def _unit_bytes(unit, layout: Layout, spec, align: int, mixed: bool, rank: int) -> tuple[int, int, int, int]:
    """(F, S, optimizer state bytes, of which per-tensor scalars) of one unit on shard ``rank``."""
    shards = layout.size(unit.axis) if layout.zero >= 1 else 1
    if not spec.elementwise and unit.sizes:
        padded, total = piecewise_shard_bytes(unit, shards, rank, spec, align, mixed)
        shard = padded // shards
        scalars = spec.bytes_per_tensor * len(unit.sizes)  # a piece for every parameter, even an empty one
        return padded, shard, total - 4 * mixed * shard, scalars
    shard = -(-unit.numel // shards)
    scalars = spec.bytes_per_tensor * shard_pieces(unit, shards, rank)
    return shard * shards, shard, spec.bytes_per_param * shard + scalars, scalars


def host_step(layout: Layout) -> bool:
    """Whether the optimizer steps on the host: any offload does (with ``offload.params`` alone the
    masters are where the shards are)."""
    return layout.offload_optimizer != "none" or layout.offload_params != "none"


def tier_bytes(units: list, layout: Layout, optimizer: str = "adamw", block: int = 256,
               rank: int | None = None, grad_buckets: int = GRAD_BUCKETS, host_is_device: bool = False
               ) -> dict[str, int]:
    """Bytes of model state per tier (``device``, ``host``, ``nvme``) on shard ``rank`` of every
    unit (None: the worst rank) of an offload layout on a GPU (``host_is_device``: on a CPU), as the
    runtime holds them between steps."""
    detail = tier_detail(units, layout, optimizer, block, rank, grad_buckets, host_is_device)
    return {tier: sum(detail[tier].values()) for tier in TIERS}


def tier_detail(units: list, layout: Layout, optimizer: str = "adamw", block: int = 256,
                rank: int | None = None, grad_buckets: int = GRAD_BUCKETS, host_is_device: bool = False
                ) -> dict[str, dict[str, int]]:
    """:func:`tier_bytes` by what holds them: {tier: {"params" | "masters" | "state" | "grads" |
    "grad_buckets" | "staging": bytes}}."""
    if rank is None:
        shards = max((layout.size(u.axis) for u in units), default=1) if layout.zero >= 1 else 1
        ranks = [tier_detail(units, layout, optimizer, block, r, grad_buckets, host_is_device)
                 for r in range(min(shards, 1024))]
        return max(ranks, key=lambda d: (sum(d["host"].values()), sum(d["nvme"].values()), sum(d["device"].values())))
    spec = get_optimizer(optimizer)
    align = spec.alignment_of(block) if not spec.elementwise else 1
    mixed, nbytes = layout.precision != "fp32", BYTES[layout.precision]
    params_on_host = layout.zero == 3 and layout.offload_params != "none"
    # On a CPU device the fp32 weights are the masters (ZeroEngine._separate_master): there is no
    # device copy apart from the host's.
    separate_master = mixed or layout.delayed_update or not (params_on_host or host_is_device)
    opt_files, param_files = layout.offload_optimizer == "nvme", layout.offload_params == "nvme"
    masters_in_files = opt_files and layout.offload_masters != "cpu"  # else in host memory (the split)
    grads_in_files = opt_files and layout.zero >= 2
    out = {tier: Counter() for tier in TIERS}
    largest = 0
    for unit, count in Counter(units).items():
        full, shard, state, scalars = _unit_bytes(unit, layout, spec, align, mixed,
                                                  rank % max(1, layout.size(unit.axis)))
        largest = max(largest, shard)
        per = {tier: Counter() for tier in TIERS}
        # compute weights
        if layout.zero < 3:
            per["device"]["params"] += nbytes * full
        elif separate_master:
            per["nvme" if param_files else "host" if params_on_host else "device"]["params"] += nbytes * shard
        # fp32 masters apart from the compute weights (else the stage-3 shard on the host is the
        # master, and below stage 3 on a CPU the compute weights are)
        if separate_master:
            per["nvme" if masters_in_files else "host"]["masters"] += 4 * shard
        elif layout.zero >= 3:
            per["nvme" if param_files else "host"]["masters"] += 4 * shard
        # the optimizer's state: its tensors in files with the NVMe tier, the scalars in memory
        per["host"]["state"] += scalars
        per["nvme" if opt_files else "host"]["state"] += state - scalars
        # gradients: the fp32 accumulators, on the host or in files (two with the delayed update)
        per["nvme" if grads_in_files else "host"]["grads"] += 4 * shard * (2 if layout.delayed_update else 1)
        for tier in TIERS:
            for k, v in per[tier].items():
                out[tier][k] += count * v
    if host_is_device:  # nothing to copy between them: no buckets, no staging, one tier
        out["device"] += out.pop("host")
        out["host"] = Counter()
    else:
        buckets = grad_buckets * largest * reduce_bytes(layout.precision)
        out["device"]["grad_buckets"] += buckets
        out["host"]["staging"] += buckets + STAGING_SLOTS * largest * nbytes
    return {tier: dict(out[tier]) for tier in TIERS}



def checkpoint_copy_bytes(units: list, layout: Layout) -> int:
    """Host bytes a (synchronous) checkpoint save of an offload layout holds beyond the states the
    rank keeps between steps: with the delayed update the weights in use (S x 4 a unit: a copy of
    the compute weights beside the masters, saved with them), and with files the one chunk the
    writer has copied out of its unit (at most the largest unit's masters, S x 4). The rest is
    written from the live states: views of those in host memory, and those in files read back
    one unit at a time as the writer reaches them (fewer than a step holds: it reads
    ``offload.prefetch_depth`` units ahead). A save runs between steps, when no activation is
    held: the host holds the larger of the two, not their sum. (``checkpoint.async`` snapshots
    every state first: not priced here.)"""
    files = "nvme" in (layout.offload_optimizer, layout.offload_params)
    shards = [-(-u.numel // (layout.size(u.axis) if layout.zero >= 1 else 1)) for u in units]
    in_use = 4 * sum(shards) if layout.delayed_update else 0
    return in_use + (4 * max(shards, default=0) if files else 0)
