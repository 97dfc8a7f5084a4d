"""Run a function on N real Gloo ranks inside one test process, fast and without hangs.

Ranks are forked from the parent (which has already paid for ``import torch``), each pinned to one
thread (a forked child that uses the parent's thread pool can deadlock), and joined through a fresh
``file://`` store so no TCP server has to outlive a fork. Each rank's return value or traceback
comes back to the caller; a rank that does not finish in time is killed by pid and named.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    pass


def _init_group(backend: str, store_path: str, rank: int, world_size: int, group_timeout: float) -> None:
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout))


def _child(fn: Callable, rank: int, world_size: int, store_path: str, args: tuple, conn, backend: str,
           group_timeout: float) -> None:
    torch.set_num_threads(1)
    try:
        _init_group(backend, store_path, rank, world_size, group_timeout)
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor data; multiprocessing's pickler would share it through a
        # helper thread of this process, which is gone once it exits.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        # Skip interpreter teardown (atexit handlers, Gloo destructors): the parent has the result.
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              group_timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` forked Gloo ranks; return their results.

    ``fn`` and its results must be picklable only for the results (fork passes ``fn`` as it is).
    ``group_timeout`` is the process group's (what ``distributed.timeout_s`` sets in a run).
    """
    return _run(fn, range(world_size), world_size, args, timeout, "gloo", group_timeout)


def run_fake_rank(fn: Callable[..., Any], world_size: int, *args: Any, rank: int = 0, timeout: float = 120.0) -> Any:
    """Call ``fn(rank, world_size, *args)`` in one forked process that pretends to be ``rank`` of
    ``world_size`` (torch's fake process group: collectives return at once and move no data), for
    checking shard shapes and accounting at world sizes this machine cannot run."""
    return _run(fn, [rank], world_size, args, timeout, "fake", 120.0)[0]


def _run(fn: Callable, ranks, world_size: int, args: tuple, timeout: float, backend: str,
         group_timeout: float) -> list[Any]:
    ctx = mp.get_context("fork")
    store_dir = tempfile.mkdtemp(prefix="bigtrain-store-")
    store_path = os.path.join(store_dir, uuid.uuid4().hex)
    procs, pipes = [], []
    # The ranks' collector never walks what they inherit (the parent's modules and objects, ~300k in
    # a test process that imported torch's compiler): frozen at the fork, so each rank's collections
    # scan only what it made, and do not copy the parent's pages to write their headers. Measured:
    # three 2-rank checks, 6% less CPU in the ranks (paired runs, docs/benchmarks.md). The parent
    # unfreezes at once: its own garbage stays collectable.
    gc.freeze()
    try:
        for rank in ranks:
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, daemon=True,
                               args=(fn, rank, world_size, store_path, args, child_end, backend, group_timeout))
            proc.start()
            child_end.close()
            procs.append(proc)
            pipes.append(parent_end)
    finally:
        gc.unfreeze()
    try:
        return _collect(procs, pipes, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
        try:
            os.remove(store_path)
            os.rmdir(store_dir)
        except OSError:
            pass


def _collect(procs: list, pipes: list, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, tuple[str, Any]] = {}
    while len(results) < len(procs):
        for rank, pipe in enumerate(pipes):
            if rank in results:
                continue
            if pipe.poll(0.01):
                try:
                    results[rank] = pickle.loads(pipe.recv_bytes())
                except EOFError:
                    results[rank] = ("error", f"rank {rank} exited (code {procs[rank].exitcode}) without a result")
            elif not procs[rank].is_alive() and not pipe.poll(0.05):
                results[rank] = ("error", f"rank {rank} died with exit code {procs[rank].exitcode}")
        errors = {r: v for r, (kind, v) in results.items() if kind == "error"}
        if errors:
            # One failed rank leaves the others blocked in a collective: report it now.
            raise RankFailure("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        if time.monotonic() > deadline:
            missing = [r for r in range(len(procs)) if r not in results]
            raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
    return [results[r][1] for r in range(len(procs))]
