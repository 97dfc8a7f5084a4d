"""Stage partitioning and the pipeline executor on real Gloo ranks, against one process.

Parity (fp32): per-step loss within 1e-5 relative of one process over two SGD steps, and every
parameter's gradient within 1e-5 relative, for each schedule at pp = 2 and 4 with m in {1, 4, 8},
interleaved with v = 2, pp 2 x dp 2 (our DataParallel, one reduce per bucket), pp 2 x tp 2 and
pp 2 x dp 2 x tp 2 (tensor-parallel plan inside the stages), and pp 2 x dp 2 under ZeRO 1 and 3
(weights after two AdamW steps); zb-h1 also with activation checkpointing (full and every 2nd
block) at pp 2 and 4, with dp, tp and ZeRO-3 (the split itself: tests/test_split_backward.py). Memory: the saved-activation bytes measured on each rank peak at
the simulator's in-flight micro-batches times one micro-batch's bytes; under zb-h1 with the output
gradients W keeps from I on (counted per token from the model's shapes).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn

from bigtrain.config import ModelConfig, OptimConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.checkpointing import apply_activation_checkpointing
from bigtrain.models.llama import build_model, init_value
from bigtrain.parallel.data import DataParallel
from bigtrain.parallel.pipeline import (
    PipelineExecutor,
    ScheduleError,
    StageGroup,
    align_timelines,
    balanced_split_points,
    build_schedule,
    check_pipeline_layout,
    draw_timeline,
    peak_inflight,
    split_model,
    stages_for_rank,
)
from bigtrain.optim import build_adamw
from bigtrain.parallel.tensor.plan import parallelize_llama
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import Precision
from bigtrain.testing import run_ranks
from bigtrain.parallel.build import token_loss_sum
from bigtrain.parallel.pipeline.executor import _encode_spec, _recv_spec
from helpers import assert_rel_close

SEQ, BATCH, STEPS, SEED = 16, 8, 2, 3
# Plain SGD between the steps: Adam's first step is sign(grad) * lr, which turns fp32 rounding in
# near-zero gradients into lr-sized differences and would blur the step-2 comparison.
LR = 0.5


@pytest.fixture(scope="module", autouse=True)
def meta_device_loaded():
    """The first model built on the meta device loads torch's meta kernels (1-2 s): pay it once in
    the parent, so every forked rank inherits them instead of paying again."""
    build_model(model_config(1))


def model_config(n_layers: int) -> ModelConfig:
    return ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_loss_sum(logits, targets) / (BATCH * SEQ)  # global token count: grads sum


def sgd(params) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=LR)


@functools.lru_cache(maxsize=None)
def reference(n_layers: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Per step, the loss and gradients of one process on the whole batch."""
    model = build_model(model_config(n_layers), "cpu")
    model.init_weights(SEED)
    optimizer, losses, grads = sgd(model.parameters()), [], []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _train_cases(rank, world_size, n_layers, pp, cases, checkpointing="none"):
    """Every (kind, m, v) of ``cases`` for STEPS steps on a pp x dp mesh; per case, per step: this
    rank's loss (None off the last stage) and its stages' gradients."""
    dp = world_size // pp
    mesh = Mesh({"pp": pp, "dp": dp}, rank)
    results = []
    for kind, m, v in cases:
        model = build_model(model_config(n_layers))
        apply_activation_checkpointing(model.layers, checkpointing, every=2)
        stages = stages_for_rank(model, pp, mesh.coord("pp"), v)
        for stage in stages.values():
            stage.to_empty(device="cpu")
            stage.init_weights(SEED)
        group = StageGroup(stages.values())  # one gradient engine and optimizer for all chunks
        sync = DataParallel(group, mesh.comm("dp")) if dp > 1 else None
        executor = PipelineExecutor(stages, build_schedule(kind, pp, m, v), mesh.comm("pp"), loss_fn,
                                    engines={s: sync for s in stages} if sync else None)
        optimizer, per_step = sgd(group.parameters()), []
        for step in range(STEPS):
            inputs, targets = (t.chunk(dp)[mesh.coord("dp")] for t in global_batch(step))
            loss = executor.run(list(zip(inputs.chunk(m), targets.chunk(m))))
            if sync is not None:
                sync.finish_grad_sync()
            grads = {n: p.grad.clone() for n, p in group.named_parameters()}
            per_step.append((None if loss is None else float(loss), grads))
            optimizer.step()
            sync.zero_grad() if sync is not None else optimizer.zero_grad()
        bucket_reduces = mesh.stats.calls.get(("dp", "all_reduce:grads"), 0)
        results.append((per_step, bucket_reduces, len(sync.buckets) * STEPS if sync else 0))
        mesh.stats.reset()
    return results


def check_parity(results_by_rank, n_layers, cases):
    ref_losses, ref_grads = reference(n_layers)
    for case_index, case in enumerate(cases):
        per_rank = [results[case_index] for results in results_by_rank]
        for step in range(STEPS):
            losses = [r[0][step][0] for r in per_rank if r[0][step][0] is not None]
            torch.testing.assert_close(sum(losses), ref_losses[step], rtol=1e-5, atol=0, msg=f"{case} step {step}")
            seen = set()
            for per_step, _, _ in per_rank:
                for name, grad in per_step[step][1].items():
                    assert_rel_close(grad, ref_grads[step][name], 1e-5, f"{case} step {step} {name}")
                    seen.add(name)
            assert seen == set(ref_grads[step]), f"{case}: parameters missing from every stage"
        for _, reduces, buckets in per_rank:
            assert reduces == buckets, f"{case}: {reduces} bucket all-reduces, expected one per bucket and step"


PARITY = {  # (pp, kind) -> layers, cases (kind, m, v); every schedule at pp 2 and 4, m in {1, 4, 8}
    (2, "naive"): (4, [("naive", 1, 1), ("naive", 4, 1)]),
    (2, "gpipe"): (4, [("gpipe", m, 1) for m in (1, 4, 8)]),
    (2, "1f1b"): (4, [("1f1b", m, 1) for m in (1, 4, 8)]),
    (2, "zb-h1"): (4, [("zb-h1", m, 1) for m in (1, 4, 8)]),
    (2, "interleaved"): (4, [("interleaved", m, 2) for m in (4, 8)]),
    (4, "naive+gpipe"): (8, [("naive", 1, 1), ("gpipe", 4, 1), ("gpipe", 8, 1)]),
    (4, "1f1b"): (8, [("1f1b", m, 1) for m in (1, 4, 8)]),
    (4, "zb-h1"): (8, [("zb-h1", m, 1) for m in (1, 4, 8)]),
    (4, "interleaved"): (8, [("interleaved", m, 2) for m in (4, 8)]),
}


@pytest.mark.parametrize("pp,kind", list(PARITY), ids=[f"pp{p}-{k}" for p, k in PARITY])
def test_loss_and_grads_match_one_process(pp, kind):
    n_layers, cases = PARITY[(pp, kind)]
    check_parity(run_ranks(_train_cases, pp, n_layers, pp, cases), n_layers, cases)


def test_pp2_dp2_matches_one_process_with_one_grad_reduce_per_bucket():
    # Interleaved puts two chunks under one DataParallel (StageGroup): each bucket must still be
    # reduced once, after the last backward of every parameter in it.
    cases = [("1f1b", 4, 1), ("zb-h1", 2, 1), ("interleaved", 2, 2)]
    check_parity(run_ranks(_train_cases, 4, 4, 2, cases), 4, cases)


@pytest.mark.parametrize("world_size,pp,checkpointing", [(2, 2, "full"), (4, 4, "every"), (4, 2, "every")],
                         ids=["pp2-full", "pp4-every", "pp2-dp2-every"])
def test_zero_bubble_with_checkpointing_matches_one_process(world_size, pp, checkpointing):
    # Checkpointed blocks take their weight gradients in I, the others in W: with dp, each bucket
    # must still be reduced once, after the last of the two.
    n_layers, cases = 2 * pp, [("zb-h1", m, 1) for m in (1, 4)]
    check_parity(run_ranks(_train_cases, world_size, n_layers, pp, cases, checkpointing), n_layers, cases)


def _tensor_parallel_stages(rank, world_size, cases):
    """pp 2 x (dp) x tp 2: the tensor-parallel plan applied to the plain model, then split into stages;
    each stage's gradients summed over dp by our DataParallel. Returns, per case, this rank's
    (dp coordinate, loss or None, full gradients on tp rank 0)."""
    mesh = Mesh({"pp": 2, "dp": world_size // 4, "tp": 2}, rank)
    tp, dp, results = mesh.comm("tp"), mesh.comm("dp"), []
    for kind, m, checkpointing in cases:
        cfg = model_config(4)
        model = build_model(cfg)
        layout = parallelize_llama(model, tp, mesh.comm("sp"), sequence_parallel=False)
        apply_activation_checkpointing(model.layers, checkpointing, every=2)
        stages = stages_for_rank(model, 2, mesh.coord("pp"))
        placements = layout.placements(model)
        init = placements.local_init(lambda name, shape: init_value(name, shape, SEED, cfg))
        for stage in stages.values():
            stage.to_empty(device="cpu")
            stage.init_buffers()
            with torch.no_grad():
                for name, param in stage.named_parameters():
                    param.copy_(init(name, tuple(param.shape)))
        sync = DataParallel(StageGroup(stages.values()), dp)
        executor = PipelineExecutor(stages, build_schedule(kind, 2, m), mesh.comm("pp"),
                                    lambda logits, targets: layout.loss_sum(logits, targets) / (BATCH * SEQ),
                                    engines={s: sync for s in stages})
        inputs, targets = (t.chunk(dp.size)[dp.rank] for t in global_batch(0))
        loss = executor.run(list(zip(inputs.chunk(m), targets.chunk(m))))
        sync.finish_grad_sync()
        grads = placements.gather_full({n: p.grad for s in stages.values() for n, p in s.named_parameters()})
        results.append((dp.rank, None if loss is None else float(loss), grads if tp.rank == 0 else {}))
    return results


@pytest.mark.parametrize("world_size", [4, 8], ids=["pp2-tp2", "pp2-dp2-tp2"])
def test_tensor_parallel_inside_stages_matches_one_process(world_size):
    cases = [("1f1b", 4, "none"), ("zb-h1", 2, "none"), ("zb-h1", 4, "every")] if world_size == 4 else \
        [("1f1b", 2, "none")]
    results = run_ranks(_tensor_parallel_stages, world_size, cases)
    ref_losses, ref_grads = reference(4)
    for i, case in enumerate(cases):
        losses = {(r[i][0], r[i][1]) for r in results if r[i][1] is not None}
        assert len(losses) == world_size // 4, "the tensor-parallel ranks of a last stage agree on the loss"
        torch.testing.assert_close(sum(loss for _, loss in losses), ref_losses[0], rtol=1e-5, atol=0)
        for rank, per_case in enumerate(results):
            for name, grad in per_case[i][2].items():
                assert_rel_close(grad, ref_grads[0][name], 1e-5, f"{case} rank {rank} {name}")
        assert set().union(*(r[i][2] for r in results)) == set(ref_grads[0])


ZERO_OPTIM = OptimConfig(lr=1e-3, grad_clip=0.0)


def _zero_stage_weights(rank, world_size, zero, kind, m, checkpointing):
    """pp 2 x dp 2 under ZeRO: the engine owns the stage (its root unit: embedding or norm + head,
    gathered around the stage's forward) with one unit per block; weights after STEPS AdamW steps."""
    mesh, cfg = Mesh({"pp": 2, "dp": 2}, rank), model_config(4)
    model = build_model(cfg)
    apply_activation_checkpointing(model.layers, checkpointing)
    (stage,) = stages_for_rank(model, 2, mesh.coord("pp")).values()
    engine = ZeroEngine(stage, mesh.comm("dp"), zero, Precision(torch.float32, torch.float32), ZERO_OPTIM,
                        init_fn=lambda name, shape: init_value(name, shape, SEED, cfg),
                        unit_modules=list(stage.layers.values()))
    stage.init_buffers("cpu")
    executor = PipelineExecutor({stage.index: stage}, build_schedule(kind, 2, m), mesh.comm("pp"), loss_fn,
                                engines={stage.index: engine})
    for step in range(STEPS):
        inputs, targets = (t.chunk(2)[mesh.coord("dp")] for t in global_batch(step))
        executor.run(list(zip(inputs.chunk(m), targets.chunk(m))))
        engine.finish_grad_sync()
        engine.step(ZERO_OPTIM.lr, ZERO_OPTIM.grad_clip)
        engine.zero_grad()
    return engine.full_state()[0]


@pytest.mark.parametrize("zero,kind,m,checkpointing", [(1, "1f1b", 4, "none"), (3, "1f1b", 4, "none"),
                                                       (3, "zb-h1", 2, "none"), (3, "zb-h1", 4, "full")])
def test_pp2_dp2_under_zero_matches_one_process(zero, kind, m, checkpointing):
    # ZeRO-3 with checkpointing: the recomputed forward needs the gathered weights (why
    # checkpointed blocks are not split, see split_backward).
    model = build_model(model_config(4), "cpu")
    model.init_weights(SEED)
    optimizer = build_adamw(model, ZERO_OPTIM, ZERO_OPTIM.lr)
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    per_rank = run_ranks(_zero_stage_weights, 4, zero, kind, m, checkpointing)
    weights = {name: w for rank_weights in per_rank for name, w in rank_weights.items()}
    assert set(weights) == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert_rel_close(weights[name], param.detach(), 1e-5, name)


# ------------------------------------------------------------------ measured memory, traffic, timeline

def _measured_step(rank, world_size, kind, m):
    mesh = Mesh({"pp": world_size}, rank)
    stages = stages_for_rank(build_model(model_config(4)), world_size, rank)
    for stage in stages.values():
        stage.to_empty(device="cpu")
        stage.init_weights(SEED)
    executor = PipelineExecutor(stages, build_schedule(kind, world_size, m), mesh.comm("pp"), loss_fn,
                                measure_activations=True)
    inputs, targets = global_batch(0)
    micro_batches = list(zip(inputs.chunk(m), targets.chunk(m)))
    executor.run(micro_batches)
    first_payload = dict(mesh.stats.payload)
    executor.run(micro_batches)
    per_microbatch = set(executor.activation_bytes.values())
    return (executor.peak_activation_bytes, per_microbatch, first_payload, dict(mesh.stats.payload),
            executor.timeline, [str(a) for a in executor.schedule.compute_actions(rank)], executor.wait_seconds)


@pytest.mark.parametrize("kind,p,m", [("gpipe", 2, 4), ("1f1b", 2, 4), ("1f1b", 4, 8)])
def test_measured_peak_activations_match_simulated_inflight(kind, p, m):
    expected = peak_inflight(build_schedule(kind, p, m))
    for rank, (peak, per_microbatch, *_) in enumerate(run_ranks(_measured_step, p, kind, m)):
        assert len(per_microbatch) == 1, "micro-batches of one stage should save equal bytes"
        (one,) = per_microbatch
        assert one > 0 and peak == expected[rank] * one, f"rank {rank}: {peak / one} micro-batches in flight"
    assert expected[0] == (m if kind == "gpipe" else p)  # GPipe holds every micro-batch, 1F1B at most p


def test_zero_bubble_peak_counts_the_gradients_kept_for_w():
    """Between a micro-batch's I and its W the retained graph keeps every saved tensor and W keeps
    each junction's output gradient: per token of a block, the dY of wq, wk, wv, wo, w1, w3, w2 and of
    the two norms' weight products, and on the last stage the final norm's and the head's (d logits);
    on the first stage (no input path, W is the whole backward) the stage's output gradient. The
    measured peak counted the saved tensors alone, 37% under what rank 1 holds at p = 2, m = 4."""
    p, m = 2, 4
    cfg = model_config(4)
    dim, kv, hidden = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim
    tokens, fp32 = BATCH // m * SEQ, 4
    block = 5 * dim + 2 * kv + 2 * hidden
    kept = [tokens * dim * fp32, tokens * (2 * block + dim + 256) * fp32]  # stage 0: dY of its output
    schedule = build_schedule("zb-h1", p, m)
    for rank, (peak, per_microbatch, *_) in enumerate(run_ranks(_measured_step, p, "zb-h1", m)):
        (one,) = per_microbatch
        held = most = 0
        for action in schedule.compute_actions(rank):
            held += {"F": one, "I": kept[rank], "W": -one - kept[rank]}[action.kind.value]
            most = max(most, held)
        assert peak == most, f"rank {rank}: measured {peak}, saved tensors and W's gradients {most}"
    assert most > peak_inflight(schedule)[1] * one  # more than the saved tensors of the micro-batches in flight


def test_p2p_bytes_are_counted_per_send_and_timeline_follows_the_schedule(tmp_path):
    p, m = 2, 4
    results = run_ranks(_measured_step, p, "1f1b", m)
    boundary = (BATCH // m) * SEQ * 64 * 4  # one micro-batch of fp32 hidden states
    meta = 8 * 8  # the one-off shape message (8 int64)
    first = [r[2] for r in results]
    assert first[0] == {("pp", "send:meta"): meta, ("pp", "send:activations"): m * boundary}
    assert first[1] == {("pp", "send:input_grads"): m * boundary}  # receives are not counted as sent
    assert results[0][3][("pp", "send:meta")] == meta, "shapes are exchanged once, not every step"
    for rank, (*_, timeline, compute, waited) in enumerate(results):
        assert [label for label, _, _ in timeline] == compute
        assert all(start <= end for _, start, end in timeline)
        assert all(a[2] <= b[1] for a, b in zip(timeline, timeline[1:])), "actions overlap on one rank"
        assert waited >= 0.0
    path = draw_timeline(align_timelines([r[4] for r in results]), tmp_path / "measured.png", "measured 1f1b")
    assert path.stat().st_size > 0


def _shape_message_beside_a_posted_receive(rank, world_size):
    """Rank 1 has a tensor's receive from rank 0 posted (an asynchronous pipeline's, carried over a
    step boundary) when it waits for a shape announcement from rank 0, which rank 0 sends before
    the tensor: the order the two ranks post them in differs."""
    comm = Mesh({"pp": 2}, rank).comm("pp")
    tensor = torch.arange(100, dtype=torch.float32).reshape(5, 20)  # 400 bytes; a shape message is 64
    if rank == 0:
        comm.send(_encode_spec(tensor, torch.device("cpu")), 1, tag="meta")
        for work in comm.batch_isend_irecv([comm.send_op(tensor, 1, tag="activations")]):
            work.wait()
        return None
    received = torch.full_like(tensor, -1.0)
    (work,) = comm.batch_isend_irecv([comm.recv_op(received, 0)])
    spec = _recv_spec(comm, 0, torch.device("cpu"))
    work.wait()
    return spec, received


def test_a_shape_message_never_meets_a_tensors_receive():
    # On one Gloo channel the posted receive would take the 64-byte shape message into its first 64
    # bytes, silently, and the shape's receive the 400-byte tensor (Gloo aborts the process): shapes
    # travel on a channel of their own (comm.WIRE_TAGS).
    spec, received = run_ranks(_shape_message_beside_a_posted_receive, 2)[1]
    assert spec == ((5, 20), torch.float32)
    assert torch.equal(received, torch.arange(100, dtype=torch.float32).reshape(5, 20))


# ------------------------------------------------------------------ a user's nn.Sequential

def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _sequential_grads(rank, world_size, kind, m):
    stages = stages_for_rank(mlp(), world_size, rank, split_points=[2])
    executor = PipelineExecutor(stages, build_schedule(kind, world_size, m), Mesh({"pp": world_size}, rank).comm("pp"),
                                lambda out, target: nn.functional.mse_loss(out, target, reduction="sum"))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    loss = executor.run(list(zip(x.chunk(m), torch.ones(8, 4).chunk(m))))
    return loss, {n: p.grad for s in stages.values() for n, p in s.named_parameters()}


def test_sequential_model_matches_one_process():
    model = mlp()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    loss = nn.functional.mse_loss(model(x), torch.ones(8, 4), reduction="sum")
    loss.backward()
    results = run_ranks(_sequential_grads, 2, "zb-h1", 4)
    assert results[0][0] is None
    torch.testing.assert_close(results[1][0], loss.detach(), rtol=1e-5, atol=0)
    assert sorted(results[0][1]) == ["0.bias", "0.weight"]  # children keep their Sequential names
    for name, param in model.named_parameters():
        assert_rel_close({**results[0][1], **results[1][1]}[name], param.grad, 1e-5, name)


# ------------------------------------------------------------------ partitioning and layout checks (one process)

def test_stages_keep_parameter_names_and_chain_to_the_model_output():
    model = build_model(model_config(4), "cpu")
    model.init_weights(SEED)
    stages = split_model(model, 3)
    assert [list(s.layers) for s in stages] == [["0", "1"], ["2"], ["3"]]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    assert "layers.3.attention.wq.weight" in names
    h = global_batch(0)[0]
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(global_batch(0)[0]), rtol=0, atol=0)
    h = chunk = global_batch(0)[0][:, :8]  # a later sequence chunk, as under sequence parallelism
    for stage in stages:
        h = stage(h, start_pos=4)
    torch.testing.assert_close(h, model(chunk, start_pos=4), rtol=0, atol=0)
    merged = StageGroup([stages[0], stages[2]])
    assert list(stages[0].layers) == ["0", "1"], "merging must leave the stages as they were"
    assert [n for n, _ in merged.named_parameters()] == [n for n, _ in stages[0].named_parameters()] + [
        n for n, _ in stages[2].named_parameters()]


def test_balance_by_parameters_moves_layers_off_the_heavy_ends():
    cfg = model_config(8)
    cfg.vocab_size = 4096  # embedding and head each ~5 blocks' worth of parameters
    model = build_model(cfg)
    by_count = [len(s.layers) for s in split_model(model, 4)]
    by_params = [len(s.layers) for s in split_model(model, 4, balance="params")]
    assert by_count == [2, 2, 2, 2]
    assert by_params[0] < 2 and by_params[-1] < 2 and sum(by_params) == 8
    assert [len(s.layers) for s in split_model(model, 2, split_points=[3])] == [3, 5]


def test_balanced_split_points_are_optimal():
    gen = torch.Generator().manual_seed(0)
    for n, stages in [(6, 3), (7, 2), (8, 4)]:
        costs = torch.randint(1, 20, (n,), generator=gen).tolist()
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n)))
                   for cut in itertools.combinations(range(1, n), stages - 1))
        cut = balanced_split_points(costs, stages)
        assert max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n))) == best


@pytest.mark.parametrize("args,field", [
    ((4, 8, 1, 8, "1f1b"), "parallel.pp = 8 gives 8 stages but model.n_layers = 4"),
    ((4, 2, 2, 8, "1f1b"), "parallel.pp_virtual = 2"),
    ((8, 2, 2, 1, "interleaved"), "parallel.pp_microbatches = 1"),
    ((8, 4, 2, 6, "interleaved"), "parallel.pp_microbatches = 6"),
    ((8, 4, 1, 4, "interleaved"), "parallel.pp_virtual = 1"),
    ((4, 2, 1, 4, "zigzag"), "parallel.pp_schedule = 'zigzag'"),
    ((4, 2, 1, 4, "gpipe", [4]), "parallel.pp_split = [4]: split point(s) [4] do not exist"),
    ((4, 2, 1, 4, "gpipe", [1, 2]), "parallel.pp_split = [1, 2]: 2 stages need 1 split point"),
    ((4, 3, 1, 4, "gpipe", [2, 2]), "strictly increasing"),
    ((4, 1, 1, 4, "gpipe", [2]), "one stage (parallel.pp x parallel.pp_virtual = 1) has no split points; clear it"),
])
def test_bad_layouts_name_the_field(args, field):
    problems = check_pipeline_layout(*args)
    assert len(problems) == 1 and field in problems[0], problems


def test_good_layouts_pass_and_splitting_rejects_bad_input():
    assert check_pipeline_layout(4, 2, 1, 1, "1f1b") == []
    assert check_pipeline_layout(8, 4, 2, 2, "interleaved", m_field="train.micro_batch")[0].startswith(
        "train.micro_batch = 2: the 'interleaved' schedule needs a multiple of parallel.pp = 4")
    assert check_pipeline_layout(8, 4, 2, 8, "interleaved", [1, 2, 3, 4, 5, 6, 7]) == []
    model = build_model(model_config(4))
    with pytest.raises(ValueError, match="parallel.pp"):
        split_model(model, 5)
    with pytest.raises(ValueError, match=r"parallel.pp_split = \[0\]"):
        split_model(model, 2, split_points=[0])
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_model(nn.Linear(2, 2), 2)


def test_executor_validates_the_schedule_before_any_transfer():
    schedule = build_schedule("gpipe", p=2, m=2)
    schedule.actions[0][1], schedule.actions[0][3] = schedule.actions[0][3], schedule.actions[0][1]
    stages = stages_for_rank(build_model(model_config(2)), 2, 0)
    with pytest.raises(ScheduleError, match=r"rank 0, action #1 \(SEND_FWD s0 mb1 ->r1\)"):
        PipelineExecutor(stages, schedule, Mesh({}).comm("pp"), loss_fn)
    with pytest.raises(ValueError, match="p=2 pipeline ranks but the pp axis has 1"):
        PipelineExecutor(stages, build_schedule("gpipe", p=2, m=2), Mesh({}).comm("pp"), loss_fn)
