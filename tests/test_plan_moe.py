"""The planner with experts: per-rank parameter bytes under expert parallelism equal the storages
the runtime allocates (measured on forked Gloo ranks); active FLOPs count top_k of E experts; the
all-to-all is timed only when ep > 1; Mixtral 8x7B's size and a plan for it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bigtrain.config import load_config
from bigtrain.plan.cost import expert_all_to_all
from bigtrain.plan.fit import _layout
from bigtrain.plan.hardware import get_profile
from bigtrain.plan.layout import Cluster, Layout, layout_problems
from bigtrain.plan.memory import estimate_memory, rank_units, unit_state_bytes
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.search import evaluate, search
from bigtrain.testing import run_ranks
from helpers import GemmFlops, tiny_config, trainer_on_rank

MOE = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_ffn_hidden=96", "--model.n_layers=3",
       "--train.global_batch=8", "--train.micro_batch=1"]
LAYOUTS = {  # (world, overrides): ep cuts the experts, edp = dp / ep cuts their ZeRO units
    "dp4-ep2-zero1-bf16": (4, ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=1", "--precision.mode=bf16"]),
    "dp2-ep2-replicated-fp32": (2, ["--parallel.dp=2", "--parallel.ep=2"]),
    "dp4-ep4-zero2-every2": (4, ["--parallel.dp=4", "--parallel.ep=4", "--parallel.zero=2", "--model.moe_every=2",
                                 "--model.moe_shared_expert=true"]),
    "dp2-tp2-ep2-zero1": (4, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1"]),
}


def _parameter_storage_bytes(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in trainer.model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_parameter_bytes_equal_the_live_storages(name, corpus_cache, tmp_path):
    world, overrides = LAYOUTS[name]
    cfg = tiny_config(corpus_cache, *MOE, *overrides)
    p = cfg.parallel
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    layout = Layout(dp=p.dp, tp=p.tp, zero=p.zero, precision=cfg.precision.mode, ep=p.ep)
    root, blocks = rank_units(model, layout, 0)
    planned = unit_state_bytes([root] + blocks, layout)["params"]
    measured = run_ranks(_parameter_storage_bytes, world, cfg, str(tmp_path), timeout=240)
    assert all(m == planned for m in measured), (planned, measured)
    dense = Layout(dp=p.dp, tp=p.tp, zero=p.zero, precision=cfg.precision.mode)  # the experts whole: more
    assert unit_state_bytes([root] + rank_units(model, dense, 0)[1], dense)["params"] > planned


def test_active_flops_count_top_k_of_the_experts():
    cfg = load_config(preset="mixtral-8x7b")
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    assert model.params == pytest.approx(46.70e9, rel=1e-3)  # Mixtral 8x7B
    expert = 3 * model.hidden * model.expert_ffn
    assert model.params - model.matmul_params == pytest.approx(
        model.layers * 6 * expert + model.vocab * model.hidden, rel=1e-3)  # 6 idle experts a block, embedding
    top1 = ModelSpec(**{**model.__dict__, "top_k": 1})
    assert model.model_flops_per_token() - top1.model_flops_per_token() == 6 * model.layers * expert


def test_all_to_all_time_only_with_expert_parallelism():
    cfg = load_config(preset="mixtral-8x7b")
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    cluster = Cluster.build(64, get_profile("h100-80g"))
    assert expert_all_to_all(model, Layout(dp=8, pp=8), cluster) == (0.0, 0.0)
    inside, _ = expert_all_to_all(model, Layout(dp=8, pp=8, ep=8), cluster)
    across, _ = expert_all_to_all(model, Layout(dp=8, tp=2, pp=4, ep=8), cluster)  # tp x ep = 16 > a node
    assert 0 < inside < across
    # Ulysses with experts runs (issue 29: each sp rank routes its own tokens, whole-sequence statistics)
    assert layout_problems(Layout(dp=4, sp=2, pp=8, ep=3), model, cluster, 1024) == [
        "ep = 3 must divide dp x cp x sp = 8", "ep = 3 must divide the 8 experts"]


@pytest.mark.parametrize("sp,cp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_all_to_all_moves_the_ranks_sequence_shard(sp, cp):
    """Under Ulysses or cp each rank routes its own tokens: measured on 2 Gloo ranks (tiny, 4 experts
    top-2, 32 tokens, ep = 2), a micro-batch's dispatch sent 16,384 bytes at dp = 2 and 8,192 at
    sp = 2 or cp = 2. The planner charged the whole sequence at every sp and cp."""
    from bigtrain.plan.links import Link

    model = ModelSpec.build(layers=2, hidden=64, heads=4, vocab=256, seq=32, experts=4, top_k=2)
    hw = get_profile("h100-80g")
    layout = Layout(dp=2, sp=sp, cp=cp, ep=2, micro_batch=2, precision="fp32")
    forward, _ = expert_all_to_all(model, layout, Cluster.build(layout.gpus, hw))
    rows = 2 * (32 // (sp * cp)) * 2 * 64 * 4  # micro-batch x the rank's tokens x top_k x hidden x fp32
    one = Link(hw.intra_node_bandwidth, hw.intra_node_latency_s).collective("all_to_all", rows, 2)
    assert forward == pytest.approx(model.moe_layers * 2 * one)  # dispatch and combine in every MoE layer


def test_mixtral_plan_uses_what_the_runtime_accepts():
    cfg = load_config(preset="mixtral-8x7b")
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    result = search(model, Cluster.build(64, get_profile("h100-80g")), cfg.train.global_batch, fixed={"pp": 8, "micro_batch": 1, "schedule": "1f1b", "zero": 1})
    best = result.best
    assert best is not None and best.fits
    assert any(p.layout.tp_sp for p in result.ranked)  # Megatron SP with experts (the test below)
    assert any(p.layout.sp > 1 for p in result.ranked)  # Ulysses with experts runs (issue 29)
    assert any(p.layout.ep > 1 for p in result.ranked)
    assert torch.tensor(best.memory.total).item() <= best.memory.capacity


def test_the_shape_aware_time_of_an_moe_block_counts_its_top_k_experts():
    """On a GPU profile each expert is a GEMM of its share of the routed tokens: an MoE block
    costs what top_k feed-forwards cost, and no layout beats the profile's GEMM share in MFU."""
    from bigtrain.plan.gemm import block_times
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.layout import Cluster
    from bigtrain.plan.search import search

    h100 = get_profile("h100-80g")
    moe = ModelSpec.build(layers=4, hidden=4096, heads=32, vocab=32000, seq=4096, experts=8, top_k=2)
    layout = Layout(dp=8, ep=8, micro_batch=1)
    tokens = moe.seq
    active = moe._active_block_params(0)
    seconds = block_times(moe, layout, h100, moe=True).forward
    assert 2 * active * tokens / (seconds * h100.peak_flops("bf16")) < h100.gemm_fraction
    top1 = block_times(dataclasses.replace(moe, top_k=1), layout, h100, moe=True).forward
    ffn = 2 * 3 * moe.hidden * moe.expert_ffn * tokens / (h100.peak_flops("bf16") * h100.gemm_fraction)
    # one more expert per token: its GEMMs at the large-GEMM share, plus tile losses and its SwiGLU
    assert ffn < seconds - top1 < 1.2 * ffn
    # every tp rank runs its experts on the same whole hidden states: tp does not divide that work
    at_tp2 = [block_times(m, Layout(dp=8, tp=2, ep=8, micro_batch=1), h100, moe=True).forward
              for m in (moe, dataclasses.replace(moe, top_k=1))]
    assert at_tp2[0] - at_tp2[1] == pytest.approx(seconds - top1, rel=1e-6)
    best = search(moe, Cluster.build(8, h100), 64, {"micro_batch": 1}).best  # any layout: none beats the GEMM share
    assert best.time.mfu < h100.gemm_fraction


def test_the_recomputed_all_to_all_is_that_of_the_checkpointed_moe_blocks():
    """A recomputed MoE block runs its dispatch and combine again; a block that is not checkpointed
    does not. With every = 2 and moe_every = 2 the checkpointed blocks are the dense ones: the
    experts' all-to-all is what no recomputation sends (a run counted 29,184 bytes a step either
    way, the planner charged a third more: each MoE block at the model's share of recomputed blocks)."""
    from bigtrain.plan.cost import stage_costs

    model = ModelSpec.build(layers=4, hidden=1024, heads=16, vocab=32000, seq=1024, experts=8, top_k=2, moe_every=2)
    cluster = Cluster.build(8, get_profile("h100-80g"))
    moe = {r: stage_costs(model, Layout(dp=8, ep=8, recompute=r, every=2), cluster).moe_comm
           for r in ("none", "every", "full")}
    assert moe["every"] == pytest.approx(moe["none"])
    assert moe["full"] == pytest.approx(moe["none"] * 6 / 4)  # forward 2, backward 2 + the recomputed 2


# -- a skewed router (plan/expert_load.py) ------------------------------------------------------------
def test_the_rows_a_rank_s_experts_take_even_worst_and_capacity_bound():
    """Dropless: an even split is priced (top_k a token), the worst case is every token of the ep
    group on one rank's experts, each expert once (ep x min(top_k, E/ep)); a capacity factor bounds
    it by E x C a sequence (C = ceil(factor x seq x top_k / E)), and that bound is priced."""
    from bigtrain.plan.expert_load import expert_load

    model = ModelSpec.build(layers=2, hidden=64, heads=4, vocab=256, seq=32, experts=8, top_k=2)
    assert (expert_load(model, 1).priced, expert_load(model, 1).worst) == (2, 2)  # one rank: its own routings
    load = expert_load(model, 4)
    assert (load.even, load.priced, load.worst, load.bounded) == (2, 2, 8, False)  # 4 ranks x 2 experts each
    assert expert_load(model, 8).worst == 8  # one expert a rank: a token reaches it once
    skewed = dataclasses.replace(model, skewed_routing=True)
    assert expert_load(skewed, 4).priced == 8
    capped = dataclasses.replace(model, capacity_factor=1.25)  # C = ceil(1.25 x 32 x 2 / 8) = 10 a sequence
    assert (expert_load(capped, 4).priced, expert_load(capped, 4).bounded) == (8 * 10 / 32, True)
    assert expert_load(capped, 4, seq_shards=2).priced == 8 * 10 * 2 / 32  # a rank holds half of each sequence
    assert expert_load(dataclasses.replace(model, capacity_factor=8.0), 4).priced == 8  # the routing's own bound
    assert expert_load(dataclasses.replace(model, capacity_factor=0.5), 1).priced == 1  # drops, without ep too


def test_the_skewed_activations_add_the_experts_rows_and_the_report_says_which_is_priced():
    """The worst case adds only what a rank's experts keep per received row (their input, SwiGLU
    products and the permutation), not the routing tokens' own tensors; the report names the
    routing it priced: dropless, the even split and the worst case beside it; a capacity, its bound."""
    from bigtrain.plan.report import plan_table

    cfg = load_config(preset="moe-tiny")
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    cluster = Cluster.build(2, get_profile("cpu"))
    layout = Layout(dp=2, ep=2, micro_batch=2, precision="fp32")
    even = estimate_memory(model, layout, cluster.hardware, 8)
    skewed = estimate_memory(dataclasses.replace(model, skewed_routing=True), layout, cluster.hardware, 8)
    tokens, per_row = 2 * model.seq, 4 * (model.hidden + 4 * model.expert_ffn) + 16  # fp32 h + 4 F, 2 int64
    assert skewed.activations - even.activations == model.moe_layers * tokens * (4 - 2) * per_row
    dropless = "\n".join(plan_table(evaluate(model, layout, cluster, 8)))
    assert "dropless, priced at an even split: 2 routed rows a token" in dropless
    assert "worst case, every routing on one rank's experts (4 rows a token)" in dropless
    capped = dataclasses.replace(model, capacity_factor=1.25)
    bounded = "\n".join(plan_table(evaluate(capped, layout, cluster, 8)))
    assert "capacity 1.25, priced at its bound: at most 2.5 routed rows a token" in bounded
    assert "worst case" not in bounded
    assert "experts" not in "\n".join(plan_table(evaluate(model, Layout(dp=2, micro_batch=2, precision="fp32"),
                                                          cluster, 8)))


def test_the_all_to_all_counts_a_rank_s_own_part_of_the_sequence():
    """Under Ulysses each rank routes its part of the sequence (measured: tests below): the
    exchange is seq / sp tokens a micro-batch, not the whole sequence's (it was, until 2026-11-28)."""
    from bigtrain.plan.expert_load import exchange_payload
    from bigtrain.plan.links import Link

    model = ModelSpec.build(layers=2, hidden=1024, heads=16, vocab=32000, seq=4096, experts=8, top_k=2)
    cluster = Cluster.build(8, get_profile("h100-80g"))
    layout = Layout(dp=4, sp=2, ep=8, micro_batch=1)
    hw = cluster.hardware
    link = Link(hw.intra_node_bandwidth, hw.intra_node_latency_s)
    rows = 2048 * 2 * 1024 * 2  # a rank's 2,048 tokens, top-2, bf16
    assert exchange_payload(model, layout, 2) == (rows, rows)
    assert expert_all_to_all(model, layout, cluster)[0] == pytest.approx(2 * 2 * link.collective("all_to_all", rows, 8))


SKEW = ["--model.moe_experts=4", "--model.moe_top_k=2", "--train.micro_batch=2", "--train.global_batch=8",
        "--model.moe_router=sigmoid-bias"]
# sigmoid-bias selects by score + bias: these biases send every routing to experts 0 and 1, rank 0's
SKEWED_BIAS = [10.0, 10.0, 0.0, 0.0]
SKEW_RUNS = {"dropless": ["--parallel.dp=2", "--parallel.ep=2"],
             "capacity-1.25": ["--parallel.dp=2", "--parallel.ep=2", "--model.moe_capacity_factor=1.25"],
             "ulysses": ["--parallel.sp=2", "--parallel.ep=2"]}


def _skewed_step(rank, world_size, configs, run_dir):
    from bigtrain.memory.accounting import SavedActivations
    from bigtrain.models.moe import moe_blocks

    out = {}
    for name, (cfg, bias) in configs.items():
        trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
        for _, block in moe_blocks(trainer.model):
            block.expert_bias.copy_(torch.tensor(bias))
        before = dict(trainer.mesh.stats.payload)
        tracker = SavedActivations(trainer.model)
        batches = trainer.sampler.micro_batches(trainer.step, trainer.mesh.coord("dp"), trainer.mesh.size("dp"),
                                                cfg.train.micro_batch)
        for i, (tokens, targets) in enumerate(batches):
            trainer._forward_backward(tokens, targets, sync=i == trainer.accum - 1, tracker=tracker)
        trainer.parallel.finish_grad_sync()
        payload = {k[1].split(":")[1]: v - before.get(k, 0) for k, v in trainer.mesh.stats.payload.items()
                   if k[0] == "ep"}
        out[name] = {"activations": tracker.peak, "payload": payload}
    return out


@pytest.mark.slow
def test_a_skewed_router_is_within_the_planned_bound(tmp_path):
    """Every routing on rank 0's experts (sigmoid-bias, biases 10, 10, 0, 0), one step at dp2 ep2 on
    forked ranks: dropless, rank 0's saved activations equal the planner's worst case to the byte
    and its combine carries the worst case's rows (twice the even split's); with capacity 1.25 no
    rank holds more than the priced bound (rank 0 takes 1.25 x an even split's rows, and its own
    tokens' routings past the capacity are dropped). Under Ulysses each rank sends its own half of
    the sequence's routings. (At initialization, the router's own skew put 1.064 x the even split's
    activations on the busier rank, docs/moe.md.)"""
    from bigtrain.plan.expert_load import exchange_payload, expert_load

    tokens = tmp_path / "tokens.npy"  # as tests/test_plan.py measures: pre-tokenized, every target counted
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint16))
    configs = {name: (tiny_config(str(tmp_path), f"--data.source={tokens}", *SKEW, *extra), SKEWED_BIAS)
               for name, extra in SKEW_RUNS.items()}
    ranks = run_ranks(_skewed_step, 2, configs, str(tmp_path), timeout=300)
    hardware = get_profile("cpu")
    for name, (cfg, _) in configs.items():
        p = cfg.parallel
        model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
        layout = Layout(dp=p.dp, sp=p.sp, ep=p.ep, micro_batch=cfg.train.micro_batch, precision="fp32")
        priced = estimate_memory(model, layout, hardware, cfg.train.global_batch).activations
        skewed = estimate_memory(dataclasses.replace(model, skewed_routing=True), layout, hardware,
                                 cfg.train.global_batch).activations
        exchanges = model.moe_layers * layout.micro_batches(cfg.train.global_batch)  # per step
        load = expert_load(model, layout.ep, layout.seq_shards)
        dispatch, _ = exchange_payload(model, layout, load.even)
        _, most = exchange_payload(model, layout, load.worst)
        measured = [r[name] for r in ranks]
        assert all(m["payload"]["moe_dispatch"] <= exchanges * dispatch for m in measured), name
        assert all(m["payload"]["moe_combine"] <= exchanges * most for m in measured), name
        if name == "dropless":
            assert priced < skewed and measured[0]["activations"] == skewed, (priced, skewed, measured)
            assert measured[0]["payload"]["moe_combine"] == exchanges * most == 2 * exchanges * dispatch
            assert measured[1]["payload"]["moe_combine"] == 0
        elif name == "capacity-1.25":
            assert priced == skewed and all(m["activations"] <= priced for m in measured), (priced, measured)
            assert measured[0]["payload"]["moe_combine"] == exchanges * most  # 1.25 x the even split's
        else:  # Ulysses: a rank's half of each sequence, every routing sent
            assert all(m["payload"]["moe_dispatch"] == exchanges * dispatch for m in measured), measured


def test_flop_priced_experts_are_not_shared_by_tp():
    """A profile without a GEMM curve (gemm_fraction = 0) prices compute from FLOPs. An MoE block's
    router and experts run whole on every tp rank (docs/moe.md; the shape-aware path prices them so):
    of a micro-batch's forward, tp shares all but their 2 (E h + top_k 3 F h) FLOPs a token and
    block, which every rank does (the planner divided them by tp too: at tp 4 this model's forward
    was priced 1.77 ms, 36% of tp 1's, where the shape-aware path gives 73%)."""
    from bigtrain.plan.cost import stage_costs

    hw = dataclasses.replace(get_profile("h100-80g"), gemm_fraction=0.0)
    cluster = Cluster.build(8, hw)
    model = ModelSpec.build(layers=4, hidden=2048, heads=16, vocab=32000, seq=4096, experts=8, top_k=2)
    whole = model.seq * model.moe_layers * 2 * (8 * 2048 + 2 * 3 * model.expert_ffn * 2048)  # micro-batch 1
    rate = hw.sustained_flops("bf16")
    one = stage_costs(model, Layout(dp=8, micro_batch=1), cluster)
    for tp in (2, 4):
        cut = stage_costs(model, Layout(dp=8 // tp, tp=tp, micro_batch=1), cluster)
        assert cut.compute_f - one.compute_f / tp == pytest.approx(whole * (1 - 1 / tp) / rate, rel=1e-9)
        assert cut.compute_b - one.compute_b / tp == pytest.approx(2 * whole * (1 - 1 / tp) / rate, rel=1e-9)
        # zb-h1's W (the experts' weight gradients, deferred: no block recomputed) likewise
        assert cut.compute_w - one.compute_w / tp == pytest.approx(
            hw.weight_grad_fraction * 2 * whole * (1 - 1 / tp) / rate, rel=1e-9)


def _gemm_flops(rank, world_size, cfg, run_dir):
    """One micro-batch's forward and backward on this rank: the FLOPs of its GEMMs, (forward, backward)."""
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    tokens, targets = next(iter(trainer.sampler.micro_batches(0, trainer.mesh.coord("dp"), trainer.mesh.size("dp"),
                                                              cfg.train.micro_batch)))
    with GemmFlops() as forward:
        loss = trainer.parallel.forward_loss(tokens, targets)
    with GemmFlops() as backward:
        loss.backward()
    return forward.flops, backward.flops


def test_under_megatron_sp_a_tp_rank_runs_the_gemms_the_planner_times(corpus_cache, tmp_path):
    """The shape-aware time (plan/gemm.py linear_shapes) of a tp rank under Megatron SP, GEMM by
    GEMM against what the rank runs (2 Gloo ranks, tp 2, a dense block and an MoE block with a
    gated shared expert, dropless): the dense block's linears a tp share of the whole sequence, the
    MoE block's router, experts and shared expert whole on the gathered sequence (sequence_moe.py),
    the output layer a vocabulary share; backward twice the forward (dX and dW). Had the MoE block
    run on the rank's sequence shard, or been priced a tp share, the FLOPs would differ by 2x."""
    from bigtrain.plan.gemm import linear_shapes
    from bigtrain.plan.model import local_vocab

    cfg = tiny_config(corpus_cache, "--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_every=2",
                      "--model.moe_shared_expert=true", "--model.moe_shared_expert_gate=true",
                      "--parallel.tp=2", "--parallel.sequence_parallel=true", "--precision.mode=fp32",
                      "--train.global_batch=2", "--train.micro_batch=2")
    model, layout = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), _layout(cfg)
    assert layout.tp_sp and model.moe_layers == 1 and model.layers == 2
    tokens = layout.micro_batch * model.seq
    planned = sum(2 * m * n * k * count for moe in (False, True)
                  for m, n, k, count, _ in linear_shapes(model, layout, tokens, moe))
    planned += 2 * tokens * local_vocab(model.vocab, layout.tp) * model.hidden  # the output layer
    for forward, backward in run_ranks(_gemm_flops, 2, cfg, str(tmp_path), timeout=240):
        assert (forward, backward) == (planned, 2 * planned)


def test_the_search_offers_megatron_sp_with_experts_and_takes_it_where_it_is_what_fits():
    """tp_sp with experts (refused by the planner until 2026-11-29): the search offers it. Against its
    twin with tp_sp off, a layout holds fewer activations (the norms' inputs cut by tp; an MoE
    block's tensors whole on every tp rank either way, measured: tests/test_plan.py), sends half an
    all-reduce more each way per MoE block over tp (its input's and its output gradient's
    all-gathers, measured: tests/test_plan_grad_traffic.py) and runs its norms and residuals on a tp
    share of the tokens. Where only that memory lets a layout fit, the search chooses it."""
    from bigtrain.plan.cost import stage_costs, tp_collectives

    model = ModelSpec.build(layers=4, hidden=1024, heads=16, vocab=32000, seq=4096, experts=8, top_k=2)
    h100 = get_profile("h100-80g")
    cluster, fixed = Cluster.build(8, h100), {"tp": 2, "pp": 1, "micro_batch": 1, "zero": 1, "recompute": "none"}
    ranked = search(model, cluster, 64, fixed).ranked
    on = [p for p in ranked if p.layout.tp_sp]
    assert on and len(on) == len(ranked) // 2  # each ep, with and without SP
    for plan in on:
        off = evaluate(model, dataclasses.replace(plan.layout, tp_sp=False), cluster, 64)
        assert plan.memory.activations < off.memory.activations
        sp_costs, costs = stage_costs(model, plan.layout, cluster), stage_costs(model, off.layout, cluster)
        assert sp_costs.compute_f < costs.compute_f
        layers, moe = model.layers, model.moe_layers
        assert [a - b for a, b in zip(tp_collectives(plan.layout, layers, 0, moe),
                                      tp_collectives(off.layout, layers, 0, moe))] == [moe / 2, moe / 2]
    # a device between the two: of the pair, only tp_sp fits, and the search takes it
    best = on[0]
    twin = evaluate(model, dataclasses.replace(best.layout, tp_sp=False), cluster, 64)
    between = (best.memory.total + twin.memory.total) // 2 + h100.memory_bytes - best.memory.capacity
    tight = Cluster.build(8, dataclasses.replace(h100, memory_bytes=between))
    assert not evaluate(model, twin.layout, tight, 64).fits
    chosen = search(model, tight, 64, {**fixed, "ep": best.layout.ep, "sp": best.layout.sp}).best
    assert chosen.fits and chosen.layout == best.layout
