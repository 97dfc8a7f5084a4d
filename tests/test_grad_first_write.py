"""Stages 0-1 in mixed precision copy each parameter's first gradient of a step into the freed fp32
buffer instead of zeroing the buffer and adding into it (bigtrain/parallel/zero/lazy_grads.py,
``LazyGrads.grow``), and stage 2 its first reduced shard (``LazyGrads.regrow``): the same numbers
bit for bit as zeros plus an add (the buffers kept and zeroed, ``KeptGrads``), and one full pass
less of each kind, pinned by counting the ops of a step."""

import collections

import pytest
import torch

from bigtrain.parallel.zero.lazy_grads import KeptGrads
from helpers import tiny_config, trainer_on_rank


def _train(cfg, run_dir, steps, zeros_then_add):
    trainer = trainer_on_rank(0, 1, cfg, run_dir)
    engine = trainer.engine
    if zeros_then_add:  # the arithmetic before: buffers kept, zeroed after each step, every gradient added
        engine._lazy.ensure_all()
        engine._lazy = KeptGrads()
    losses = [trainer.train_step().loss for _ in range(steps)]
    return losses, engine.full_weights(), engine.full_state()[1]["state"]


@pytest.mark.parametrize("stage,mode,micro", [(0, "bf16", 2), (1, "bf16", 4), (0, "fp16", 1), (1, "fp16", 2),
                                              (2, "bf16", 2), (2, "fp16", 1), (2, "fp32", 1)])
def test_first_gradient_copied_is_bit_identical_to_zeros_plus_add(stage, mode, micro, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, f"--parallel.zero={stage}", f"--precision.mode={mode}",
                      "--train.global_batch=4", f"--train.micro_batch={micro}")
    losses, weights, state = _train(cfg, str(tmp_path / "copy"), 3, zeros_then_add=False)
    ref_losses, ref_weights, ref_state = _train(cfg, str(tmp_path / "add"), 3, zeros_then_add=True)
    assert losses == ref_losses
    for name in ref_weights:
        assert torch.equal(weights[name], ref_weights[name]), name
        for key, value in ref_state[name].items():
            assert torch.equal(state[name][key], value), (name, key)


FULL_PASS_OPS = ("aten::add_", "aten::fill_", "aten::copy_")


def _elements_per_op(trainer) -> collections.Counter:
    """Elements each op of ``FULL_PASS_OPS`` went over in one step (first input's size), from the
    CPU profiler: the passes over parameter-sized tensors the step makes (activations included,
    alike before and after)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.train_step()
    out = collections.Counter()
    for event in prof.events():
        if event.name in FULL_PASS_OPS and event.input_shapes and event.input_shapes[0]:
            out[event.name] += int(torch.tensor(event.input_shapes[0]).prod())
    return out


# Per stage: (fills, adds) a step may make, in elements of every unit: ZeRO-0 makes none over its fp32
# buffer (activations' and the padding's zeros, the backward's own adds: 1.5 and 3.75 before the copy);
# ZeRO-2's first reduced shard is copied, not added to zeros (before: 2.26 and 1.87; what is left is
# its flat gradient buffer zeroed for each reduction, and the backward's adds).
MOST_PASSES = {0: (0.6, 2.8), 2: (1.3, 0.9)}


@pytest.mark.parametrize("stage", [0, 2])
def test_a_step_makes_no_zeroing_pass_and_no_add_pass_over_its_gradients(stage, corpus_cache, tmp_path):
    """One micro-batch, ZeRO-0 (the GPU profile's step) or ZeRO-2, bf16, one rank: the fp32 gradient
    buffer (ZeRO-2's shard) is neither zeroed (a fill over every parameter) nor added into; each
    gradient is copied once. The counts are the tiny model's step's, with ``params`` the elements of
    every unit (MOST_PASSES: the bounds, and the counts before the copy)."""
    cfg = tiny_config(corpus_cache, f"--parallel.zero={stage}", "--precision.mode=bf16", "--train.global_batch=4",
                      "--train.micro_batch=4")
    trainer = trainer_on_rank(0, 1, cfg, str(tmp_path))
    params = sum(u.numel for u in trainer.engine.units)
    trainer.train_step()
    seen = _elements_per_op(trainer)
    fills, adds = MOST_PASSES[stage]
    assert seen["aten::fill_"] < fills * params, (seen, params)
    assert seen["aten::add_"] < adds * params, (seen, params)
