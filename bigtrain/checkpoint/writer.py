"""Writing a run's checkpoints from every rank: each rank writes the chunks it owns in parallel
(torch.distributed.checkpoint), rank 0 commits (:mod:`.commit`), and the ranks agree after each
phase whether all succeeded, so a failure on one rank stops all of them with one message. With
``checkpoint.async`` the write runs in a background thread on a Gloo group of its own.

:class:`CheckpointWriter` is what :meth:`bigtrain.train.Trainer.save` hands its chunks to.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bigtrain.checkpoint.commit import (CheckpointWriteError, commit_checkpoint, file_checksums, fresh_temp_dir,
                                        is_disk_full, temp_dir, valid_checkpoints)
from bigtrain.config import Config
from bigtrain.distributed.comm import AxisComm, CollectiveError, CommStats
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.chunks import all_finite


class CheckpointWriter:
    """One run's checkpoint writes into ``root``, on this rank (rank 0 commits)."""

    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, root: Path):
        self.cfg, self.mesh, self.device, self.root = cfg, mesh, device, root
        self.is_main = mesh.rank == 0
        self.pending: Future | None = None  # a background checkpoint write (checkpoint.async)
        self._thread: ThreadPoolExecutor | None = None
        self._group = None

    def write(self, step: int, chunks: list, meta: dict, background: bool) -> None:
        """Write checkpoint ``step`` now, or (``background``: the chunks are copies) start writing it
        in the background thread; :meth:`wait` blocks until it is committed."""
        if not background:
            self._write(step, chunks, meta, None)
            return
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            # The background write's collectives get their own group, apart from training's, with
            # the run's timeout (a new group's default is torch's 30 minutes).
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.distributed.timeout_s))
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending = self._thread.submit(self._write, step, chunks, meta, self._group)

    def wait(self) -> None:
        """Block until a background checkpoint write is committed (re-raising its error)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        """Wait for a background write (re-raising its error), then end its thread."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None

    def all_finite(self, chunks: list) -> bool:
        """Whether every rank's chunks (weights, optimizer state) are finite; collective."""
        finite = [all_finite(c.data) if c.finite is None else torch.tensor(c.finite)
                  for c in chunks if c.data.is_floating_point()]
        flag = torch.zeros(1, device=self.device)
        if finite:  # one host sync for all of them
            flag += (~torch.stack(finite).all()).to(self.device, torch.float32)
        self.mesh.comm("world").max(flag, tag="checkpoint")
        return not flag.item()

    def _write(self, step: int, chunks: list, meta: dict, group) -> None:
        """Every rank writes its chunks, rank 0 commits. The ranks agree after each phase whether all
        succeeded (instead of barriers), so a failure on one rank stops all of them; the partial
        temporary directory is removed and earlier checkpoints stay as they were."""
        # DCP is imported by the first save, not with the trainer: a process that never saves (the
        # CLI's help, a launcher, a run without checkpoints) does not pay its ~1 s import.
        from torch.distributed.checkpoint.api import CheckpointException

        from bigtrain.checkpoint.sharded import save_chunks

        root, keep = self.root, self.cfg.checkpoint.keep
        tmp = temp_dir(root, step)
        several = dist.is_initialized() and dist.get_world_size() > 1
        # A group of the async write is Gloo (host tensors); the default group may be NCCL.
        device = torch.device("cpu") if group is not None else self.device
        # The agreements go through a named collective: a rank that dies or freezes during the save
        # is reported like any other collective's failure (rank, collective, group), not as a raw
        # Gloo traceback. The background write's group keeps its own counters (another thread).
        comm = (self.mesh.comm("world") if group is None else
                AxisComm("world", group, dist.get_world_size(), dist.get_rank(), CommStats())) if several else None
        error: BaseException | None = None
        try:
            try:
                if self.is_main:
                    root.mkdir(parents=True, exist_ok=True)
                    fresh_temp_dir(root, step)
            except OSError as e:
                error = e
            if several:  # DCP's writers create the directory too: they must find rank 0's fresh one, not race it
                error = _agree(error, comm, device, f"rank 0 could not create {tmp}")
            if error is None:
                try:
                    save_chunks(tmp, chunks, group)  # returns once every rank's files and the metadata are written
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises a BaseException
                    error = e
                if several:
                    error = _agree(error, comm, device, f"another rank failed to write checkpoint step {step}")
            if error is None:
                # Every rank checksums its share of the files (rank 0 hashed them all: a 7B model's
                # 84 GB of weights and Adam state read by one process at each save), rank 0 commits.
                checksums = None
                if several:
                    try:
                        mine = file_checksums(tmp, step, (comm.rank, comm.size))
                    except Exception as e:  # noqa: BLE001 - a file gone: every rank still gathers, agreed below
                        error, mine = e, None
                    shares = comm.gather_objects(mine)
                    if shares is not None and error is None:
                        if any(share is None for share in shares):
                            error = CheckpointWriteError("another rank failed to checksum its files")
                        else:
                            checksums = {n: d for share in shares for n, d in share.items()}
                if self.is_main and error is None:
                    try:
                        commit_checkpoint(root, step, tmp, meta, keep, checksums)
                    except Exception as e:  # noqa: BLE001 - a full disk: agreed below
                        error = e
                if several:  # every rank sees the committed save, or the failure
                    error = _agree(error, comm, device, f"another rank failed to write checkpoint step {step}")
        except CollectiveError as lost:  # another rank died or froze during the save
            lost.step = step
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            mine = (f"writing the parts (torch.distributed.checkpoint's own collectives) had failed on this rank "
                    f"first: {_short(error)}" if error is not None else "this rank had written its part")
            raise CheckpointWriteError(f"{lost.describe()}\n  while saving checkpoint step {step} into {root}: "
                                       f"{mine}; the partial save was removed and "
                                       f"{_kept(root)}") from lost
        if error is None:
            return
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = _kept(root)
        if is_disk_full(error):
            raise CheckpointWriteError(f"checkpoint step {step}: no space left on device in {root}; the partial "
                                       f"save was removed and {kept}; free space or choose another "
                                       f"--output-dir, then continue with --resume") from error
        raise CheckpointWriteError(f"checkpoint step {step} could not be written to {root} "
                                   f"({_short(error)}); {kept}") from error


def _agree(error: BaseException | None, comm: AxisComm, device: torch.device, elsewhere: str
           ) -> BaseException | None:
    """This rank's ``error``, or one naming ``elsewhere`` if only another rank failed; collective
    (a CollectiveError naming it when a rank is gone)."""
    failed = torch.tensor([1 if error is not None else 0], dtype=torch.int32, device=device)
    comm.max(failed, tag="checkpoint")
    if error is None and failed.item():
        return RuntimeError(elsewhere)
    return error


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


def _kept(root: Path) -> str:
    """What a failed save left of the earlier checkpoints: the newest that verifies (its manifest;
    a link or a damaged folder under a checkpoint's name is not one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped ones are not news here
        found = next(valid_checkpoints(root, files=False), None)
    return f"the previous checkpoint {found[0].name} is intact" if found else "no earlier checkpoint exists"
