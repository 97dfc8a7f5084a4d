"""Joining the run's process group with the run's timeout: a group that never forms is a
:class:`~bigtrain.failure.RunFailure` naming the rank, the address and the timeout."""

from __future__ import annotations

import os

import torch.distributed as dist

from bigtrain.config import Config
from bigtrain.distributed.launch import init_distributed
from bigtrain.failure import RunFailure


def join_group(cfg: Config):
    """init_distributed with distributed.timeout_s; a group that never forms is a RunFailure."""
    try:
        return init_distributed(cfg.train.device, cfg.distributed.timeout_s)
    except (dist.DistError, ValueError) as e:  # a store that timed out or refused; a malformed address
        world, rank = os.environ.get("WORLD_SIZE", "?"), os.environ.get("RANK", "?")
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise RunFailure(f"rank {rank} could not join the group of {world} ranks at {where} within "
                         f"distributed.timeout_s = {cfg.distributed.timeout_s:g} s: {' '.join(str(e).split())}") from e


def world_comm(rank: int, world_size: int):
    """The default group as a named axis ("world"), before any mesh exists: its collectives fail
    with the rank and the collective named, within distributed.timeout_s."""
    from bigtrain.distributed.comm import AxisComm, CommStats

    return AxisComm("world", dist.group.WORLD if world_size > 1 else None, world_size, rank, CommStats())


def config_digest(cfg: Config) -> int:
    """A 63-bit digest of the resolved config (every field), the same wherever it is computed."""
    import hashlib
    import json

    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_config(cfg: Config, world, device) -> tuple[bool, str | None]:
    """Whether every rank resolved the same config; collective over ``world`` (the mesh's "world"
    axis), once the group has formed. Ranks on several machines each read their own config file
    and flags, and ``--parallel auto`` plans on each machine from its own cores and hardware: ranks
    that resolved different layouts or settings would wait in different collectives, or train
    silently on different data or weights. Returns (stop, message): ``stop`` on every rank when
    they differ; the message (the fields that differ, which ranks hold which value) on rank 0."""
    import torch

    if world.size == 1:
        return False, None
    digests = torch.empty(world.size, dtype=torch.int64, device=device)
    world.all_gather(digests, torch.tensor([config_digest(cfg)], dtype=torch.int64, device=device), tag="config")
    groups: dict[int, list[int]] = {}
    for rank, digest in enumerate(digests.tolist()):
        groups.setdefault(digest, []).append(rank)
    if len(groups) == 1:
        return False, None
    # Which fields differ: the first rank of each group sends its values to rank 0 (rare, small).
    firsts = [ranks[0] for ranks in groups.values()]
    gathered = world.gather_objects(_flat(cfg.to_dict()) if world.rank in firsts else None)
    if gathered is None:
        return True, None
    values = [gathered[r] for r in firsts]
    fields = sorted(k for k in values[0] if len({repr(v.get(k)) for v in values}) > 1)
    shown = fields[:4]
    held = "; ".join(f"ranks {_span(ranks)}: " + ", ".join(f"{k} = {gathered[ranks[0]].get(k)!r}" for k in shown)
                     for ranks in groups.values())
    more = f" and {len(fields) - len(shown)} more field(s)" if len(fields) > len(shown) else ""
    return True, (f"the ranks resolved {len(groups)} different configurations ({held}{more}); every machine must "
                  f"run the same config file and flags (with --parallel auto each machine plans from its own cores "
                  f"and hardware: set the layout with --parallel.* flags, or give every machine one --hardware-file)")


def _span(ranks: list[int]) -> str:
    """``0-3, 6`` for [0, 1, 2, 3, 6]."""
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ", ".join(parts)
