"""The examples run and learn: each one's training function on forked Gloo ranks, a few steps."""

import importlib.util
from pathlib import Path

import torch

from bigtrain.testing import run_ranks

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
