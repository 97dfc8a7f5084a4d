"""One truth about memory (issue 28): the bytes an offloaded engine holds on the device, in host
memory and in NVMe files, measured from where its buffers live, equal the planner's prediction
exactly, for every offload layout; and the planner never proposes what the host cannot hold.

The engine runs its GPU path on the CPU (``OffloadPlan.separate_host``: host tensors apart from the
compute ones, every copy made), which is what the planner's tiers describe."""

from __future__ import annotations

import pytest
import torch

from bigtrain.plan import ModelSpec
from bigtrain.plan.fit import _layout
from bigtrain.plan.memory import rank_units
from bigtrain.plan.tiers import tier_bytes
from bigtrain.testing import run_ranks
from helpers import tiny_config, trainer_on_rank
from test_offload import _host_mode

# name -> the layout's flags (the fuzzer's offload tiers: ZeRO 1-3, optimizer cpu / nvme, params
# cpu / nvme, dp 1 / 2, fp32 / bf16, with and without the delayed update, AdamW and 8-bit AdamW)
TIER_CASES = {
    "zero1-cpu": ["--parallel.zero=1", "--offload.optimizer=cpu"],
    "zero1-nvme-bf16": ["--parallel.zero=1", "--precision.mode=bf16", "--offload.optimizer=nvme"],
    "zero2-cpu-bf16-delayed": ["--parallel.zero=2", "--precision.mode=bf16", "--offload.optimizer=cpu",
                               "--offload.delayed_update=true"],
    "zero2-nvme-delayed": ["--parallel.zero=2", "--offload.optimizer=nvme", "--offload.delayed_update=true"],
    "zero3-both-cpu-bf16": ["--parallel.zero=3", "--precision.mode=bf16", "--offload.optimizer=cpu",
                            "--offload.params=cpu"],
    "zero3-params-cpu": ["--parallel.zero=3", "--offload.params=cpu"],
    "zero3-both-nvme-delayed": ["--parallel.zero=3", "--offload.optimizer=nvme", "--offload.params=nvme",
                                "--offload.delayed_update=true"],
    "zero3-both-cpu-delayed": ["--parallel.zero=3", "--offload.optimizer=cpu", "--offload.params=cpu",
                               "--offload.delayed_update=true"],
    "zero3-8bit-nvme-bf16": ["--parallel.zero=3", "--precision.mode=bf16", "--optim.name=adamw8bit",
                             "--optim.block_size=32", "--offload.optimizer=nvme", "--offload.params=nvme"],
    "zero1-state-nvme-masters-cpu-bf16": ["--parallel.zero=1", "--precision.mode=bf16", "--offload.optimizer=nvme",
                                          "--offload.masters=cpu"],
    "dp2-zero2-state-nvme-masters-cpu-8bit-delayed": ["--parallel.dp=2", "--parallel.zero=2", "--precision.mode=bf16",
                                                      "--optim.name=adamw8bit", "--optim.block_size=32",
                                                      "--offload.optimizer=nvme", "--offload.masters=cpu",
                                                      "--offload.delayed_update=true"],
    "dp2-zero1-cpu-bf16": ["--parallel.dp=2", "--parallel.zero=1", "--precision.mode=bf16",
                           "--offload.optimizer=cpu"],
    "dp2-zero2-cpu": ["--parallel.dp=2", "--parallel.zero=2", "--offload.optimizer=cpu"],
    "dp2-zero2-nvme-bf16-delayed": ["--parallel.dp=2", "--parallel.zero=2", "--precision.mode=bf16",
                                    "--offload.optimizer=nvme", "--offload.delayed_update=true"],
    "dp2-zero3-both-nvme-bf16": ["--parallel.dp=2", "--parallel.zero=3", "--precision.mode=bf16",
                                 "--offload.optimizer=nvme", "--offload.params=nvme"],
    "dp2-zero3-both-cpu-delayed": ["--parallel.dp=2", "--parallel.zero=3", "--offload.optimizer=cpu",
                                   "--offload.params=cpu", "--offload.delayed_update=true"],
    # HSDP, two groups of one rank: each holds whole units, all-reduced across (not cut over dp = 2)
    "dp2-hsdp2x1-zero3-both-cpu": ["--parallel.dp=2", "--parallel.dp_replicate=2", "--parallel.zero=3",
                                   "--offload.optimizer=cpu", "--offload.params=cpu"],
}


def _configs(corpus_cache, tmp_path, names):
    return [tiny_config(corpus_cache, *TIER_CASES[n], f"--offload.nvme_dir={tmp_path / n}") for n in names]


def _after_two_steps(rank, world_size, cfgs, run_dir, measure):
    """Each config trained two steps (the optimizer's state exists), its update landed: ``measure``
    of its trainer."""
    out = []
    for i, cfg in enumerate(cfgs):
        trainer = trainer_on_rank(rank, world_size, cfg, f"{run_dir}/{i}")
        for _ in range(2):
            trainer.train_step()
        trainer.engine.finish_update()
        out.append(measure(trainer))
        trainer.engine.offload.close()
    return out


def _tiers(trainer):
    return trainer.engine.tier_bytes()


def _held(rank, world_size, cfgs, run_dir):
    return _after_two_steps(rank, world_size, cfgs, run_dir, _tiers)


def _predicted(cfg, rank):
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    layout = _layout(cfg, cuda=True)  # what the GPU path keeps where
    root, blocks = rank_units(model, layout, 0)
    return tier_bytes([root] + blocks, layout, cfg.optim.name, cfg.optim.block_size, rank=rank)


@pytest.mark.parametrize("world", [1, 2])
def test_the_engines_tiers_equal_the_planners_for_every_offload_layout(world, corpus_cache, tmp_path, monkeypatch):
    _host_mode("separate", monkeypatch)
    names = [n for n in TIER_CASES if n.startswith("dp2-") == (world == 2)]
    cfgs = _configs(corpus_cache, tmp_path, names)
    held = run_ranks(_held, world, cfgs, str(tmp_path / "run"), timeout=600)
    wrong = []
    for rank, per_rank in enumerate(held):
        for name, cfg, measured in zip(names, cfgs, per_rank):
            predicted = _predicted(cfg, rank)
            if measured != predicted:
                wrong.append(f"{name} rank {rank}: measured {measured}, planner {predicted}")
    assert not wrong, "\n".join(wrong)



@pytest.mark.parametrize("world", [1, 2])
def test_on_a_cpu_device_the_planner_prices_what_every_offload_layout_holds(world, corpus_cache, tmp_path):
    """On a CPU device the host is the device: the run holds one copy where the GPU path keeps two,
    and no buckets or staging. The planner priced offload there as the run without it, but the
    delayed update keeps a separate fp32 master and a second gradient (zero1-cpu-delayed: 2.10 MB
    priced against the 3.15 MB held, its optimizer state 33% under). The worst rank's model states
    as estimate_memory prices the run on this device (fit.size_check, run_info.prediction), byte for byte."""
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.memory import estimate_memory

    cases = {**TIER_CASES, "zero1-cpu-delayed": ["--parallel.zero=1", "--offload.optimizer=cpu",
                                                 "--offload.delayed_update=true"]}
    names = [n for n in cases if n.startswith("dp2-") == (world == 2)]
    cfgs = [tiny_config(corpus_cache, *cases[n], f"--offload.nvme_dir={tmp_path / n}", "--train.device=cpu")
            for n in names]
    held = run_ranks(_held, world, cfgs, str(tmp_path / "run"), timeout=600)
    wrong = []
    for i, (name, cfg) in enumerate(zip(names, cfgs)):
        measured = max((per_rank[i] for per_rank in held), key=lambda t: (t["device"], t["nvme"]))
        mem = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg, cuda=False),
                              get_profile("cpu"), cfg.train.global_batch, optimizer=cfg.optim.name,
                              block=cfg.optim.block_size)
        predicted = {"device": mem.model_states, "host": mem.detail["host_states"], "nvme": mem.nvme}
        if measured != predicted:
            wrong.append(f"{name}: measured {measured}, planner {predicted}")
    assert not wrong, "\n".join(wrong)

# -- gradients leave the device as they are produced ---------------------------------------------------
def _device_grads_during_backward(rank, world_size, cfg, run_dir):
    """The device tier's gradient bytes after every reduction of two steps (the engine's own
    measure: live parameter gradients, gradient shards and the buckets), the buckets' bytes, whether
    every fp32 gradient is a host tensor, and the whole fp32 gradient's bytes."""
    from bigtrain.parallel.zero.engine import ZeroEngine

    seen = []
    original = ZeroEngine._reduce

    def watched(self, unit):
        original(self, unit)
        seen.append(self.state_bytes()["grads"])

    ZeroEngine._reduce = watched
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    for _ in range(2):
        trainer.train_step()
    engine = trainer.engine
    link = engine.offload.link
    buckets = sum(t.untyped_storage().nbytes() for t in engine.offload.buffers() if link.tier_of(t) == "device")
    on_host = all(link.tier_of(u.grad_shard) == "host" and u.grad_shard.dtype == torch.float32
                  and not hasattr(u, "full_grad") for u in engine.units)
    whole = 4 * sum(u.shard_numel for u in engine.units)
    largest_unit = max(u.padded_numel for u in engine.units) * engine.precision.compute.itemsize
    return seen, buckets, engine.state_bytes()["grads"], on_host, whole, largest_unit


@pytest.mark.parametrize("layout", [["--parallel.zero=1"], ["--parallel.zero=2", "--precision.mode=bf16"],
                                    ["--parallel.dp=2", "--parallel.zero=1", "--train.micro_batch=2"],
                                    ["--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=2",
                                     "--offload.params=cpu"]],
                         ids=["zero1", "zero2-bf16", "zero1-dp2-accum2", "zero3-dp2-accum2-params"])
def test_no_whole_fp32_gradient_is_ever_held_on_the_device(layout, corpus_cache, tmp_path, monkeypatch):
    """With one gradient bucket, the device holds at most that bucket and the gradients of the unit
    whose backward is being reduced (the compute dtype), never a whole fp32 gradient: every unit's
    fp32 gradient is a host tensor, at any ZeRO stage and dp."""
    _host_mode("separate", monkeypatch)
    cfg = tiny_config(corpus_cache, *layout, "--offload.optimizer=cpu", "--offload.grad_buckets=1",
                      "--model.n_layers=4")
    for seen, buckets, between, on_host, whole, largest_unit in run_ranks(
            _device_grads_during_backward, cfg.parallel.world_size, cfg, str(tmp_path), timeout=240):
        assert on_host and between == buckets < whole
        assert seen and max(seen) <= buckets + largest_unit, (max(seen), buckets, largest_unit)
        assert max(seen) < whole, (max(seen), whole)


# -- start fast: everything allocated once, up front ------------------------------------------------------
def _tiers_before_and_after(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    before = trainer.engine.tier_bytes()
    for _ in range(2):
        trainer.train_step()
    trainer.engine.finish_update()
    return before, trainer.engine.tier_bytes(), sum(u.shard_numel for u in trainer.engine.units)


@pytest.mark.parametrize("name", ["zero2-cpu-bf16-delayed", "zero3-both-nvme-delayed", "dp2-zero3-both-cpu-delayed"])
def test_every_offload_buffer_is_allocated_before_the_first_step(name, corpus_cache, tmp_path, monkeypatch):
    """The pinned buffers (gradient buckets, accumulators, staging) and AdamW's state exist, and its
    NVMe files are written, when the engine is built: the first step allocates none of them (a
    gradient's file, at ZeRO 2-3 on NVMe, is written by the first reduction folded into it: with the
    delayed update, two a unit)."""
    _host_mode("separate", monkeypatch)
    cfg = _configs(corpus_cache, tmp_path, [name])[0]
    in_files = cfg.offload.optimizer == "nvme" and cfg.parallel.zero >= 2
    for before, after, shard in run_ranks(_tiers_before_and_after, cfg.parallel.world_size, cfg,
                                          str(tmp_path / "run"), timeout=240):
        assert (before["device"], before["host"]) == (after["device"], after["host"]), (before, after)
        grad_files = 4 * shard * (2 if cfg.offload.delayed_update else 1) if in_files else 0
        assert before["nvme"] + grad_files == after["nvme"], (before, after, shard)


def test_each_initial_value_is_computed_once(corpus_cache, tmp_path, monkeypatch):
    """Building the engine computes every parameter's initial value once (it was twice below ZeRO-3:
    once for the fp32 master, once for the compute weights), on threads, to the same values."""
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.models.llama import build_model
    from bigtrain.parallel.build import parallelize
    from bigtrain.from_config import parallel_plan

    cfg = tiny_config(corpus_cache, "--parallel.zero=2", "--precision.mode=bf16", "--offload.optimizer=cpu")
    model = build_model(cfg.model)
    calls = []

    def init(name, shape):
        calls.append(name)
        return model.initial_value(name, shape, cfg.train.seed)

    parallel = parallelize(model, Mesh({}), parallel_plan(cfg, str(tmp_path)), "cpu", init_fn=init)
    assert sorted(calls) == sorted(n for n, _ in parallel.model.named_parameters())
    reference = build_model(cfg.model, "cpu")
    reference.init_weights(cfg.train.seed)
    for n, w in parallel.engine.full_weights().items():
        assert torch.equal(w, reference.get_parameter(n).detach()), n


def _save_copies(rank, world_size, cfg, run_dir):
    """The most bytes a save holds in tensors of its own (not the engine's buffers, nor views or
    aliases of them), measured at each chunk the writer takes."""
    import bigtrain.checkpoint.sharded as sharded
    from bigtrain.parallel.zero.tiers import _buffers

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    for _ in range(2):
        trainer.train_step()
    trainer.engine.finish_update()
    buffers = [t.untyped_storage() for _, t, _ in _buffers(trainer.engine) if torch.is_tensor(t)]
    storages, live = {s._cdata for s in buffers}, [(s.data_ptr(), s.nbytes()) for s in buffers if s.nbytes()]

    def own(t):  # neither an engine buffer (one read back from its file too) nor an alias of one
        ptr = t.untyped_storage().data_ptr()
        return t.untyped_storage()._cdata not in storages and not any(a <= ptr < a + n for a, n in live)

    peak, original = [0], sharded._ChunkSavePlanner.resolve_data

    def measured(self, item):
        data = original(self, item)
        held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [c.data for c in self._data.values()] + [data] if own(t)}
        peak[0] = max(peak[0], sum(held.values()))
        return data

    sharded._ChunkSavePlanner.resolve_data = measured
    try:
        assert trainer.save()
        trainer.wait_for_save()
    finally:
        sharded._ChunkSavePlanner.resolve_data = original
    trainer.engine.offload.close()
    return peak[0]


@pytest.mark.parametrize("name", ["dp2-zero2-cpu", "zero2-cpu-bf16-delayed", "zero3-8bit-nvme-bf16",
                                  "dp2-zero2-nvme-bf16-delayed"])
def test_the_planner_prices_what_a_save_holds_beside_the_states(name, corpus_cache, tmp_path, monkeypatch):
    """A save of an offload layout copied the rank's whole masters and state into host memory
    before writing them, unpriced. It now writes the live states (views; those in files read back
    a unit at a time), and holds beside them the delayed update's weights in use (a copy of the
    compute weights) and, with files, the chunk being written: the planner's
    ``checkpoint_copy_bytes``, at most the one chunk over what is measured (the GPU path, on the CPU)."""
    from bigtrain.plan.memory import rank_units
    from bigtrain.plan.tiers import checkpoint_copy_bytes

    _host_mode("separate", monkeypatch)
    cfg, = _configs(corpus_cache, tmp_path, [name])
    measured = run_ranks(_save_copies, cfg.parallel.world_size, cfg, str(tmp_path / "run"), timeout=240)
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    layout = _layout(cfg, cuda=True)
    root, blocks = rank_units(model, layout, 0)
    planned = checkpoint_copy_bytes([root] + blocks, layout)
    files = "nvme" in (layout.offload_optimizer, layout.offload_params)
    chunk = 4 * max(-(-u.numel // (layout.size(u.axis) if layout.zero else 1)) for u in [root] + blocks)
    for held in measured:
        assert planned - chunk * files <= held <= planned, (held, planned, chunk)
    if layout.delayed_update:
        assert min(measured) > 0


def _states_tiers_and_parameters(trainer):
    return (trainer.engine.state_bytes(), trainer.engine.tier_bytes(),
            sum(p.numel() for p in trainer.model.parameters()))


def _state_and_tiers(rank, world_size, cfgs, run_dir):
    return _after_two_steps(rank, world_size, cfgs, run_dir, _states_tiers_and_parameters)


@pytest.mark.parametrize("mode", ["same", "separate"])
def test_state_bytes_and_tier_bytes_count_the_same_buffers(mode, corpus_cache, tmp_path, monkeypatch):
    """state_bytes (the metrics' params / grads / optimizer) left out the delayed update's
    handed-over gradient that tier_bytes counts (on a CPU device: 2.63 MB against 3.15 MB held, fp32
    ZeRO-1): both now count one set of buffers, state_bytes by kind (offload's buffers as
    gradients), tier_bytes by tier."""
    _host_mode(mode, monkeypatch)
    names = ["zero1-cpu", "zero2-cpu-bf16-delayed", "zero3-both-nvme-delayed", "zero3-8bit-nvme-bf16"]
    cfgs = _configs(corpus_cache, tmp_path, names) + [tiny_config(corpus_cache, "--parallel.zero=1",
                                                                  "--offload.optimizer=cpu",
                                                                  "--offload.delayed_update=true")]
    for (states, tiers, params), name in zip(run_ranks(_state_and_tiers, 1, cfgs, str(tmp_path / "run"))[0],
                                             names + ["zero1-cpu-delayed"]):
        in_memory = tiers["device"] + (tiers["host"] if mode == "same" else 0)
        assert sum(states.values()) == in_memory, (name, states, tiers)
        if name == "zero1-cpu-delayed" and mode == "same":  # the unit's fp32 gradient and the one handed over
            assert states["grads"] == 2 * 4 * params, (states, params)
