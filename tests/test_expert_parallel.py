"""Expert parallelism against the independent one-process reference (bigtrain check): dropless
and capacity-limited MoE, 5 steps, every layout's largest loss / gradient / weight difference
within 1e-5 relative (fp32); and the all-to-all traffic per MoE block per step against the formula."""

import pytest

from bigtrain.check.run import check_on_rank
from bigtrain.testing import run_ranks
from helpers import tiny_config

MOE = ["--train.global_batch=4", "--train.micro_batch=1", "--model.moe_experts=4", "--model.moe_top_k=2"]

LAYOUTS = {
    "ep2": ["--parallel.dp=2", "--parallel.ep=2"],
    "ep4": ["--parallel.dp=4", "--parallel.ep=4"],
    "ep2-dp2-zero2": ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=2"],
    "ep2-dp2-zero3": ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=3"],
    "ep2-tp2": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2"],
    "ep2-pp2": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.pp=2"],
    "ep2-capacity-1.0": ["--parallel.dp=2", "--parallel.ep=2", "--model.moe_capacity_factor=1.0"],
    "ep2-sigmoid-bias-grouped": ["--parallel.dp=2", "--parallel.ep=2", "--model.moe_router=sigmoid-bias",
                                 "--parallel.moe_grouped_mm=true"],
    # Qwen2-MoE's shared expert (its own size, gated per token), whole on every ep and tp rank. (At
    # size 40 one gradient element of layers.1.attention.wo is 9e-8, 3e-7 of the largest: Adam's
    # first step, g / (|g| + 1e-8), turns its fp32 rounding under tp into a 1.2e-5 weight
    # difference; the layout's replayed step is exact, and bigtrain check agrees by its rule.)
    "ep2-zero2-first-block-dense": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.zero=2",
                                    "--model.moe_dense_layers=0"],
    "ep2-tp2-zero3-shared-gated": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2", "--parallel.zero=3",
                                   "--model.moe_shared_expert=true", "--model.moe_shared_expert_hidden=48",
                                   "--model.moe_shared_expert_gate=true"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process(name, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *MOE, *LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 5, timeout=240)[0]
    assert report.agree, report.text()
    worst = {k: v for k, v in report.worst.items() if k in ("loss", "grad_norm", "weight")}
    assert all(v <= 1e-5 for v in worst.values()), report.text()


def _traffic(rank, world_size, cfg, run_dir):
    from helpers import trainer_on_rank
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    stats = trainer.mesh.stats
    result = trainer.train_step()
    return {k: (v, stats.calls[k]) for k, v in stats.payload.items() if k[0] == "ep"}, result.comm_ops


def test_all_to_all_bytes_equal_the_formula(corpus_cache, tmp_path):
    """Per step, dropless: per MoE block and micro-batch, dispatch and combine, forward and backward,
    each tokens x top_k x dim x 4 bytes of payload, (ep-1)/ep of it sent. A rank sends exactly its
    own routings in the dispatch (and the combine's backward); the combine (and the dispatch's
    backward) carries what its experts received, which depends on routing: summed over the ep
    ranks it is the same total."""
    cfg = tiny_config(corpus_cache, *MOE, *LAYOUTS["ep2"])
    ranks = run_ranks(_traffic, 2, cfg, str(tmp_path))
    micro = cfg.train.global_batch // (cfg.parallel.dp * cfg.train.micro_batch)
    tokens = cfg.train.micro_batch * cfg.data.seq_len
    per_exchange = tokens * cfg.model.moe_top_k * cfg.model.dim * 4
    blocks = cfg.model.n_layers  # moe_every = 1
    for tag in ("moe_dispatch", "moe_combine", "moe_dispatch_backward", "moe_combine_backward"):
        key = ("ep", f"all_to_all:{tag}")
        assert all(payload[key][1] == blocks * micro for payload, _ in ranks)
        total = sum(payload[key][0] for payload, _ in ranks)
        assert total == 2 * blocks * micro * per_exchange, tag
        if tag in ("moe_dispatch", "moe_combine_backward"):
            assert all(payload[key][0] == blocks * micro * per_exchange for payload, _ in ranks), tag
    sent = sum(v for _, ops in ranks for k, v in ops["ep"].items() if "moe_counts" not in k)
    assert sent == pytest.approx(2 * 4 * blocks * micro * per_exchange * (2 - 1) / 2)


def _moe_records(rank, world_size, cfg, run_dir, steps):
    from helpers import trainer_on_rank
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    return [trainer.train_step().moe for _ in range(steps)]


@pytest.mark.parametrize("layout", [["--parallel.pp=2"], ["--parallel.pp=2", "--parallel.dp=2", "--parallel.ep=2"]])
def test_the_step_record_holds_every_stages_moe_blocks(layout, corpus_cache, tmp_path):
    """The record (the first rank's) held only the first pipeline stage's blocks: a pp run's
    metrics and report lost the expert load of every block past it. Routings per expert and drops
    are counts (exact); the aux loss is a sum of fp32 per-sequence values (1e-5 relative)."""
    extra = ["--model.moe_capacity_factor=1.0", "--model.moe_aux_loss_coef=0.01"]
    one = run_ranks(_moe_records, 1, tiny_config(corpus_cache, *MOE, *extra), str(tmp_path / "one"), 2)[0]
    cfg = tiny_config(corpus_cache, *MOE, *extra, *layout)
    cut = run_ranks(_moe_records, cfg.parallel.world_size, cfg, str(tmp_path / "cut"), 2, timeout=240)[0]
    for ours, theirs in zip(cut, one):
        assert list(ours) == list(theirs) == ["layers.0.feed_forward", "layers.1.feed_forward"]
        for name, m in theirs.items():
            assert (ours[name]["load"], ours[name]["dropped"]) == (m["load"], m["dropped"]), name
            assert ours[name]["aux"] == pytest.approx(m["aux"], rel=1e-5), name
