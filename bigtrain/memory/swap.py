"""Tensors kept in files and read back on demand: the NVMe tier of offload (ZeRO-Infinity's idea).

A :class:`SwapStore` owns one file per tensor under a directory. :meth:`swap_out` writes a tensor's
bytes to its file and releases its storage (``untyped_storage().resize_(0)``: every view of it, the
optimizer's state entries and the engine's pieces, stays valid and points at no bytes, as ZeRO-3's
freed parameters do); :meth:`swap_in` gives the storage its bytes back and reads them. Reads and
writes run on a small thread pool (file I/O releases the GIL), so the next unit's tensors are read
while this one is stepped and the last one's written: :meth:`prefetch` starts a read, :meth:`swap_in`
waits for it. Each write completes before the tensor's next read (a tensor's jobs are chained).
No native code: ``os.pwrite`` / ``os.preadv`` of the tensor's storage, seen through ctypes.

The files go in a directory of the store's own, made under the one it is given and removed with
its files when the store is closed, collected or the process exits: the file names (global rank and
unit) are the same in every run, so two runs given one ``offload.nvme_dir`` would otherwise read
each other's tensors, silently. Each store holds a lock on its directory (``flock``, released by
the kernel when the process ends however it ends), so a directory left by a process that died
without closing it (SIGKILL, an out-of-memory kill) is removed by the next store made beside it, and
a run restarted after crashes does not pile its files up on the disk; a live process's is left alone
(a pid would not say: processes in other containers share the directory but not the pids).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from bigtrain.memory.spares import SpareBuffers


class SwapStore:
    def __init__(self, directory: str | Path, threads: int = 2, spare_limit: int = 0):
        _free_to_the_os()
        parent = Path(directory)
        parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_processes_files(parent)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        self._lock = _new_lock(self.dir / LOCK)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bigtrain-swap")
        self._jobs: dict[str, Future] = {}
        self._nbytes: dict[str, int] = {}
        self._fds: dict[str, int] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        # Buffers given back by tensors written to their files, for the next tensors read in: their
        # pages stay mapped, so a read does not fault them in again. At most ``spare_limit`` bytes of
        # them (more are freed), and none between steps (:meth:`drop_spares`): the files still free
        # the memory.
        self.spares = SpareBuffers(spare_limit)
        self._remove = weakref.finalize(self, _remove_files, self.dir, self._fds, self._lock)

    def _fd(self, key: str) -> int:
        if key not in self._fds:
            self._fds[key] = os.open(self.dir / key.replace("/", "_"), os.O_RDWR | os.O_CREAT, 0o600)
        return self._fds[key]

    @staticmethod
    def _buffer(t: torch.Tensor) -> memoryview:
        # Through ctypes, not .numpy(): a storage that numpy has seen can never be resized again.
        nbytes = t.untyped_storage().nbytes()
        return memoryview((ctypes.c_char * nbytes).from_address(t.untyped_storage().data_ptr())).cast("B")

    def _after(self, key: str, fn) -> Future:
        previous = self._jobs.get(key)

        def run():
            if previous is not None:
                previous.result()
            return fn()

        self._jobs[key] = self._pool.submit(run)
        return self._jobs[key]

    @property
    def stored_bytes(self) -> int:
        """Bytes of all tensors currently kept in files."""
        return sum(self._nbytes.values())

    def resident(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().nbytes() > 0

    @property
    def spare_limit(self) -> int:
        return self.spares.limit

    @spare_limit.setter
    def spare_limit(self, nbytes: int) -> None:
        self.spares.limit = nbytes

    def give_bytes(self, t: torch.Tensor, nbytes: int) -> None:
        """Give ``t``'s storage (holding none) ``nbytes`` bytes: a spare buffer of that size if there
        is one (its pages mapped already), else new ones. Its values are whatever they were."""
        self.spares.give(t.untyped_storage(), nbytes)

    def take_bytes(self, t: torch.Tensor) -> None:
        """Take ``t``'s bytes (it holds none after) and keep them as a spare for the next tensor of
        that size read in."""
        self.spares.take(t.untyped_storage())

    def drop_spares(self) -> None:
        """Give the spare buffers back (to the OS: glibc unmaps blocks of 1 MiB or more, see
        :func:`_free_to_the_os`): between steps, the files hold what they hold and memory nothing."""
        self.spares.drop()

    @property
    def spare_bytes(self) -> int:
        return self.spares.nbytes

    def swap_out(self, key: str, t: torch.Tensor) -> None:
        """Write ``t`` (a CPU tensor owning its whole storage) to its file, then free its bytes."""
        if not self.resident(t):
            return
        nbytes = t.untyped_storage().nbytes()
        self._nbytes[key] = nbytes
        fd = self._fd(key)

        def write():
            view = self._buffer(t)
            done = 0
            try:
                while done < nbytes:
                    done += os.pwrite(fd, view[done:], done)
            except OSError as e:  # the tensor keeps its bytes (not freed): nothing is lost but the run
                raise OSError(e.errno, f"offload could not write {nbytes:,} bytes to {self.dir / key} "
                                       f"({e.strerror}); offload.nvme_dir's disk must hold every rank's files "
                                       f"(bigtrain plan's NVMe figure): free space there or set offload.nvme_dir "
                                       f"to a larger disk") from e
            self.take_bytes(t)

        self.bytes_written += nbytes
        self._after(key, write)

    def prefetch(self, key: str, t: torch.Tensor) -> None:
        """Start reading ``t`` back (its storage is given its bytes first, on this thread)."""
        if key not in self._nbytes:
            return
        self._after(key, lambda: None).result()  # the write must be done before the storage regrows
        if self.resident(t):
            return
        self.give_bytes(t, self._nbytes[key])
        fd = self._fd(key)

        def read():
            view = self._buffer(t)
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], done)
                if got == 0:  # the file is shorter than what was written to it: never read zeros as data
                    raise OSError(f"offload file {self.dir / key} holds {done} bytes, {len(view)} were written "
                                  f"to it: it was truncated by something else; its tensor is lost")
                done += got

        self.bytes_read += self._nbytes[key]
        self._after(key, read)

    def swap_in(self, key: str, t: torch.Tensor) -> None:
        """Make ``t`` resident with the bytes last written (waits for its read)."""
        self.prefetch(key, t)
        job = self._jobs.get(key)
        if job is not None:
            job.result()

    def wait_for(self, keys) -> None:
        """Wait for the jobs of ``keys`` (bounds the bytes held by writes still in flight)."""
        for key in keys:
            job = self._jobs.get(key)
            if job is not None:
                job.result()

    def wait(self) -> None:
        for job in list(self._jobs.values()):
            job.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
        self._remove()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def _free_to_the_os() -> None:
    """Make a freed storage of 1 MiB or more go back to the OS (glibc; elsewhere nothing to do).

    A storage written to its file is freed to malloc, and glibc keeps a freed block below 32 MiB
    in the process's heap: each free of an mmap'd block raises its mmap threshold to that block's
    size (up to 32 MiB), after which such blocks come from the heap and stay there. A run whose
    units' shards are under 32 MiB (many ranks, narrow layers) then held its whole state resident
    although it was in files: 57M parameters, ZeRO-3 with optimizer and parameters in files, peak
    RSS 1.0-1.7 GiB, 0.9-1.4 GiB between steps, where 0.52 and 0.33 GiB with the threshold fixed
    (the planner: 0.67 GiB). Setting the threshold turns its raising off, for the whole process: each
    large host allocation is mapped and unmapped (its pages faulted in again), as blocks above
    32 MiB always are; the price of files that free memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        pass


PREFIX = "swap-"
LOCK = ".lock"


def _locked(path: Path, create: bool = True) -> int | None:
    """An fd holding an exclusive lock on ``path`` (created if missing, with ``create``), or None if
    another process holds it."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # a filesystem without flock (ENOLCK, EOPNOTSUPP: some network ones)
        os.close(fd)
        raise
    return fd


def _new_lock(path: Path) -> int:
    """``path`` made, already locked by this process: the lock is taken under another name and the file
    renamed, so no other store sees ``path`` unlocked (and takes this directory for a dead one's)."""
    making = path.with_name(path.name + ".new")
    try:
        fd = _locked(making)
    except OSError:  # no flock on this filesystem: the store works unlocked, and no other store can
        # tell its directory from a dead one's, so none removes it (_remove_dead_processes_files)
        fd = os.open(making, os.O_RDWR | os.O_CREAT, 0o600)
    assert fd is not None, f"{making} is locked by another process"
    os.rename(making, path)
    return fd


def _remove_dead_processes_files(parent: Path) -> None:
    """Remove the directories of stores whose process is gone (killed before its store was closed):
    their lock is free. A directory whose lock file is not there yet is being made: left alone; one
    removed meanwhile (the ranks of a restarted run all look), or whose lock this filesystem cannot
    take (no flock: it may be a live run's), is passed over."""
    for entry in parent.glob(f"{PREFIX}*"):
        try:
            fd = _locked(entry / LOCK, create=False)
        except OSError:  # no lock file yet (being made), gone (removed first by another), or no flock here
            continue
        if fd is not None:
            shutil.rmtree(entry, ignore_errors=True)
            os.close(fd)


def _remove_files(directory: Path, fds: dict[str, int], lock: int) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)
    os.close(lock)
