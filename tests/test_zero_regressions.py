"""Regressions of the gradient engines that trained silently wrong, each against what it should equal.

Tolerances: fp32 per-step losses within 1e-5 relative of the independent single-process loop
(``bigtrain.check.reference``); accumulated bf16 gradients
within fp32 rounding (1e-6 relative) of their fp32 sum, where a bf16 sum is ~1e-3 off.
"""

import functools
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bigtrain.check.reference import reference_losses
from bigtrain.config import ModelConfig, OptimConfig, PrecisionConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model, init_value
from bigtrain.parallel.build import token_loss_sum
from bigtrain.parallel.data import DataParallel
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import Precision
from bigtrain.testing import run_ranks
from helpers import run_steps, tiny_config, trainer_on_rank
from test_examples import zero3_custom_module

STEPS = 4
BATCH = ["--train.global_batch=4", f"--train.steps={STEPS}"]


@functools.lru_cache(maxsize=None)
def _one_process(cache_dir: str, *overrides: str) -> list[float]:
    return reference_losses(tiny_config(cache_dir, *BATCH, "--train.micro_batch=4", *overrides), STEPS)


def _losses(rank, world_size, cfg, run_dir):
    return run_steps(trainer_on_rank(rank, world_size, cfg, run_dir), STEPS)


# -- 1. ZeRO-3 under pipelines: no unit may be read with the weights of before a step ---------------
# Stages without a root unit (pp=3's middle stage: blocks only; interleaved chunks: no unit spans the
# rank's model) and a dp group of one rank (pp=3, dp=1) or two.
PIPELINES = {
    "pp3": (3, ["--parallel.pp=3"]),
    "pp2-interleaved-v3": (2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=3"]),
    "dp2-pp2": (4, ["--parallel.dp=2", "--parallel.pp=2"]),
    "dp2-pp2-interleaved-v3": (4, ["--parallel.dp=2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved",
                                   "--parallel.pp_virtual=3"]),
}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_zero3_under_a_pipeline_matches_one_process(layout, corpus_cache, tmp_path):
    world_size, parallel = PIPELINES[layout]
    expected = _one_process(corpus_cache, "--model.n_layers=6")
    cfg = tiny_config(corpus_cache, *BATCH, "--model.n_layers=6", "--train.micro_batch=1", "--parallel.zero=3",
                      *parallel)
    for losses in run_ranks(_losses, world_size, cfg, str(tmp_path), timeout=180):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def _gathered_after_step(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.train_step()
    return [u.name for u in trainer.engine.units if u.gathered]


def test_no_zero3_unit_stays_gathered_across_the_optimizer_step(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *BATCH, "--model.n_layers=6", "--train.micro_batch=1", "--parallel.zero=3",
                      *PIPELINES["pp3"][1])
    assert run_ranks(_gathered_after_step, 3, cfg, str(tmp_path)) == [[], [], []]


class _BlocksCalledInReverse(zero3_custom_module.ResidualMLP):
    def forward(self, x):
        for block in reversed(self.blocks):  # not the order the units were given in
            x = x + block(x)
        return self.head(x).squeeze(-1)


def _zero3_losses(prefetch: bool) -> list[float]:
    with torch.device("meta"):
        model = _BlocksCalledInReverse(dim=16, hidden=32, n_blocks=3)
    engine = ZeroEngine(model, Mesh({"dp": 1}).comm("dp"), 3, Precision(torch.float32, torch.float32),
                        OptimConfig(lr=1e-2), init_fn=zero3_custom_module.init_fn, unit_modules=list(model.blocks),
                        prefetch=prefetch)
    losses = []
    for step in range(3):
        x, y = zero3_custom_module.batch(step, 0, 8, 16)
        loss = (model(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.finish_grad_sync()
        engine.step(1e-2, max_norm=1.0)
        engine.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_a_prefetch_the_model_did_not_use_is_not_read_after_the_step():
    # Prefetching follows the order the units were given in; whatever it gathered in vain must go at the step.
    assert _zero3_losses(prefetch=True) == _zero3_losses(prefetch=False)


# -- 2. torch's own zero_grad must not lose the gradients of stages 0-1 -----------------------------
def _losses_clearing_grads_the_torch_way(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    out = []
    for _ in range(STEPS):
        trainer.model.zero_grad()  # set_to_none: drops the engine's views into its flat buffers
        result = trainer.train_step()
        out.append((result.loss, result.grad_norm))
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_torch_zero_grad_between_steps_keeps_every_gradient(stage, corpus_cache, tmp_path):
    # bf16 puts stage 0 in the ZeRO engine too (fp32 stage 0 is the replicated engine); accumulation 2.
    layout = ["--parallel.dp=2", "--train.micro_batch=1", f"--parallel.zero={stage}", "--precision.mode=bf16"]
    cfg = tiny_config(corpus_cache, *BATCH, *layout)
    expected = run_ranks(_losses, 2, cfg, str(tmp_path / "plain"))[0]
    got = run_ranks(_losses_clearing_grads_the_torch_way, 2, cfg, str(tmp_path / "cleared"))[0]
    assert min(norm for _, norm in got) > 0.0
    assert [loss for loss, _ in got] == expected


def test_torch_zero_grad_between_steps_matches_one_process_in_fp32(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *BATCH, "--parallel.dp=2", "--train.micro_batch=1", "--parallel.zero=1")
    got = run_ranks(_losses_clearing_grads_the_torch_way, 2, cfg, str(tmp_path))[0]
    torch.testing.assert_close(torch.tensor([loss for loss, _ in got]), torch.tensor(_one_process(corpus_cache)),
                               rtol=1e-5, atol=0)


# -- 3. bf16 gradients accumulate in fp32; an fp32 reduction stays fp32 ------------------------------
SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=250)
MICRO_BATCHES = 4


def _tokens(rank: int, micro_batch: int) -> torch.Tensor:
    return torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(100 * rank + micro_batch))


def _bf16_grads_summed_in_fp32(rank: int) -> dict[str, torch.Tensor]:
    """This rank's gradient of every micro-batch, computed by plain PyTorch in bf16, summed in fp32."""
    model = build_model(SMALL, "cpu")
    model.init_buffers("cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(name, tuple(p.shape), 0, SMALL))
    for p in model.parameters():  # the rotary tables stay fp32, as in the engine's model
        p.data = p.data.to(torch.bfloat16)
    total = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for mb in range(MICRO_BATCHES):
        tokens = _tokens(rank, mb)
        grads = torch.autograd.grad(token_loss_sum(model(tokens), tokens) / 64, list(model.parameters()))
        for (name, _), grad in zip(model.named_parameters(), grads):
            total[name] += grad.float()
    return total


def _accumulated_grad_shards(rank, world_size, stage, reduce_dtype):
    model = build_model(SMALL)
    comm = Mesh({"dp": world_size}, rank).comm("dp")
    precision = Precision.from_config(PrecisionConfig(mode="bf16", reduce_dtype=reduce_dtype))
    engine = ZeroEngine(model, comm, stage, precision, OptimConfig(), init_fn=lambda n, s: init_value(n, s, 0, SMALL))
    model.init_buffers("cpu")
    for mb in range(MICRO_BATCHES):
        tokens = _tokens(rank, mb)
        with engine.no_sync() if mb < MICRO_BATCHES - 1 else nullcontext():
            engine.backward(token_loss_sum(model(tokens), tokens) / 64)
    engine.finish_grad_sync()
    expected = _bf16_grads_summed_in_fp32(rank)
    for grad in expected.values():  # the sum over ranks, in fp32
        dist.all_reduce(grad) if world_size > 1 else None
    out = []
    for unit in engine.units:
        want = unit.shard_of(unit.flatten(expected, torch.float32, "cpu"))
        out.append((unit.name, unit.grad_shard.dtype, unit.grad_shard.float(), want))
    return out


@pytest.mark.parametrize("world_size,reduce_dtype", [(1, "auto"), (2, "fp32")], ids=["one-rank", "fp32-reduce"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_micro_batch_gradients_accumulate_in_fp32(stage, world_size, reduce_dtype):
    for rank_shards in run_ranks(_accumulated_grad_shards, world_size, stage, reduce_dtype):
        for name, dtype, got, want in rank_shards:
            err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
            assert err < 1e-6, f"stage {stage}, {name}: {err:.1e} from the fp32 sum of the bf16 gradients"
            assert dtype == torch.float32, f"{name}: the gradient the optimizer reads is {dtype}"


# -- 4. DataParallel starts every replica from rank 0's weights --------------------------------------
def _replicas_after_construction(rank, world_size, cache_dir):
    cfg = tiny_config(cache_dir)
    model = build_model(cfg.model, "cpu")
    model.init_weights(seed=rank)  # a user's script that seeded every rank differently
    model.rope_cos.add_(rank)  # and a buffer that differs
    comm = Mesh({"dp": world_size}, rank).comm("dp")
    DataParallel(model, comm)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({"rope_cos": model.rope_cos.clone()})
    return state, comm.stats.calls.get(("dp", "broadcast:init"), 0)


def test_data_parallel_broadcasts_the_first_ranks_weights_and_buffers(corpus_cache):
    (first, calls), (second, _) = run_ranks(_replicas_after_construction, 2, corpus_cache)
    reference = build_model(tiny_config(corpus_cache).model, "cpu")
    reference.init_weights(seed=0)
    for name, value in first.items():
        assert torch.equal(second[name], value), f"the replicas differ in {name}"
    for name, p in reference.named_parameters():
        assert torch.equal(first[name], p.detach()), f"{name} is not rank 0's initial value"
    assert torch.equal(first["rope_cos"], reference.rope_cos)
    assert calls > 0, "the initial broadcast goes through the counted AxisComm"


# -- 5. ZeroEngine finds the blocks of a user's module, or says it cannot ----------------------------
def _engine_on(model: nn.Module, stage: int = 3) -> ZeroEngine:
    return ZeroEngine(model, Mesh({"dp": 1}).comm("dp"), stage, Precision(torch.float32, torch.float32),
                      OptimConfig(), init_fn=zero3_custom_module.init_fn)


def test_zero_engine_finds_blocks_that_are_not_named_layers():
    with torch.device("meta"):
        model = zero3_custom_module.ResidualMLP(dim=16, hidden=32, n_blocks=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = _engine_on(model)
    assert engine.unit_modules == [model, *model.blocks]  # the root (the head) and one unit per block
    assert [len(u.params) for u in engine.units] == [2, 6, 6, 6]


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def test_zero_engine_warns_when_it_finds_no_blocks():
    with torch.device("meta"):
        model = _NoBlocks()
    with pytest.warns(UserWarning, match=r"_NoBlocks.*unit_modules"):
        engine = _engine_on(model)
    assert len(engine.units) == 1
