"""The planner with experts: per-rank parameter bytes under expert parallelism equal the storages
the runtime allocates (measured on forked Gloo ranks); active FLOPs count top_k of E experts; the
all-to-all is timed only when ep > 1; Mixtral 8x7B's size and a plan for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bigtrain.config import load_config
from bigtrain.plan.cost import expert_all_to_all
from bigtrain.plan.hardware import get_profile
from bigtrain.plan.layout import Cluster, Layout, layout_problems
from bigtrain.plan.memory import rank_units, unit_state_bytes
from bigtrain.plan.model import ModelSpec
from bigtrain.plan.search import search
from bigtrain.testing import run_ranks
from helpers import tiny_config, trainer_on_rank

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
    assert all(not p.layout.tp_sp for p in result.ranked)  # not counted yet: refused (plan/layout.py)
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
