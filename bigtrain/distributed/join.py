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
