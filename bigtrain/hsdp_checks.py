"""``parallel.dp_replicate`` and ``parallel.dp_shard`` (hybrid sharded data parallel) against the rest
of a config, before any process starts.

``parallel.dp`` stays the number of data-parallel ranks; under HSDP they are ``dp_replicate`` groups
of ``dp_shard`` ranks (``dp_shard`` = 0 follows as dp / dp_replicate). Imports no torch (as
:mod:`bigtrain.validation`). What is built and why: docs/architecture.md, "Hybrid sharded data parallel".
"""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.context_checks import divisor_near


def check_hybrid_sharding(cfg: Config) -> list[str]:
    p = cfg.parallel
    if p.dp_replicate < 1:
        return [f"parallel.dp_replicate = {p.dp_replicate}: must be >= 1 (1: ZeRO over all of parallel.dp)"]
    if p.dp_shard < 0:
        return [f"parallel.dp_shard = {p.dp_shard}: must be >= 1, or 0 to follow as parallel.dp / parallel.dp_replicate"]
    if p.dp < 1:
        return []  # named by check_parallel
    if p.dp_shard and p.dp_replicate * p.dp_shard != p.dp:
        total = p.dp_replicate * p.dp_shard
        return [f"parallel.dp = {p.dp} but parallel.dp_replicate x parallel.dp_shard = {p.dp_replicate} x {p.dp_shard} "
                f"= {total}: parallel.dp counts every data-parallel rank; set parallel.dp = {total}, or leave "
                f"parallel.dp_shard unset (0: it follows as parallel.dp / parallel.dp_replicate)"]
    if p.dp % p.dp_replicate:
        return [f"parallel.dp_replicate = {p.dp_replicate} does not divide parallel.dp = {p.dp}: the data-parallel "
                f"ranks are dp_replicate equal groups; use parallel.dp_replicate = {divisor_near(p.dp, p.dp_replicate)} "
                f"or parallel.dp = {p.dp_replicate * max(1, p.dp // p.dp_replicate)}"]
    if p.dp_replicate == 1:
        return []
    what, problems = f"parallel.dp_replicate = {p.dp_replicate}", []
    if p.zero == 0:
        problems.append(f"{what} with parallel.zero = 0: hybrid sharding says where ZeRO cuts, and stage 0 cuts "
                        f"nothing (every rank all-reduces everything); use parallel.zero = 1, 2 or 3, or "
                        f"parallel.dp_replicate = 1")
    group = (p.dp // p.dp_replicate) * p.cp * p.sp  # the ranks of one ZeRO group: dp_shard x cp x sp
    if p.ep > 1 and group % p.ep:
        problems.append(f"{what} with parallel.ep = {p.ep}: an expert-parallel group must lie inside one replica "
                        f"group of dp_shard x cp x sp = {p.dp // p.dp_replicate} x {p.cp} x {p.sp} = {group} ranks, "
                        f"which ep does not divide; use parallel.ep = {divisor_near(group, p.ep)} or "
                        f"parallel.dp_replicate = 1")
    if cfg.model.family != "llama":  # proved on the Llama family's ZeRO engine (tests/test_hsdp.py)
        # a family's own reason is its own check's (the DLRM's tables): said here of every family it misled
        problems.append(f"{what}: hybrid sharding is built and proved for the Llama family, not model.family = "
                        f"'{cfg.model.family}'; use parallel.dp_replicate = 1")
    return problems
