"""The NVMe tier's files (bigtrain/memory/swap.py): two runs given one offload.nvme_dir keep their
tensors apart (their file names, global rank and unit, are the same in every run), a file cut short
by something else is an error, never zeros read as data, and the files go when the store does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bigtrain.memory.spares import CAN_MOVE_BYTES
from bigtrain.memory.swap import LOCK, PREFIX, SwapStore


def test_two_stores_given_one_directory_keep_their_own_tensors(tmp_path):
    first, second = SwapStore(tmp_path), SwapStore(tmp_path)
    a, b = torch.full((64,), 1.0), torch.full((64,), 2.0)
    first.swap_out("0.unit0.master", a)  # the same key: the same rank and unit of another run
    second.swap_out("0.unit0.master", b)
    first.swap_in("0.unit0.master", a)
    second.swap_in("0.unit0.master", b)
    assert torch.equal(a, torch.full((64,), 1.0)) and torch.equal(b, torch.full((64,), 2.0))


def test_a_truncated_file_is_an_error_not_a_hang_or_zeros(tmp_path):
    store = SwapStore(tmp_path)
    t = torch.arange(64, dtype=torch.float32)
    store.swap_out("k", t)
    store.wait()
    os.truncate(store.dir / "k", 100)
    with pytest.raises(OSError, match="truncated"):
        store.swap_in("k", t)


def test_closing_the_store_removes_its_files(tmp_path):
    store = SwapStore(tmp_path)
    store.swap_out("k", torch.ones(16))
    store.wait()
    assert any(store.dir.iterdir())
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_processs_files_are_removed_by_the_next_store(tmp_path):
    """A run killed with SIGKILL leaves its store's directory, whose lock the kernel released; its
    restart (a new store beside it) removes it, and leaves a live store's alone."""
    left = tmp_path / f"{PREFIX}999999-x1"  # as a killed process leaves it: files, a lock nobody holds
    left.mkdir()
    (left / LOCK).touch()
    (left / "0.unit0.master").write_bytes(b"\0" * 4096)
    live = SwapStore(tmp_path)
    assert not left.exists() and live.dir.exists()
    SwapStore(tmp_path)  # another store beside a live one (its lock is held)
    assert live.dir.exists()


def test_a_full_disk_is_an_error_naming_the_file_and_the_fix_and_keeps_the_tensor(tmp_path, monkeypatch):
    import errno

    import bigtrain.memory.swap as swap

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap.os, "pwrite", full)
    store = SwapStore(tmp_path)
    t = torch.arange(64, dtype=torch.float32)
    store.swap_out("0.unit0.master", t)
    with pytest.raises(OSError, match=r"offload could not write 256 bytes to .*0.unit0.master \(No space left on "
                                      r"device\).*set offload.nvme_dir to a larger disk"):
        store.wait()
    assert torch.equal(t, torch.arange(64, dtype=torch.float32))  # still in memory


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's resident set from /proc")
def test_a_tensor_written_to_its_file_gives_its_memory_back_to_the_os(tmp_path):
    """glibc raises its mmap threshold to each freed mapped block's size (to 32 MiB at most), and a
    later block under it comes from the heap and stays there when freed: a shard under 32 MiB
    written to its file freed nothing (57M parameters with everything in files: 0.9-1.4 GiB
    resident between steps where 0.33 GiB with the store's setting). In a fresh interpreter: a test
    process's own history (a CI shard's, a thousand tests in) once kept the block resident."""
    code = f"""
import os, torch
from bigtrain.memory.swap import SwapStore
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
torch.ones(24 << 18)  # a 24 MiB block mapped and freed: glibc's threshold goes up to it
store = SwapStore({str(tmp_path)!r})
t = torch.ones(16 << 18)  # 16 MiB, under the raised threshold
before = resident()
store.swap_out("0.unit0.master", t)
store.wait()
freed = before - resident()
store.swap_in("0.unit0.master", t)
print(freed, bool(torch.equal(t, torch.ones(16 << 18))))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    freed, equal = out.split()
    assert int(freed) >= 12 << 20 and equal == "True", out


def test_a_dead_stores_directory_removed_by_another_first_is_passed_over(tmp_path, monkeypatch):
    """The ranks of a restarted run all look for a dead store's directory: one that another rank
    removed between the listing and the lock is not an error (it was: FileNotFoundError)."""
    import bigtrain.memory.swap as swap

    left = tmp_path / f"{PREFIX}999999-x1"
    left.mkdir()
    (left / LOCK).touch()
    listed = list(tmp_path.glob(f"{PREFIX}*"))
    import shutil

    shutil.rmtree(left)  # the other rank was first
    monkeypatch.setattr(type(tmp_path), "glob", lambda self, pattern: iter(listed))
    monkeypatch.setattr(type(tmp_path), "exists", lambda self: True)  # as seen just before the other rank removed it
    swap._remove_dead_processes_files(tmp_path)


def test_a_filesystem_without_flock_keeps_the_store_working(tmp_path, monkeypatch):
    """Some network filesystems refuse flock (ENOLCK): the store works without its lock, and a
    directory whose lock cannot be taken is left alone (it may be a live run's), not removed."""
    import errno
    import fcntl

    other = SwapStore(tmp_path)  # another run's store, made before the filesystem refuses locks

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    store = SwapStore(tmp_path)
    t = torch.arange(32, dtype=torch.float32)
    store.swap_out("k", t)
    store.swap_in("k", t)
    assert torch.equal(t, torch.arange(32, dtype=torch.float32)) and other.dir.is_dir()
    store.close()
    other.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's resident set from /proc")
@pytest.mark.skipif(not CAN_MOVE_BYTES, reason="this torch cannot move a storage's bytes: no spare buffers")
def test_a_tensor_read_in_reuses_the_bytes_of_one_written_out_and_the_spares_are_given_back(tmp_path):
    """With the mmap threshold at 1 MiB every tensor read in had its pages faulted in again (the
    NVMe step about 2x slower): a tensor written out now leaves its buffer as a spare for the next
    tensor of its size read in (up to ``spare_limit`` bytes; beyond, freed), and ``drop_spares``
    (after each step) gives them back to the OS. In a fresh interpreter, as the test above: in one
    CI shard's process, a thousand tests in, ``drop_spares`` returned no resident memory (it does
    alone and in its usual shard); a process's own allocation history is not the store's to fix."""
    code = f"""
import os, torch
from bigtrain.memory.swap import SwapStore
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
store = SwapStore({str(tmp_path)!r}, spare_limit=16 << 20)
a, b, c = (torch.full((4 << 20,), float(i)) for i in range(3))  # 16 MiB each
spare = b.untyped_storage().data_ptr()
store.swap_out("b", b)
store.wait()
store.swap_out("c", c)  # over the limit: freed
store.wait()
held = store.spare_bytes
store.swap_out("a", a)  # over the limit: freed
store.wait()
store.swap_in("b", b)  # the spare's bytes: no new pages
reused = b.untyped_storage().data_ptr() == spare and bool(torch.equal(b, torch.full((4 << 20,), 1.0)))
store.swap_in("c", c)
equal = bool(torch.equal(c, torch.full((4 << 20,), 2.0)))
store.swap_out("b", b)
store.wait()
before = resident()
store.drop_spares()
freed, left = before - resident(), store.spare_bytes
store.swap_in("a", a)
equal = equal and bool(torch.equal(a, torch.full((4 << 20,), 0.0)))
print(held, reused, equal, freed, left)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    held, reused, equal, freed, left = out.split()
    assert int(held) == 16 << 20 and reused == "True" and equal == "True", out
    assert int(left) == 0 and int(freed) >= 12 << 20, out


def test_without_a_way_to_move_bytes_a_store_frees_them_and_keeps_no_spares(tmp_path, monkeypatch):
    """torch 2.11 (the GPU image's) has no UntypedStorage._swap_data_ptr_: the store frees what it
    writes out and reads into new bytes, as before the pool, and the values come back."""
    import bigtrain.memory.spares as spares

    monkeypatch.setattr(spares, "CAN_MOVE_BYTES", False)
    store = SwapStore(tmp_path, spare_limit=64 << 20)
    t = torch.arange(1 << 20, dtype=torch.float32)
    store.swap_out("t", t)
    store.wait()
    assert not store.resident(t) and store.spare_bytes == 0
    store.swap_in("t", t)
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))
