"""The memory-efficient optimizers under layouts, against the independent single-process reference
(``bigtrain check``: torch.optim.Adafactor, the paper's Lion, a plain 8-bit AdamW), and 8-bit AdamW's
quantized state bit for bit: ZeRO cuts fall on block boundaries, so with the same gradient a shard
holds exactly the one-process state of its elements."""

from __future__ import annotations

import pytest
import torch

from bigtrain.check.run import check_on_rank
from bigtrain.config import ModelConfig, OptimConfig, PrecisionConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model, init_value
from bigtrain.optim import get_optimizer
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import Precision
from bigtrain.testing import run_ranks
from helpers import tiny_config

COMMON = ["--optim.block_size=32", "--train.global_batch=4", "--train.micro_batch=1", "--optim.warmup_steps=0"]
CASES = {
    "lion-zero2-dp2": ["--optim.name=lion", "--parallel.dp=2", "--parallel.zero=2"],
    "lion-tp2": ["--optim.name=lion", "--parallel.tp=2"],
    "adafactor-zero1-dp2": ["--optim.name=adafactor", "--parallel.dp=2", "--parallel.zero=1"],
    "adafactor-zero3-dp2": ["--optim.name=adafactor", "--parallel.dp=2", "--parallel.zero=3"],
    "adafactor-tp2": ["--optim.name=adafactor", "--parallel.tp=2"],
    "adafactor-pp2": ["--optim.name=adafactor", "--parallel.pp=2"],
    "adafactor-zero2-dp2-tp2": ["--optim.name=adafactor", "--parallel.dp=2", "--parallel.zero=2", "--parallel.tp=2"],
    "adamw8bit-zero1-dp2": ["--optim.name=adamw8bit", "--parallel.dp=2", "--parallel.zero=1"],
    "adamw8bit-zero3-dp2": ["--optim.name=adamw8bit", "--parallel.dp=2", "--parallel.zero=3"],
    "adamw8bit-tp2": ["--optim.name=adamw8bit", "--parallel.tp=2"],
    "adamw8bit-pp2": ["--optim.name=adamw8bit", "--parallel.pp=2"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_the_reference(name, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *COMMON, *CASES[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 5, timeout=240)[0]
    assert report.agree, report.text()


# -- 8-bit state, bit for bit ---------------------------------------------------------------------
MODEL = ModelConfig(dim=40, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, vocab_size=72)
BLOCK = 64  # no parameter of MODEL is a multiple of it: units are padded between parameters


def _exact_gradient_steps(rank, world_size, stage, steps):
    """ZeRO over ``world_size`` ranks where rank 0's gradient is the whole gradient and the others'
    are zero, so the reduced gradient equals the one-process gradient exactly; returns the
    engine's full weights and optimizer state after ``steps`` steps."""
    model = build_model(MODEL)
    model.init_buffers("cpu")
    cfg = OptimConfig(name="adamw8bit", block_size=BLOCK, lr=1e-2)
    engine = ZeroEngine(model, Mesh({"dp": world_size}, rank).comm("dp"), stage,
                        Precision.from_config(PrecisionConfig(mode="fp32")), cfg,
                        init_fn=lambda n, s: init_value(n, s, 0, MODEL))
    assert all(u.shard_numel % BLOCK == 0 and all(s.offset % BLOCK == 0 for s in u.slots) for u in engine.units)
    for step in range(steps):
        tokens = torch.randint(0, MODEL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = engine.model(tokens).float().logsumexp(-1).mean() * (1.0 if rank == 0 else 0.0)
        engine.backward(loss)
        engine.finish_grad_sync()
        engine.step(1e-2, float("inf"))
        engine.zero_grad()
    return engine.full_state()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adamw8bit_zero_shards_hold_the_one_process_state_bit_for_bit(stage):
    one = run_ranks(_exact_gradient_steps, 1, stage, 3)[0]
    two = run_ranks(_exact_gradient_steps, 2, stage, 3)
    for weights, optim in two:
        for name, w in one[0].items():
            assert torch.equal(weights[name], w), name
        for name, state in one[1]["state"].items():
            for key, value in state.items():
                assert torch.equal(optim["state"][name][key].reshape(-1), value.reshape(-1)), (name, key)
    block_state = one[1]["state"]["layers.0.attention.wq.weight"]["exp_avg_scale"]
    assert block_state.numel() == -(-40 * 40 // BLOCK)


def test_misaligned_cuts_would_change_the_state():
    """The property above is not vacuous: the same elements stepped from an unaligned start hold
    other scales and codes."""
    cfg = OptimConfig(name="adamw8bit", block_size=BLOCK)
    full, part = torch.nn.Parameter(torch.randn(512)), None
    part = torch.nn.Parameter(full.detach()[32:].clone())  # starts mid-block
    optimizers = [get_optimizer("adamw8bit").build([{"params": [p], "weight_decay": 0.0}], cfg) for p in (full, part)]
    g = torch.randn(512) * torch.logspace(-3, 0, 512)
    full.grad, part.grad = g, g[32:].clone()
    for o in optimizers:
        o.step()
    assert not torch.equal(optimizers[0].state[full]["exp_avg"][32:], optimizers[1].state[part]["exp_avg"])


# -- checkpoints: the state reshards to another layout unchanged ------------------------------------
def _save_state(rank, world_size, cfg, run_dir, steps):
    from helpers import trainer_on_rank

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    for _ in range(steps):
        trainer.train_step()
    trainer.save()
    return trainer.parallel.full_state()


def _loaded_state(rank, world_size, cfg, run_dir):
    from helpers import trainer_on_rank

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    assert trainer.resume("auto")
    return trainer.parallel.full_state()


@pytest.mark.parametrize("optimizer,saved,resumed", [
    ("adamw8bit", ["--parallel.dp=2", "--parallel.zero=1"], ["--parallel.tp=2"]),
    ("adamw8bit", ["--parallel.tp=2"], ["--parallel.dp=2", "--parallel.zero=3"]),
    ("adafactor", ["--parallel.dp=2", "--parallel.zero=2"], ["--parallel.tp=2"]),
    ("adafactor", ["--parallel.pp=2"], ["--parallel.dp=2", "--parallel.zero=3"]),
], ids=["8bit-zero1-to-tp2", "8bit-tp2-to-zero3", "adafactor-zero2-to-tp2", "adafactor-pp2-to-zero3"])
def test_optimizer_state_reshards_exactly(optimizer, saved, resumed, corpus_cache, tmp_path):
    """Saved under one layout and loaded under another, every state tensor (8-bit codes, per-block
    scales, factored statistics, step counts) is what was saved, bit for bit."""
    common = [*COMMON, f"--optim.name={optimizer}", "--train.steps=8"]
    a = tiny_config(corpus_cache, *common, *saved)
    before = run_ranks(_save_state, a.parallel.world_size, a, str(tmp_path), 3, timeout=240)[0]
    b = tiny_config(corpus_cache, *common, *resumed, "--checkpoint.resume=auto")
    after = run_ranks(_loaded_state, b.parallel.world_size, b, str(tmp_path), timeout=240)[0]
    assert before[1]["state"] and set(after[1]["state"]) == set(before[1]["state"])
    for name, state in before[1]["state"].items():
        assert set(state) == set(get_optimizer(optimizer).element_state + get_optimizer(optimizer).block_state
                                 + get_optimizer(optimizer).tensor_state)
        for key, value in state.items():
            assert torch.equal(after[1]["state"][name][key].reshape(-1), value.reshape(-1)), (name, key)
    for name, w in before[0].items():
        assert torch.equal(after[0][name], w), name


# -- memory: measured from live storages, against the planner and the per-parameter figures ----------
def _measured(rank, world_size, cfg, run_dir):
    from helpers import trainer_on_rank

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    mem = trainer.train_step(measure=True).mem
    local = sum(p.numel() for p in trainer.model.parameters())
    return mem, local


@pytest.mark.parametrize("optimizer,per_param", [("adamw", (8.0, 8.1)), ("adamw8bit", (2.0, 2.1)),
                                                 ("lion", (4.0, 4.01)), ("adafactor", (0.0, 0.5))])
@pytest.mark.parametrize("layout", ["replicated-fp32", "zero1-dp2-bf16", "zero3-dp2-fp32", "tp2-fp32"])
def test_state_bytes_measured_match_the_planner(optimizer, per_param, layout, corpus_cache, tmp_path):
    from bigtrain.plan import PRESETS, Layout, ModelSpec, estimate_memory

    lay = {"replicated-fp32": Layout(dp=1, micro_batch=1, precision="fp32"),
           "zero1-dp2-bf16": Layout(dp=2, zero=1, micro_batch=1, precision="bf16"),
           "zero3-dp2-fp32": Layout(dp=2, zero=3, micro_batch=1, precision="fp32"),
           "tp2-fp32": Layout(tp=2, micro_batch=1, precision="fp32")}[layout]
    block = 32 if lay.tp > 1 else 256  # tp=2 cuts rows of 64 into 32: a block may not straddle them
    cfg = tiny_config(corpus_cache, f"--optim.name={optimizer}", f"--optim.block_size={block}", *lay.to_overrides())
    measured, local = run_ranks(_measured, cfg.parallel.world_size, cfg, str(tmp_path), timeout=240)[0]
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    predicted = estimate_memory(model, lay, PRESETS["cpu"], cfg.train.global_batch, optimizer=optimizer, block=block)
    for key in ("params", "grads", "optimizer"):
        assert abs(getattr(predicted, key) - measured[key]) <= 0.01 * measured[key], (key, predicted, measured)
    if layout == "replicated-fp32":
        lo, hi = per_param
        assert lo <= measured["optimizer"] / local <= hi, measured["optimizer"] / local


# -- bad input: rejected before launch, naming the field and the fix -----------------------------------
def test_a_block_that_tp_would_split_is_rejected_at_validation():
    from bigtrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.block_size = 256 must divide .*model.dim / parallel.tp = 32.*"
                                          r"use optim.block_size = 32"):
        tiny_config("", "--optim.name=adamw8bit", "--parallel.tp=2")
    with pytest.raises(ConfigError, match=r"optim.block_size = 0: must be"):
        tiny_config("", "--optim.name=adamw8bit", "--optim.block_size=0")
    tiny_config("", "--optim.name=adamw8bit", "--parallel.tp=2", "--optim.block_size=32")  # accepted


def test_the_engine_refuses_a_cut_that_splits_a_block():
    """What validation prevents, the runtime refuses too, naming the parameter (a model the
    validation rule does not know)."""
    from bigtrain.parallel.blocks import block_cuts
    from bigtrain.parallel.placement import dense, even_shard

    placement = dense().with_shard(even_shard(64, 2, 0, dim=1))  # a row-parallel 48 x 64 weight
    with pytest.raises(ValueError, match=r"w: its part \(48, 32\) of \(48, 64\).*block of 64 elements"):
        block_cuts("w", placement, (48, 32), 64)
    assert block_cuts("w", placement, (48, 32), 32)[0].padded_size == 2
