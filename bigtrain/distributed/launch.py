"""Starting ranks: our own torchrun on one machine, or joining a user's torchrun.

``bigtrain train`` re-executes itself under ``torch.distributed.run --standalone`` when the
layout needs more than one rank (or restarts, ``--max-restarts``) and it is not already inside a
launcher. Inside one (ours or a user's multi-node torchrun) each rank calls :func:`init_distributed`.
Gloo on CPU, NCCL on CUDA. What a restarted round needs is in :mod:`bigtrain.distributed.elastic`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bigtrain.distributed.elastic import round_store


@dataclass
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def launched_externally() -> bool:
    """True inside torchrun (or any launcher that sets the torch.distributed environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if launched_externally() else None


def pick_device(requested: str, local_rank: int) -> torch.device:
    """This rank's device: one GPU per local rank (NCCL cannot run two ranks on one GPU), or the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise RuntimeError(f"train.device = '{requested}' but no CUDA device is available; use 'auto' or 'cpu'")
    if count == 1:
        return torch.device("cuda", 0)  # one visible GPU per process (a launcher set CUDA_VISIBLE_DEVICES)
    if local_rank >= count:
        raise RuntimeError(f"train.device = '{requested}': local rank {local_rank} needs its own GPU but this "
                           f"machine shows {count}; start at most {count} ranks per machine, or use device 'cpu'")
    return torch.device("cuda", local_rank)


def init_distributed(device_request: str = "auto", timeout_s: float = 600.0) -> RankInfo:
    """Join the process group the launcher describes (or stay single-process without one)."""
    if not launched_externally() or int(os.environ["WORLD_SIZE"]) == 1:
        device = pick_device(device_request, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return RankInfo(0, 1, 0, device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_request, local_rank)
    extra = {}
    if device.type == "cuda":
        # Before any CUDA work: the current device is where NCCL puts its communicators, and where
        # tensors made without an explicit device would land. ``device_id`` binds the group to it
        # (no guessing in barrier() or object collectives, which need the current device too).
        torch.cuda.set_device(device)
        extra["device_id"] = device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = round_store(world, timeout)  # None: torch's own env:// store
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=store, **extra)
    return RankInfo(rank, world, local_rank, device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(nproc: int, max_restarts: int = 0) -> list[str]:
    """torchrun on this machine, up to its entry point (one agent: restart rounds count the same on every rank)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}"]


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run ``python -m bigtrain <argv>`` under torchrun with ``nproc`` ranks on this machine.

    With ``max_restarts`` the agent restarts the whole group (the same command) up to that many
    times after a rank fails. CPU ranks share the cores: each gets an equal share of threads so they
    do not oversubscribe.
    """
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [*torchrun_command(nproc, max_restarts), "-m", "bigtrain", *argv]
    return wait_for_ranks(subprocess.Popen(cmd, env=env))


def wait_for_ranks(proc: subprocess.Popen) -> int:
    """Wait for torchrun while the ranks save on a signal (bigtrain.preemption): SIGTERM to this
    process is passed on to torchrun, which passes it to the ranks; a Ctrl-C reached the ranks from
    the terminal already, so this process keeps waiting (``subprocess.call`` would SIGKILL torchrun
    and return while the ranks still write their checkpoint)."""
    import signal

    def forward(signum, frame):
        if signum == signal.SIGTERM:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
