"""Local SGD (parallel.dp_sync = 'local-sgd'): replicas step alone and average parameters every K steps.

K = 1 is synchronous data parallel, bit for bit. K = 4 against an independent plain-PyTorch local SGD on
2 Gloo ranks (each a :class:`ReferenceRun` on its slice of the batch, parameters averaged with
``dist.all_reduce`` every 4 steps): fp32, per-step loss and final weights within 1e-5 relative. The bytes
the dp axis moves per step are 1/K of the synchronous engine's.
"""

import functools
import tempfile

import torch
import torch.distributed as dist

from bigtrain.check.reference import ReferenceRun
from bigtrain.testing import run_ranks
from helpers import assert_rel_close, params_of, run_steps, tiny_config, trainer_on_rank

STEPS = 8
K = 4
LOCAL = ["--parallel.dp=2", "--train.micro_batch=2", f"--train.steps={STEPS}"]


def _train(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses = run_steps(trainer, STEPS)
    stats = trainer.mesh.stats
    payload = {op: n for (axis, op), n in stats.payload.items() if axis == "dp"}
    return losses, params_of(trainer), payload


def _plain_local_sgd(rank, world_size, cfg):
    """Each rank a plain loop on its half of every batch; parameters averaged every K steps."""
    run = ReferenceRun(cfg, replica=(rank, world_size))
    losses = []
    for step in range(STEPS):
        local = torch.tensor([run.train_step().loss])
        dist.all_reduce(local)
        losses.append(float(local) / world_size)  # equal halves, no masking: the global mean
        if (step + 1) % K == 0:
            with torch.no_grad():
                for p in run.master.parameters():
                    dist.all_reduce(p)
                    p.div_(world_size)
    return losses, {n: p.detach().clone() for n, p in run.master.named_parameters()}


@functools.lru_cache(maxsize=None)
def _synchronous(cache_dir):
    with tempfile.TemporaryDirectory() as run_dir:
        return run_ranks(_train, 2, tiny_config(cache_dir, *LOCAL), run_dir)


def test_local_sgd_every_step_is_synchronous_data_parallel(corpus_cache, tmp_path):
    sync = _synchronous(corpus_cache)
    local = run_ranks(_train, 2, tiny_config(corpus_cache, *LOCAL, "--parallel.dp_sync=local-sgd",
                                             "--parallel.local_sgd_every=1"), str(tmp_path / "local"))
    for (sync_losses, sync_params, _), (local_losses, local_params, _) in zip(sync, local):
        assert sync_losses == local_losses
        for name, value in sync_params.items():
            assert torch.equal(local_params[name], value), name


def test_local_sgd_matches_plain_pytorch_and_moves_a_kth_of_the_bytes(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *LOCAL, "--parallel.dp_sync=local-sgd", f"--parallel.local_sgd_every={K}")
    results = run_ranks(_train, 2, cfg, str(tmp_path / "local"))
    reference = run_ranks(_plain_local_sgd, 2, cfg)
    ref_losses, ref_params = reference[0]
    for losses, params, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in ref_params.items():
            assert_rel_close(params[name], value, 1e-5, name)
    assert not torch.equal(results[0][1]["output.weight"], ReferenceRun(cfg).master.output.weight.detach()), \
        "the weights never moved"
    sync_bytes, local_payload = _synchronous(corpus_cache)[0][2]["all_reduce:grads"], results[0][2]
    assert "all_reduce:grads" not in local_payload
    assert local_payload["all_reduce:params"] * K == sync_bytes  # STEPS / K averages vs STEPS reductions
