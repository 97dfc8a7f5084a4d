"""``checkpoint.async`` snapshots what each rank saves into host memory and holds it while training
goes on: the planner prices it (``plan.states.checkpoint_snapshot_bytes``; a buffer on a CPU device,
host memory on a GPU), measured here as the distinct storages of the chunks a save hands its
background write (it was not priced at all: 0 B against 1.2 MB for ZeRO-1 bf16 here)."""

import pytest
import torch

from bigtrain.checkpoint.writer import CheckpointWriter
from bigtrain.memory.accounting import tensor_bytes
from bigtrain.plan.fit import _layout
from bigtrain.plan.hardware import PRESETS
from bigtrain.plan.memory import estimate_memory
from bigtrain.plan.model import ModelSpec
from helpers import tiny_config, trainer_on_rank

LAYOUTS = {
    "zero1-bf16": ["--parallel.zero=1", "--precision.mode=bf16"],
    "zero3-fp32": ["--parallel.zero=3"],
    "zero0-fp32": ["--parallel.zero=0"],  # the replicated engine: weights and state apart
    "zero3-nvme": ["--parallel.zero=3", "--offload.optimizer=nvme", "--offload.params=nvme"],
    "zero2-adamw8bit": ["--parallel.zero=2", "--precision.mode=bf16", "--optim.name=adamw8bit"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_planner_prices_the_async_checkpoints_snapshot(layout, corpus_cache, tmp_path, monkeypatch):
    flags = ["--train.global_batch=2", "--train.micro_batch=2", f"--offload.nvme_dir={tmp_path / 'nvme'}",
             *LAYOUTS[layout]]
    cfg = tiny_config(corpus_cache, "--checkpoint.async=true", *flags)
    snapshots = []
    write = CheckpointWriter.write

    def recorded(self, step, chunks, meta, background):
        snapshots.append((background, tensor_bytes(c.data for c in chunks),
                          {c.data.device.type for c in chunks}))
        write(self, step, chunks, meta, background)

    monkeypatch.setattr(CheckpointWriter, "write", recorded)
    trainer = trainer_on_rank(0, 1, cfg, str(tmp_path))
    trainer.train_step()
    assert trainer.save()
    trainer.wait_for_save()
    [(background, measured, devices)] = snapshots
    assert background and devices == {"cpu"}
    mem = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg), PRESETS["cpu"],
                          cfg.train.global_batch, optimizer=cfg.optim.name)
    planned = mem.buffers["checkpoint_snapshot"]
    # a bound: the planner counts the padding of the shards and every piece's step count
    assert measured <= planned <= 1.01 * measured, (measured, planned)
    synchronous = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len),
                                  _layout(tiny_config(corpus_cache, *flags)), PRESETS["cpu"],
                                  cfg.train.global_batch, optimizer=cfg.optim.name)
    assert "checkpoint_snapshot" not in synchronous.buffers and synchronous.peak + planned == mem.peak


def test_on_a_gpu_the_snapshot_is_host_memory():
    spec = ModelSpec.from_model_config(tiny_config("").model, 64)
    cfg = tiny_config("", "--parallel.zero=1")
    plain = estimate_memory(spec, _layout(cfg, cuda=True), PRESETS["h100-80g"], 8)
    layout = _layout(tiny_config("", "--parallel.zero=1", "--checkpoint.async=true"), cuda=True)
    snapshot = estimate_memory(spec, layout, PRESETS["h100-80g"], 8)
    assert snapshot.detail["checkpoint_snapshot"] > 0 and snapshot.peak == plain.peak
    assert snapshot.host == plain.host + snapshot.detail["checkpoint_snapshot"]
    assert layout.checkpoint_async and "checkpoint_async" in layout.describe()


def _snapshot_bytes(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    return tensor_bytes(c.data for c in trainer.parallel.owned_chunks(copy=True, deferred=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--parallel.zero=0", "--parallel.zero=2"])
def test_over_two_ranks_each_snapshots_its_share(layout, corpus_cache, tmp_path):
    """The replicas' even split (stage 0) and the shards (stage 2): the worst rank within the bound."""
    from bigtrain.testing import run_ranks

    cfg = tiny_config(corpus_cache, "--checkpoint.async=true", "--parallel.dp=2", "--train.global_batch=4",
                      "--train.micro_batch=2", "--precision.mode=bf16", layout)
    measured = max(run_ranks(_snapshot_bytes, 2, cfg, str(tmp_path), timeout=300))
    planned = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg), PRESETS["cpu"],
                              cfg.train.global_batch).buffers["checkpoint_snapshot"]
    assert measured <= planned <= 1.01 * measured, (measured, planned)
