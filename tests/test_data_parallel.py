"""Our data parallel against one process (the same global batch) and against torch DDP.

Tolerance: fp32, per-step loss within 1e-5 relative; parameters after 5 steps within 1e-5 relative.
"""

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from bigtrain.check.reference import reference_trajectory
from bigtrain.distributed.comm import sent_fraction
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model
from bigtrain.parallel.data import DataParallel
from bigtrain.testing import run_ranks
from bigtrain.parallel.build import token_loss_sum
from helpers import assert_rel_close, params_of, run_steps, tiny_config, trainer_on_rank

STEPS = 5


def _train_on_rank(rank, world_size, cfg, run_dir, steps):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses = run_steps(trainer, steps)
    return losses, (params_of(trainer) if rank == 0 else None)


@functools.lru_cache(maxsize=None)
def _reference(cache_dir: str):
    """The independent single-process loop (bigtrain.check.reference): losses and final weights."""
    losses, _, weights = reference_trajectory(tiny_config(cache_dir), STEPS)
    return losses, weights


@pytest.mark.parametrize("dp,micro_batch", [(2, 4), (2, 2), (4, 2), (4, 1)],
                         ids=["dp2", "dp2-accum2", "dp4", "dp4-accum2"])
def test_losses_and_params_match_one_process(dp, micro_batch, corpus_cache, tmp_path):
    ref_losses, ref_params = _reference(corpus_cache)
    cfg = tiny_config(corpus_cache, f"--parallel.dp={dp}", f"--train.micro_batch={micro_batch}")
    results = run_ranks(_train_on_rank, dp, cfg, str(tmp_path), STEPS)
    losses, params = results[0]
    assert all(r[0] == losses for r in results), "ranks disagree on the loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, ref in ref_params.items():
        assert_rel_close(params[name], ref, 1e-5, name)


def _traffic_of_one_step(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    stats = trainer.mesh.stats
    grads = [key for key in stats.payload if key == ("dp", "all_reduce:grads")]
    return stats.payload[grads[0]], stats.calls[grads[0]], stats.sent_bytes("dp", "all_reduce:grads")


@pytest.mark.parametrize("dp", [2, 4])
def test_all_reduce_traffic_is_the_ring_volume_of_the_gradients(dp, corpus_cache, tmp_path):
    # Accumulation 2 with a bucket per ~64 KiB: a sync on every micro-batch would double the bytes.
    cfg = tiny_config(corpus_cache, f"--parallel.dp={dp}", f"--train.micro_batch={8 // dp // 2}",
                      "--parallel.bucket_mb=0.0625")
    model = build_model(cfg.model)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    n_buckets = len(DataParallel(build_model(cfg.model, "cpu"), Mesh({}).comm("dp"), 0.0625).buckets)
    assert n_buckets > 3
    for payload, calls, sent in run_ranks(_traffic_of_one_step, dp, cfg, str(tmp_path)):
        assert payload == grad_bytes
        assert calls == n_buckets
        assert sent == pytest.approx(float(2 * (dp - 1) * grad_bytes / dp), rel=0, abs=1e-6)
        assert sent_fraction("all_reduce", dp) * grad_bytes == sent


def _launched_before_backward_ends(rank, world_size, cache_dir):
    cfg = tiny_config(cache_dir)
    mesh = Mesh({"dp": world_size}, rank)
    model = build_model(cfg.model, "cpu")
    model.init_weights(0)
    dp = DataParallel(model, mesh.comm("dp"), bucket_mb=0.0625)
    seen = []
    # The embedding's gradient is the last one backward produces.
    model.tok_embeddings.weight.register_hook(
        lambda g: seen.append(sum(b.work is not None for b in dp.buckets)) or g)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    token_loss_sum(model(tokens), tokens).backward()
    dp.finish_grad_sync()
    return seen[0], len(dp.buckets)


def test_buckets_are_all_reduced_while_backward_still_runs(corpus_cache):
    for launched, total in run_ranks(_launched_before_backward_ends, 2, corpus_cache):
        assert 0 < launched < total


def _ours_vs_ddp_grads(rank, world_size, cache_dir):
    cfg = tiny_config(cache_dir)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    ours = build_model(cfg.model, "cpu")
    ours.init_weights(7)
    dp = DataParallel(ours, Mesh({"dp": world_size}, rank).comm("dp"), bucket_mb=0.1)
    (token_loss_sum(ours(tokens), tokens) / world_size).backward()
    dp.finish_grad_sync()
    peer = build_model(cfg.model, "cpu")
    peer.init_weights(7)
    ddp = DistributedDataParallel(peer, bucket_cap_mb=0.1)
    token_loss_sum(ddp(tokens), tokens).backward()  # DDP averages over ranks
    return {n: (p.grad.clone(), q.grad.clone()) for (n, p), (_, q) in
            zip(ours.named_parameters(), peer.named_parameters())}


def test_gradients_equal_torch_ddp(corpus_cache):
    for grads in run_ranks(_ours_vs_ddp_grads, 2, corpus_cache):
        for name, (ours, ddp) in grads.items():
            assert_rel_close(ours, ddp, 1e-5, name)


def _no_sync_sends_nothing(rank, world_size, cache_dir):
    cfg = tiny_config(cache_dir)
    mesh = Mesh({"dp": world_size}, rank)
    model = build_model(cfg.model, "cpu")
    model.init_weights(0)
    dp = DataParallel(model, mesh.comm("dp"))
    after_init = mesh.stats.snapshot()  # the initial broadcast of rank 0's weights is not an accumulation step
    tokens = torch.randint(0, 256, (2, 16))
    with dp.no_sync():
        token_loss_sum(model(tokens), tokens).backward()
    return sum(mesh.stats.since(after_init).payload.values()), all(b.work is None for b in dp.buckets)


def test_accumulation_steps_do_not_communicate(corpus_cache):
    assert run_ranks(_no_sync_sends_nothing, 2, corpus_cache) == [(0, True), (0, True)]


def _torch_zero_grad_stays_synchronized(rank, world_size, cache_dir):
    cfg = tiny_config(cache_dir)
    model = build_model(cfg.model, "cpu")
    model.init_weights(0)
    dp = DataParallel(model, Mesh({"dp": world_size}, rank).comm("dp"))
    grads = []
    for step in range(2):
        model.zero_grad(set_to_none=True)  # torch's way, not dp.zero_grad()
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        token_loss_sum(model(tokens), tokens).backward()
        dp.finish_grad_sync()
        grads.append(model.layers[0].attention.wq.weight.grad.clone())
    return grads


def test_clearing_grads_the_torch_way_keeps_ranks_synchronized(corpus_cache):
    a, b = run_ranks(_torch_zero_grad_stays_synchronized, 2, corpus_cache)
    for ga, gb in zip(a, b):
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)
