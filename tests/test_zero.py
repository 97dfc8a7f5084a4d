"""ZeRO stages 1-3 against the independent single-process loop (``bigtrain.check.reference``);
measured memory and traffic against the ZeRO formulas.

Tolerances: fp32 per-step loss, gradient norm and final weights within 1e-5 relative. bf16 against
the bf16 reference at 1e-3 over 20 steps lives in tests/test_reference_parity.py, with the mutation
that shows the bound can fail.
"""

import contextlib
import functools
import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from bigtrain.check.reference import reference_trajectory
from bigtrain.config import ModelConfig, OptimConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.spares import CAN_MOVE_BYTES
from bigtrain.models.llama import build_model, count_parameters, init_value
from bigtrain.optim import get_optimizer
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import DynamicLossScaler, Precision
from bigtrain.testing import RankFailure, run_fake_rank, run_ranks
from bigtrain.parallel.build import token_loss_sum
from helpers import assert_rel_close, tiny_config, trainer_on_rank

STEPS = 5


def _train(rank, world_size, cfg, run_dir, steps):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    results = [trainer.train_step() for _ in range(steps)]
    weights, _ = trainer.engine.full_state()
    return [r.loss for r in results], [r.grad_norm for r in results], weights if rank == 0 else None


@functools.lru_cache(maxsize=None)
def _reference(cache_dir: str, *overrides: str, steps: int = STEPS):
    return reference_trajectory(tiny_config(cache_dir, *overrides), steps)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp,micro_batch", [(2, 4), (2, 2), (4, 2), (4, 1)],
                         ids=["dp2", "dp2-accum2", "dp4", "dp4-accum2"])
def test_fp32_stages_match_one_process(stage, dp, micro_batch, corpus_cache, tmp_path):
    # A low clip threshold makes clipping act on every step, so the global norm must be right.
    ref_losses, ref_norms, ref_weights = _reference(corpus_cache, "--optim.grad_clip=0.5")
    cfg = tiny_config(corpus_cache, f"--parallel.dp={dp}", f"--train.micro_batch={micro_batch}",
                      f"--parallel.zero={stage}", "--optim.grad_clip=0.5")
    results = run_ranks(_train, dp, cfg, str(tmp_path), STEPS)
    losses, norms, weights = results[0]
    assert all(r[0] == losses for r in results), "ranks disagree on the loss"
    assert min(ref_norms) > 0.5, "clipping must be active for this test to mean anything"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    for name, ref in ref_weights.items():
        assert_rel_close(weights[name], ref, 1e-5, name)


def test_stage3_keeping_parameters_between_forward_and_backward_matches(corpus_cache, tmp_path):
    ref_losses, _, _ = _reference(corpus_cache)
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--train.micro_batch=4", "--parallel.zero=3",
                      "--parallel.reshard_after_forward=false", "--parallel.prefetch=false",
                      "--memory.checkpointing=full")
    losses = run_ranks(_train, 2, cfg, str(tmp_path), STEPS)[0][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_zero_with_one_rank_behaves_as_stage_0(corpus_cache, tmp_path):
    ref_losses, _, _ = _reference(corpus_cache)
    for stage in (1, 3):
        cfg = tiny_config(corpus_cache, "--train.micro_batch=8", f"--parallel.zero={stage}")
        losses = _train(0, 1, cfg, str(tmp_path / str(stage)), STEPS)[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


# -- memory ----------------------------------------------------------------------------------------
MEM_MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=250)


def _engine(rank, world_size, stage, mode="bf16", **kw):
    model = build_model(MEM_MODEL)
    model.init_buffers("cpu")
    comm = Mesh({"dp": world_size}, rank).comm("dp")
    return ZeroEngine(model, comm, stage, Precision.from_config(_precision(mode)), OptimConfig(),
                      init_fn=lambda n, s: init_value(n, s, 0, MEM_MODEL), **kw)


def _precision(mode):
    from bigtrain.config import PrecisionConfig

    return PrecisionConfig(mode=mode)


def _states_after_a_step(rank, world_size, stage):
    engine = _engine(rank, world_size, stage)
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(token_loss_sum(engine.model(tokens), tokens) / 64)
    engine.finish_grad_sync()
    engine.step(1e-3, 1.0)  # creates the Adam moments
    padding = sum(u.padded_numel - u.numel for u in engine.units)
    return engine.state_bytes(), padding


# bf16: 2-byte parameters, fp32 gradients (4 bytes), fp32 master and moments (12 bytes); see engine.py.
FORMULA = {0: lambda P, N: 18 * P, 1: lambda P, N: 6 * P + 12 * P / N,
           2: lambda P, N: 2 * P + 16 * P / N, 3: lambda P, N: 18 * P / N}


def _assert_formula(states, padding, stage, P, N):
    measured = sum(states.values())
    # Padding elements carry every per-element state (2 + 4 + 12 bytes) at most once per rank.
    assert abs(measured - FORMULA[stage](P, N)) <= 0.01 * FORMULA[stage](P, N) + 18 * padding, (stage, N, states)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_model_states_follow_the_zero_formulas(stage, world_size):
    P = count_parameters(build_model(MEM_MODEL))
    for states, padding in run_ranks(_states_after_a_step, world_size, stage):
        _assert_formula(states, padding, stage, P, world_size)
        if stage == 3:
            assert states["params"] <= 2 * P / world_size + 2 * padding  # nothing left gathered


def _states_at_scale(rank, world_size, stage):
    engine = _engine(rank, world_size, stage)
    engine.optimizer.step()  # no gradients: Adam allocates nothing, so count the moments it would
    if stage <= 2:  # the fp32 gradients come with the first backward (lazy_grads.py)
        assert engine.state_bytes()["grads"] == 0
    engine._lazy.ensure_all()  # as the first gradient of each unit makes them
    shard = sum(u.shard_numel for u in engine.units)
    states = engine.state_bytes()
    states["optimizer"] += 8 * shard  # exp_avg + exp_avg_sq in fp32, shaped like the master shard
    return states, sum(u.padded_numel - u.numel for u in engine.units), [u.shard_numel for u in engine.units]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shards_and_accounting_at_64_ranks_with_the_fake_group(stage):
    P = count_parameters(build_model(MEM_MODEL))
    states, padding, shard_sizes = run_fake_rank(_states_at_scale, 64, stage, rank=37)
    _assert_formula(states, padding, stage, P, 64)
    assert all(n > 0 for n in shard_sizes)



def _live_storage_bytes() -> int:
    """Bytes of every live CPU storage, each once: those of tensors and bare storages too (the
    gatherer's spare bytes are storages that no tensor views)."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.device.type == "cpu":
            obj = obj.untyped_storage()  # a forked rank inherits the session's FakeTensors: they own nothing
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu":
            seen[obj._cdata] = obj.nbytes()
    return sum(seen.values())


def _live_across_steps(rank, world_size):
    """Live bytes over what the rank held before it built the engine: after a non-final micro-batch,
    after each step's ``finish_grad_sync`` (the end of its backward) and after each step."""
    before = _live_storage_bytes()
    engine = _engine(rank, world_size, 3)
    live = {}
    for step in range(2):
        for micro in range(2):
            tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(4 * step + 2 * micro + rank))
            with engine.no_sync() if micro == 0 else contextlib.nullcontext():
                engine.backward(token_loss_sum(engine.model(tokens), tokens) / 128)
            del tokens
            if micro == 0:
                live[f"step {step}: between micro-batches"] = _live_storage_bytes() - before
        engine.finish_grad_sync()
        live[f"step {step}: backward done"] = _live_storage_bytes() - before
        engine.step(1e-3, 1.0)
        engine.zero_grad()
        live[f"step {step}: updated"] = _live_storage_bytes() - before
    return live


def _units_from_shapes(world_size: int) -> list[tuple[int, int]]:
    """(padded elements, elements with weight decay) of each ZeRO unit of MEM_MODEL: a unit per block,
    a root unit for the rest; padded to a multiple of the ranks (AdamW: no block alignment)."""
    units: dict[str, list[int]] = {}
    for name, p in build_model(MEM_MODEL).named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else "root"
        units.setdefault(key, [0, 0])[0] += p.numel()
        units[key][1] += p.numel() if p.ndim >= 2 else 0
    return [(-(-n // world_size) * world_size, decayed) for n, decayed in units.values()]


def _pieces(units: list[tuple[int, int]], world_size: int, rank: int) -> int:
    """The optimizer's tensors on ``rank``: each unit's shard, cut where the decayed parameters
    (laid out first) end."""
    count = 0
    for padded, decayed in units:
        lo, hi = rank * padded // world_size, (rank + 1) * padded // world_size
        count += (lo < decayed) + (hi > max(lo, decayed))
    return count


def test_zero3_holds_no_gathered_unit_once_the_backward_is_done():
    """The root and the first block, reduced last, waited in the gatherer for a next backward and the
    spare bytes for the next gathers until the step: the planner's root + two blocks held past the
    backward. Exact bytes from the shapes: bf16 shards (2), fp32 gradient shards (4), fp32 masters
    (4), AdamW's moments (8) and step count per piece (4) once it has stepped, the rotary tables."""
    world_size = 2
    units = _units_from_shapes(world_size)
    shard = sum(padded // world_size for padded, _ in units)
    model = build_model(MEM_MODEL)
    model.init_buffers("cpu")
    tables = sum(b.untyped_storage().nbytes() for b in model.buffers())
    adamw = get_optimizer("adamw")
    largest = max(padded for padded, _ in units[1:])
    # between micro-batches: the reduce-scatter outputs (bf16) and the root and the first block, kept
    # for the next forward, which starts with them; the spares: the largest block's bytes
    gathered = 2 * (units[0][0] + largest) + (2 * largest if CAN_MOVE_BYTES else 0)
    for rank, live in enumerate(run_ranks(_live_across_steps, world_size)):
        moments = adamw.state_bytes(shard, _pieces(units, world_size, rank))
        first = (2 + 4 + 4) * shard + tables  # no optimizer state before the first update
        assert live == {"step 0: between micro-batches": first + 2 * shard + gathered,
                        "step 0: backward done": first,
                        "step 0: updated": first + moments,
                        "step 1: between micro-batches": first + moments + 2 * shard + gathered,
                        "step 1: backward done": first + moments,
                        "step 1: updated": first + moments}, (rank, live)


# -- traffic ---------------------------------------------------------------------------------------
def _grad_and_param_traffic(rank, world_size, stage, reshard):
    engine = _engine(rank, world_size, stage, mode="fp32", reshard_after_forward=reshard)
    stats = engine.comm.stats
    before = stats.snapshot()
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(token_loss_sum(engine.model(tokens), tokens) / 64)
    engine.finish_grad_sync()
    engine.step(1e-3, 1.0)
    step = stats.since(before)
    moved = step.sent_bytes("dp", "reduce_scatter") + step.sent_bytes("dp", "all_gather")
    return moved, step.sent_bytes("dp", "all_reduce:grads"), sum(u.padded_numel for u in engine.units)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage,reshard,factor", [(1, True, 2), (2, True, 2), (3, True, 3), (3, False, 2)])
def test_traffic_per_step_is_the_zero_volume(stage, reshard, factor, world_size):
    for moved, all_reduced, padded in run_ranks(_grad_and_param_traffic, world_size, stage, reshard):
        assert all_reduced == 0
        assert moved == pytest.approx(factor * (world_size - 1) / world_size * padded * 4, rel=1e-12)


# -- fp16 and failures -------------------------------------------------------------------------
def _overflow_on_one_rank(rank, world_size):
    engine = _engine(rank, world_size, 2, mode="fp16", scaler=DynamicLossScaler(init_scale=1024.0))
    before, _ = engine.full_state()
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(rank))
    if rank == 1:  # one overflowing element on one rank: after reduce-scatter only one shard holds it
        engine.model.layers[1].feed_forward.w2.weight.register_hook(lambda g: g.index_put((torch.tensor([0]),) * 2,
                                                                                          torch.tensor(float("inf"), dtype=g.dtype)))
    engine.backward(token_loss_sum(engine.model(tokens), tokens) / 64)
    engine.finish_grad_sync()
    _, skipped = engine.step(1e-3, 0.0)
    after, _ = engine.full_state()
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    local_inf = any(not torch.isfinite(u.grad_shard).all() for u in engine.units)
    return skipped, engine.scaler.scale, unchanged, local_inf


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale():
    results = run_ranks(_overflow_on_one_rank, 2)
    assert sorted(r[3] for r in results) == [False, True], "the overflow should reach one rank's shard only"
    for skipped, scale, unchanged, _ in results:
        assert skipped and unchanged and scale == 512.0


def _diverging_model(rank, world_size):
    global MEM_MODEL
    if rank == 1:
        import dataclasses

        MEM_MODEL = dataclasses.replace(MEM_MODEL, n_layers=3)
    _engine(rank, world_size, 3)


def test_ranks_that_built_different_models_fail_naming_the_rank():
    with pytest.raises(RankFailure, match=r"ranks \[1\] of the dp group built a different model"):
        run_ranks(_diverging_model, 2, timeout=30)


# -- checkpoints move between layouts --------------------------------------------------------------
def _save_after(rank, world_size, cfg, run_dir, steps):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    for _ in range(steps):
        trainer.train_step()
    trainer.save()


def test_a_zero3_checkpoint_resumes_in_a_replicated_layout(corpus_cache, tmp_path):
    ref_losses = _reference(corpus_cache, "--train.steps=10", steps=10)[0]
    saved = tiny_config(corpus_cache, "--parallel.dp=2", "--train.micro_batch=4", "--parallel.zero=3",
                        "--train.steps=10")
    run_ranks(_save_after, 2, saved, str(tmp_path / "run"), 4)
    resumed = tiny_config(corpus_cache, "--train.micro_batch=8", "--train.steps=10", "--checkpoint.resume=auto")
    trainer = trainer_on_rank(0, 1, resumed, str(tmp_path / "run"))
    tail = [r.loss for r in trainer.fit()]
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(ref_losses[4:]), rtol=1e-5, atol=0)
