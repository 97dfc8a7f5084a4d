"""ZeRO-3's gathered units reuse the bytes of the units freed before them (``ParameterGatherer.spares``).

With the offload files' mmap threshold (1 MiB, process-wide: ``swap._free_to_the_os``) every gather's
buffer was new pages, faulted in and zeroed by the kernel: 0.5 M of a 57M-parameter NVMe run's 1.4 M
page faults over 4 steps. The spares may never make what is held more than the planner's
``zero3_gathered`` (the root unit and two blocks)."""

import resource

import pytest

from bigtrain.memory.spares import CAN_MOVE_BYTES
from bigtrain.memory.swap import _free_to_the_os
from bigtrain.plan.fit import _layout
from bigtrain.plan.hardware import PRESETS
from bigtrain.plan.memory import estimate_memory
from bigtrain.plan.model import ModelSpec
from helpers import tiny_config, trainer_on_rank

PAGE = resource.getpagesize()


@pytest.mark.skipif(not CAN_MOVE_BYTES, reason="this torch cannot move a storage's bytes: each gather gets new ones")
def test_zero3_gathers_reuse_freed_units_bytes_within_the_planners_gathered_bytes(corpus_cache, tmp_path):
    _free_to_the_os()  # as every offload run's first swap store does
    cfg = tiny_config(corpus_cache, "--model.dim=256", "--model.n_layers=6", "--model.n_heads=4",
                      "--model.n_kv_heads=0", "--data.seq_len=16", "--train.micro_batch=1", "--train.global_batch=1",
                      "--parallel.zero=3")
    trainer = trainer_on_rank(0, 1, cfg, str(tmp_path))
    gatherer = trainer.engine.gatherer
    priced = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg), PRESETS["cpu"],
                             cfg.train.global_batch).buffers["zero3_gathered"]
    held, faults, gathered = [], [0], [0]
    start, free = gatherer._start_gather, gatherer._free

    def counted_start(units):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        gathered[0] += sum(u.padded_numel * u.full.element_size() for u in units if not u.gathered)
        start(units)  # a group of one rank: the gather is a copy into the buffer, here
        faults[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        held.append(gatherer.gathered_bytes() + gatherer.spares.nbytes)

    def counted_free(unit):
        free(unit)
        held.append(gatherer.gathered_bytes() + gatherer.spares.nbytes)

    gatherer._start_gather, gatherer._free = counted_start, counted_free
    for _ in range(2):
        faults[0] = gathered[0] = 0
        trainer.train_step()
    largest = max(u.padded_numel * u.full.element_size() for u in trainer.engine.units)
    assert largest >= 2 << 20  # mapped blocks (1 MiB or more), freed to the OS
    # 14 gathers a step (7 units, forward and backward); new pages for the first three (the root and
    # two blocks) at most, the spares' for the others: it faulted in every byte gathered before.
    assert gathered[0] >= 12 * largest
    assert faults[0] * PAGE < 4 * largest, (faults[0], gathered[0] // PAGE)
    assert max(held) <= priced, (max(held), priced)  # gathered and spare bytes: never above the planner's
    assert gatherer.spares.nbytes == 0  # none kept between steps
