"""Starting ranks: our own torchrun on one machine, or joining a user's torchrun.

``bigtrain train`` re-executes itself under torchrun's agent (``--standalone``, through
:mod:`bigtrain.distributed.agent`) when the layout needs more than one rank (or restarts,
``--max-restarts``) and it is not already inside a launcher. Inside one (ours or a user's
multi-node torchrun) each rank calls :func:`init_distributed`. Gloo on CPU, NCCL on CUDA. What a
restarted round needs is in :mod:`bigtrain.distributed.elastic`.

Who lives how long: the agent dies with the ``bigtrain train`` that started it (its parent-death
signal), SIGINT / SIGTERM to ``bigtrain train`` go to the ranks themselves, and a rank whose
launcher is gone stops on its own (:func:`stop_when_orphaned`): no rank trains on unwatched, and
the run folder's lock (:mod:`bigtrain.run_lock`) is held until the last of them exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from bigtrain.distributed.elastic import round_store
from bigtrain.run_lock import process_alive


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
    """torchrun on this machine, up to its entry point (one agent: restart rounds count the same on
    every rank), through :mod:`bigtrain.distributed.agent` (no torchrun traceback after a stop)."""
    return [sys.executable, "-m", "bigtrain.distributed.agent", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}"]


def launched_by_bigtrain() -> bool:
    """True in a rank that ``bigtrain train``'s own launcher started (:func:`launch_local`)."""
    return bigtrain_launcher() is not None


def bigtrain_launcher() -> int | None:
    """In a rank that :func:`launch_local` started, the pid of the bigtrain that did; else None.
    :data:`LAUNCHER_ENV` names it, and it must be the parent of this rank's parent (the agent): the
    variable alone is inherited by whatever a rank's shell starts next (a user's own torchrun run
    from an environment that kept it), where it named a launcher that is not there: that run's
    warnings went unsaid, its ranks watched a stranger's pid and exited 0 on a stop, as if a
    launcher would read the code."""
    text = os.environ.get(LAUNCHER_ENV, "")
    if not launched_externally() or not text.isdigit():
        return None
    return int(text) if parent_of(os.getppid()) == int(text) else None


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux: /proc; elsewhere ``ps``), or None where unknown."""
    if (parent := _proc_parent(pid)) is not None:
        return parent
    try:
        out = subprocess.run(["ps", "-o", "ppid=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
        return int(out.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0, env: dict[str, str] | None = None) -> int:
    """Run ``python -m bigtrain <argv>`` under torchrun with ``nproc`` ranks on this machine; its
    exit code (128 + N when a signal N passed on to the ranks ended them without a recorded stop).

    With ``max_restarts`` the agent restarts the whole group (the same command) up to that many
    times after a rank fails. CPU ranks share the cores: each gets an equal share of threads so they
    do not oversubscribe. ``env``: more variables for the ranks.

    The agent runs in a process group of its own, so a Ctrl-C at the terminal reaches this process
    only and is passed on to the ranks once (:func:`wait_for_ranks`), and it dies with this process
    (Linux: the parent-death signal), whose ranks then stop on their own (:func:`stop_when_orphaned`).
    """
    child_env = dict(os.environ, **(env or {}), **{LAUNCHER_ENV: str(os.getpid())})
    if not torch.cuda.is_available():
        child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [*torchrun_command(nproc, max_restarts), "-m", "bigtrain", *argv]
    return wait_for_ranks(subprocess.Popen(cmd, env=child_env, preexec_fn=_die_with_parent(os.getpid())))


LAUNCHER_ENV = "BIGTRAIN_LAUNCHER_PID"  # set for the ranks of launch_local: the pid of the bigtrain that started them
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int):
    """A ``preexec_fn``: a process group of its own, and (Linux) SIGKILL when ``parent`` dies.
    The C library is loaded here, before the fork, not in the child."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(1)

    return setup


def rank_processes(agent: int) -> list[int]:
    """The agent's children (the ranks it started), from /proc; [] where it cannot be read."""
    found = []
    try:
        for task in os.listdir(f"/proc/{agent}/task"):
            with open(f"/proc/{agent}/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
        return found
    except OSError:
        pass
    try:  # a kernel without the children files: every process's parent
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _proc_parent(entry) == agent]
    except OSError:
        return []


def _proc_parent(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def wait_for_ranks(proc: subprocess.Popen) -> int:
    """Wait for the agent while the ranks save on a signal (bigtrain.preemption). SIGINT and
    SIGTERM to this process are passed on to the ranks themselves, not to torchrun's agent: the
    agent would end with a traceback, and kill ranks still saving after 30 s. Before the ranks
    exist (the agent's rendezvous) the agent gets the signal. Returns the agent's exit code, or
    128 + the signal when one was passed on and the group failed."""
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        ranks = rank_processes(proc.pid)
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not ranks:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    return 128 + forwarded[0] if code != 0 and forwarded else code


def stop_when_orphaned(grace_s: float, poll_s: float = 0.2) -> threading.Thread | None:
    """In a rank: when the process that started it (torchrun's agent) dies, or the bigtrain that
    started the agent (:data:`LAUNCHER_ENV`), stop as on SIGTERM (a checkpoint at the next step
    boundary, :mod:`bigtrain.preemption`), and exit regardless ``grace_s`` later. A rank nobody
    waits for must not train on and write into a folder that a new run may take. Once per process."""
    if any(t.name == _WATCH_THREAD for t in threading.enumerate()):
        return None
    parent = os.getppid()
    launcher_pid = bigtrain_launcher()  # a leftover LAUNCHER_ENV names no process of this rank's to watch
    if parent == 1 and launcher_pid is None:  # started by init (or orphaned already): nothing to watch
        return None

    def gone() -> str | None:
        if os.getppid() != parent:
            return f"its launcher (pid {parent})"
        if launcher_pid is not None and not process_alive(launcher_pid):
            return f"the bigtrain train that started its launcher (pid {launcher_pid})"
        return None

    def watch() -> None:
        while (who := gone()) is None:
            time.sleep(poll_s)
        rank = os.environ.get("RANK", "?")
        print(f"bigtrain: rank {rank}: {who} is gone; stopping at the next step boundary (with a checkpoint), "
              f"at the latest in {grace_s:g} s", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        print(f"bigtrain: rank {rank}: did not stop within {grace_s:g} s of its launcher's death; exiting",
              file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name=_WATCH_THREAD, daemon=True)
    thread.start()
    return thread


_WATCH_THREAD = "bigtrain-parent-watch"
