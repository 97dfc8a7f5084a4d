"""The engines' own memory figures against measurements they do not control.

- Every live tensor storage of the process (found through the garbage collector, de-duplicated
  by storage) must be accounted for by the engine's parameters + gradients + optimizer state, up
  to the few small tensors that are not model state (rotary tables, the batch).
- The process's resident memory (RSS, read from /proc) must move with the engine's figures: the
  ZeRO-3 rank of a dp=2 run holds about half the model state of a replicated (ZeRO-0) rank, and
  the drop in RSS must equal the drop the engine reports.
"""

import ctypes
import gc
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from bigtrain.testing import run_ranks
from helpers import tiny_config, trainer_on_rank

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    """Resident bytes once the C heap has handed freed memory back (glibc keeps freed chunks of
    transient allocations, such as initial values, which would read as live memory)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _live_storage_bytes() -> int:
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        # A forked rank inherits the test session's garbage, which holds FakeTensors from compiled
        # tests: they own no memory, and their symbolic sizes cannot be pickled back.
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not isinstance(obj, FakeTensor):
            storage = obj.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _states_and_live(rank, world_size, cfg, run_dir):
    before = _live_storage_bytes()
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    states = trainer.engine.state_bytes()
    return sum(states.values()), _live_storage_bytes() - before


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_live_storage_is_in_the_engines_figures(stage, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", f"--parallel.zero={stage}", "--train.micro_batch=4",
                      "--precision.mode=bf16" if stage else "--precision.mode=fp32")
    for reported, live in run_ranks(_states_and_live, 2, cfg, str(tmp_path)):
        # Not model state: rotary tables (2 x 64 x 8 fp32) and the step's last batch of tokens.
        assert reported <= live <= reported + 64 * 1024, (reported, live)


WIDE = ["--model.dim=512", "--model.n_layers=8", "--model.n_heads=4", "--model.n_kv_heads=0",
        "--train.micro_batch=1", "--train.global_batch=2", "--data.seq_len=16"]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc), and map every allocation of 128 KiB or more
    afresh: a forked rank inherits the test session's freed memory and its malloc's dynamic mmap
    threshold (raised by every large block the session freed, up to 32 MiB), so tensors would land
    in reused heap pages that do not show as growth (the test was flaky late in a full suite).
    Setting the threshold also turns its dynamic adjustment off."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):
        pass


def _rss_growth(rank, world_size, cfg, run_dir):
    _trim_heap()
    before = _rss()
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    return _rss() - before, sum(trainer.engine.state_bytes().values())


def test_resident_memory_drops_as_much_as_the_engine_says_under_zero3(corpus_cache, tmp_path):
    replicated = run_ranks(_rss_growth, 2, tiny_config(corpus_cache, *WIDE, "--parallel.dp=2"), str(tmp_path))
    sharded = run_ranks(_rss_growth, 2, tiny_config(corpus_cache, *WIDE, "--parallel.dp=2", "--parallel.zero=3"),
                        str(tmp_path))
    (rss0, reported0), (rss3, reported3) = replicated[0], sharded[0]
    assert reported0 > 350e6 and reported3 < 0.55 * reported0  # 16P vs 16P/2 (+ one gathered unit)
    measured_drop, reported_drop = rss0 - rss3, reported0 - reported3
    assert abs(measured_drop - reported_drop) <= 0.15 * reported_drop, (measured_drop, reported_drop)
