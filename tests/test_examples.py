"""The examples run and learn: each one's training function on forked Gloo ranks, a few steps."""

import importlib.util
from pathlib import Path

import pytest
import torch

from bigtrain.testing import run_ranks
from tests.helpers import assert_rel_close

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    """An example script as a module (examples/ is not a package); its __main__ block does not run."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


zero3_custom_module = _load("zero3_custom_module")


def _train_zero3(rank, world_size, steps):
    return zero3_custom_module.train(rank, world_size, steps=steps, log=lambda line: None)


def test_zero3_custom_module_loss_falls_on_two_ranks():
    losses = run_ranks(_train_zero3, 2, 20, timeout=60)
    assert losses[0] == losses[1]  # the loss is all-reduced: every rank reports the same global value
    first, last = losses[0][0], sum(losses[0][-5:]) / 5
    assert last < 0.3 * first, f"loss did not fall: {losses[0]}"


parallelize_llama = _load("parallelize_llama")


def _train_llama(rank, world_size, steps):
    return parallelize_llama.train(rank, world_size, steps=steps, log=lambda line: None)


def test_a_users_llama_parallelized_without_a_config_trains_like_one_process():
    """dp 2 x tp 2 with sequence parallelism and ZeRO-1, from plan objects alone: the losses equal
    a plain one-process loop (fp32, 1e-5 relative)."""
    steps = 4
    losses = run_ranks(_train_llama, 4, steps, timeout=120)
    expected = parallelize_llama.reference(steps)
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)


parallelize_custom_module = _load("parallelize_custom_module")


def _train_custom(rank, world_size, steps, zero):
    return parallelize_custom_module.train(rank, world_size, steps=steps, zero=zero, log=lambda line: None)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_users_own_module_trained_with_a_plan_equals_a_plain_loop(zero):
    """A module of the user's own (no family, no Config; a buffer its constructor computes; blocks
    recomputed) at dp = 2 with the replicated engine and with ZeRO-3: every loss of 6 steps and every
    final weight within fp32 1e-5 of plain PyTorch in one process (torch.optim.AdamW, clip_grad_norm_)."""
    steps = 6
    results = run_ranks(_train_custom, 2, steps, zero, timeout=120)
    losses, weights = parallelize_custom_module.reference(steps)
    assert losses[-1] < losses[0]  # it learns
    for rank_losses, rank_weights in results:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(losses), rtol=1e-5, atol=0)
        assert set(rank_weights) == set(weights)
        for name, expected in weights.items():
            assert_rel_close(rank_weights[name], expected, 1e-5, name)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_buffer_without_a_value_is_refused_by_name(zero):
    """The replicated engine's to_empty gave a constructor-computed buffer uninitialized memory (it
    trained on garbage, silently); now an init_fn that does not know it is named, with the fix."""
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.parallel.build import parallelize

    example = parallelize_custom_module

    def weights_only(name, shape):
        if name == "positions":
            raise KeyError(name)
        return example.init_fn(name, shape)

    with torch.device("meta"):
        model = example.SequenceClassifier()
    with pytest.raises(ValueError, match=r"init_fn\('positions', \(8, 32\)\) raised KeyError.*give init_fn their values"):
        parallelize(model, Mesh({"dp": 1}, 0), example.plan(zero), init_fn=weights_only)
