"""A trainer with ``offload.delayed_update`` closed or dropped while its host step runs on the worker:
the step is cancelled at its next unit and the worker joined, so the engine's memory, its files and
its threads go now. The worker held the engine until the step ended: a deleted trainer's states
stayed for the rest of the step (here 4 units of 1 s: the engine outlived ``gc.collect()`` by 4 s)."""

import gc
import threading
import time
import weakref

import pytest

from helpers import tiny_config, trainer_on_rank

UNIT_S = 1.0  # each unit's host step, slowed: the whole step takes 5 units x this


def _trainer_mid_update(corpus_cache, tmp_path, *flags):
    """A trainer in its host step, and when each of the step's units began (counted, not timed: a
    loaded machine took 3.2 s to drop a trainer whose cancel worked)."""
    cfg = tiny_config(corpus_cache, "--model.n_layers=4", "--parallel.zero=1", "--offload.delayed_update=true",
                      "--train.global_batch=2", "--train.micro_batch=2", f"--offload.nvme_dir={tmp_path / 'nvme'}",
                      *flags)
    trainer = trainer_on_rank(0, 1, cfg, str(tmp_path))
    optimizer = trainer.engine.optimizer
    step = optimizer.step
    units_stepped = []  # (not on the trainer: the slowed step would hold it alive)

    def slow_step(*args, **kwargs):  # one call per unit, on the worker thread
        units_stepped.append(time.perf_counter())
        time.sleep(UNIT_S)
        return step(*args, **kwargs)

    optimizer.step = slow_step
    trainer.train_step()  # returns with its host step handed to the worker
    assert trainer.engine.offload.delayed.running
    time.sleep(0.1)  # the worker is inside a unit's step
    return trainer, units_stepped


def _host_step_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("bigtrain-host-step")]


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_a_dropped_trainer_cancels_its_host_step_and_frees_its_engine(optimizer, corpus_cache, tmp_path):
    trainer, units = _trainer_mid_update(corpus_cache, tmp_path, f"--offload.optimizer={optimizer}")
    engine = weakref.ref(trainer.engine)
    files = trainer.engine.offload.store.dir if optimizer == "nvme" else None
    dropped_at = time.perf_counter()
    del trainer
    gc.collect()  # the trainer's finalizer cancels the step and joins the worker
    gc.collect()  # the engine's own cycles
    assert engine() is None, "the engine outlived its trainer: the host step still holds it"
    assert sum(t > dropped_at for t in units) == 0, units  # the unit being stepped ends; no other begins
    assert not _host_step_threads()
    assert files is None or not files.exists()  # the store went with the engine


def test_close_cancels_the_host_step_and_releases_the_files_and_threads(corpus_cache, tmp_path):
    trainer, units = _trainer_mid_update(corpus_cache, tmp_path, "--offload.optimizer=nvme")
    files = trainer.engine.offload.store.dir
    closed_at = time.perf_counter()
    trainer.close()
    assert sum(t > closed_at for t in units) == 0, units
    assert not trainer.engine.offload.delayed.running and not _host_step_threads() and not files.exists()
    trainer.close()  # idempotent
