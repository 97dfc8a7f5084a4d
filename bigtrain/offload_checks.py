"""The [offload] section against the rest of a config, before any process starts: offload needs the
ZeRO engine's units, a host step it can overlap, and a directory it can write for the NVMe tier.

Imports no torch (as :mod:`bigtrain.validation`). What is built: docs/offload.md.
"""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.field_checks import one_of, writable_dir
from bigtrain.optim import get_optimizer, optimizer_names  # plain data: imports no torch

OFFLOAD_TIERS = ("none", "cpu", "nvme")


def check_offload(cfg: Config) -> list[str]:
    """Offload needs the ZeRO engine's units (it steps and stores them one at a time), and a
    directory it can write for the NVMe tier."""
    o, p = cfg.offload, cfg.parallel
    problems = one_of("offload.optimizer", o.optimizer, OFFLOAD_TIERS)
    problems += one_of("offload.params", o.params, OFFLOAD_TIERS)
    problems += one_of("offload.masters", o.masters, ("auto", "cpu"))
    if o.masters == "cpu" and o.optimizer != "nvme":
        problems.append(f"offload.masters = 'cpu' keeps the fp32 masters in host memory while the optimizer's "
                        f"state is in files, but offload.optimizer = '{o.optimizer}' puts no state in files; set "
                        f"offload.optimizer = 'nvme', or offload.masters = 'auto'")
    if o.prefetch_depth < 0:
        problems.append(f"offload.prefetch_depth = {o.prefetch_depth}: must be >= 0")
    if o.grad_buckets < 1:
        problems.append(f"offload.grad_buckets = {o.grad_buckets}: must be >= 1 (gradients pass through them "
                        f"on their way to the host; 4 is the default)")
    if o.delayed_update and o.optimizer == "none":
        problems.append("offload.delayed_update = true overlaps the host optimizer step with the next step, but "
                        "offload.optimizer = 'none' has no host step; set offload.optimizer = 'cpu' (or 'nvme')")
    if o.delayed_update and p.pp > 1:
        problems.append(f"offload.delayed_update = true with parallel.pp = {p.pp}: the delayed update is built for "
                        f"the ZeRO engine without a pipeline (pipeline schedules step each stage themselves; "
                        f"PipeDream-2BW is their own one-step delay); set parallel.pp = 1 or "
                        f"offload.delayed_update = false")
    if o.delayed_update and p.world_size > 1 and cfg.optim.name in optimizer_names() \
            and get_optimizer(cfg.optim.name).needs == "shapes":
        # The delayed host step runs on a worker thread beside the next step's collectives; an
        # optimizer that reduces statistics over the ranks inside its step would interleave its
        # collectives with them (found by the layout fuzzer: a Gloo size mismatch).
        problems.append(f"offload.delayed_update = true runs the host optimizer step on a worker thread, but "
                        f"optim.name = '{cfg.optim.name}' sums its factored statistics over the ranks inside the "
                        f"step (a collective beside the main thread's); set optim.name = 'adamw' (or 'adamw8bit', "
                        f"'lion'), or offload.delayed_update = false")
    if o.delayed_update and p.dp_sync != "sync":
        problems.append(f"offload.delayed_update = true with parallel.dp_sync = '{p.dp_sync}': local SGD's "
                        f"averaging would read masters a step ahead of the weights in use; set "
                        f"parallel.dp_sync = 'sync' or offload.delayed_update = false")
    if o.optimizer != "none" and p.zero < 1:
        problems.append(f"offload.optimizer = '{o.optimizer}' steps the ZeRO engine's units one at a time, but "
                        f"parallel.zero = {p.zero}; set parallel.zero = 1, 2 or 3")
    if o.params != "none" and p.zero != 3:
        problems.append(f"offload.params = '{o.params}' keeps ZeRO-3's parameter shards off the device, but "
                        f"parallel.zero = {p.zero}; set parallel.zero = 3")
    if "nvme" in (o.optimizer, o.params) and o.nvme_dir:
        problems += writable_dir("offload.nvme_dir", o.nvme_dir)
    return problems

