"""The DLRM in one process: the model's pieces, the data, the sparse optimizers, the metrics, the
planner, bad input, and that dlrm-tiny learns."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config import ConfigError, load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.dlrm import DLRM, EmbeddingBags, interaction
from bigtrain.optim.sparse import SparseOptimizer, row_gradient
from bigtrain.plan.embedding import describe_plan, plan_embedding
from bigtrain.recsys.data import HELD_OUT, CriteoTsv, SyntheticCriteo, read_criteo_tsv
from bigtrain.recsys.metrics import auc, log_loss
from bigtrain.core.tables import parse_sizes
from bigtrain.train import Trainer
from bigtrain.validation import validate


# -- the model ----------------------------------------------------------------------------------------
def test_embedding_bags_sum_the_rows_of_each_sample():
    bags = EmbeddingBags([5, 7], 3)
    ids = torch.tensor([[[0, 4], [6, 6]], [[1, 1], [0, 2]]])
    out = bags(ids)
    for b, t in itertools.product(range(2), range(2)):
        expected = bags.tables[t].weight[ids[b, t]].sum(0)
        torch.testing.assert_close(out[b, t], expected)


def test_interaction_is_the_bottom_output_and_the_pairwise_dots():
    bottom, pooled = torch.randn(2, 4), torch.randn(2, 3, 4)
    out = interaction(bottom, pooled)
    features = [bottom] + [pooled[:, i] for i in range(3)]
    dots = [(features[i] * features[j]).sum(1) for i in range(4) for j in range(i)]
    torch.testing.assert_close(out, torch.cat([bottom, torch.stack(dots, 1)], 1))


def test_interaction_gradient_equals_autograd_of_the_plain_formula():
    """The hand-written backward (one bmm on the symmetrized gradient) against autograd of
    bmm + lower-triangle indexing, in float64, and torch's gradcheck."""
    bottom, pooled = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)
    grad_out = torch.randn(5, 4 + 6, dtype=torch.float64)
    ours = [t.clone().requires_grad_() for t in (bottom, pooled)]
    interaction(*ours).backward(grad_out)
    plain = [t.clone().requires_grad_() for t in (bottom, pooled)]
    features = torch.cat([plain[0].unsqueeze(1), plain[1]], 1)
    i, j = torch.tril_indices(4, 4, offset=-1)
    torch.cat([plain[0], torch.bmm(features, features.transpose(1, 2))[:, i, j]], 1).backward(grad_out)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(interaction, [t.clone().requires_grad_() for t in (bottom, pooled)])


def test_model_shapes_and_initial_values_depend_on_the_seed_and_name_only():
    a, b = DLRM(13, [10, 20], 4, [8], [6]), DLRM(13, [10, 20], 4, [8], [6])
    a.init_weights(3)
    b.init_weights(3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert float(a.embeddings.tables[0].weight.detach().abs().max()) <= (1 / 10) ** 0.5
    assert a(torch.randn(5, 13), torch.zeros(5, 2, 3, dtype=torch.long)).shape == (5,)


def test_sizes_parse():
    assert parse_sizes("3x10,5") == [10, 10, 10, 5] and parse_sizes("") == [] and parse_sizes("64, 32") == [64, 32]


# -- data ---------------------------------------------------------------------------------------------
def test_synthetic_samples_do_not_depend_on_how_a_batch_is_cut():
    data = SyntheticCriteo([100, 1000, 7], hotness=2, seed=5, global_batch=12)
    whole = data.batch(3, 0, 12)
    parts = [data.batch(3, first, 4) for first in (0, 4, 8)]
    for i in range(3):
        assert torch.equal(whole[i], torch.cat([p[i] for p in parts]))
    dense, ids, labels = whole
    assert dense.shape == (12, 13) and ids.shape == (12, 3, 2) and labels.shape == (12,)
    assert not torch.equal(data.held_out().batch(3, 0, 12)[1], ids) and data.held_out().first_index == HELD_OUT


def test_synthetic_ids_are_in_range_and_power_law():
    _, ids, labels = SyntheticCriteo([1000] * 2, seed=1, global_batch=4000).batch(0, 0, 4000)
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000
    counts = torch.bincount(ids.flatten(), minlength=1000)
    assert counts[:10].sum() > 10 * counts[500:510].sum()  # the head is far hotter than the middle
    assert 0.2 < float(labels.mean()) < 0.8


def test_criteo_tsv_reader(tmp_path):
    rows = [100] * 26
    lines = ["1\t" + "\t".join(["3"] * 12 + [""]) + "\t" + "\t".join(["a1"] * 25 + [""]),
             "0\t" + "\t".join(["-5"] + ["0"] * 12) + "\t" + "\t".join(["ff"] * 26)]
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n")
    dense, ids, labels = read_criteo_tsv(path, rows)
    assert labels.tolist() == [1.0, 0.0] and ids.shape == (2, 26, 1)
    assert dense[0, 0] == pytest.approx(torch.log1p(torch.tensor(3.0))) and dense[0, 12] == 0 and dense[1, 0] == 0
    assert ids[0, 0, 0] == 0xA1 % 100 and ids[0, 25, 0] == 0 and ids[1, 3, 0] == 0xFF % 100
    sampler = CriteoTsv(path, rows, global_batch=2, held_out_fraction=0.5)
    assert sampler.batch(0, 0, 3)[2].tolist() == [1.0, 1.0, 1.0]  # one training line, wrapped
    assert sampler.held_out().batch(0, 0, 1)[2].tolist() == [0.0]
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="day_0.tsv:1: 3 tab-separated fields"):
        read_criteo_tsv(path, rows)


# -- the sparse optimizers ------------------------------------------------------------------------------
def test_row_gradient_equals_autograd_and_untouched_rows_stay():
    weight = torch.randn(10, 4, requires_grad=True)
    ids, grad_out = torch.tensor([[1, 3], [3, 3], [7, 1]]), torch.randn(3, 4)
    F.embedding_bag(ids, weight, mode="sum").backward(grad_out)
    rows, grad = row_gradient(ids, grad_out)
    assert rows.tolist() == [1, 3, 7]
    torch.testing.assert_close(grad, weight.grad[rows])
    # the same ids listed one by one with the sample each was pooled into (bucketized row pieces)
    by_bag = row_gradient(ids.reshape(-1), grad_out, torch.arange(3).repeat_interleave(2))
    assert by_bag[0].tolist() == [1, 3, 7] and torch.equal(by_bag[1], grad)
    for name in ("sgd", "rowwise_adagrad"):
        opt, w = SparseOptimizer(name, 0.1), weight.detach().clone()
        opt.update(w, opt.new_state(w), rows, grad)
        untouched = [r for r in range(10) if r not in (1, 3, 7)]
        assert torch.equal(w[untouched], weight.detach()[untouched]) and not torch.equal(w[rows], weight[rows])


# -- metrics --------------------------------------------------------------------------------------------
def test_auc_counts_ordered_pairs_and_ties_half():
    scores, labels = torch.tensor([0.1, 0.4, 0.4, 0.8, 0.3]), torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p in pos for n in neg]
    assert auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert log_loss(torch.zeros(4), torch.tensor([0.0, 1.0, 1.0, 0.0])) == pytest.approx(0.6931, abs=1e-4)


# -- the planner ----------------------------------------------------------------------------------------
def test_planner_fits_criteo_terabyte_tables_on_8_ranks():
    cfg = load_config(preset="dlrm-criteo")
    rows, budget = parse_sizes(cfg.embedding.tables), int(cfg.embedding.budget_gb * 2**30)
    with pytest.raises(ValueError, match="embedding.budget_gb"):
        plan_embedding(rows, 128, 1, "auto", 4, budget)
    layout = plan_embedding(rows, 128, 8, "auto", 4, budget)
    per_rank = [layout.rank_bytes(r, 4) for r in range(8)]
    assert max(per_rank) <= budget
    assert max(per_rank) < 1.3 * sum(per_rank) / 8  # balanced
    assert {layout.kinds[t] for t, r in enumerate(rows) if r > 10**7} <= {"row", "column"}  # the giants are cut
    assert "-wise" in describe_plan(layout, 8192, 1)


def test_explicit_table_wise_owners_balance_the_tables():
    layout = plan_embedding([100, 100, 100, 100, 10, 10], 4, 2, "table")
    assert sorted(layout.owners[:4]) == [0, 0, 1, 1]


# -- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, field", [
    (["--embedding.tables=4x100,0"], "embedding.tables"),
    (["--parallel.dp=4", "--embedding.tables=26x1001", "--embedding.sharding=row"], "embedding.sharding"),
    (["--parallel.dp=3", "--train.global_batch=255", "--embedding.sharding=column"], "embedding.sharding"),
    (["--embedding.sharding=diagonal"], "embedding.sharding"),
    (["--embedding.sharding=row,table"], "embedding.sharding"),
    (["--embedding.optimizer=adam"], "embedding.optimizer"),
    (["--embedding.tables=lots"], "embedding.tables"),
    (["--precision.mode=bf16"], "precision.mode"),
    (["--parallel.zero=1"], "parallel.zero"),
])
def test_bad_dlrm_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        validate(load_config(preset="dlrm-tiny", overrides=overrides))


def tiny_trainer(*overrides: str) -> Trainer:
    """The Trainer every family shares, taking the DLRM's step (no run directory is written here)."""
    cfg = load_config(preset="dlrm-tiny", overrides=list(overrides))
    validate(cfg)
    return Trainer(cfg, "unused-run-dir", Mesh.from_config(cfg.parallel, 0, 1))


def test_ids_out_of_range_are_rejected_naming_the_table():
    trainer = tiny_trainer("--embedding.tables=26x50")
    ids = torch.zeros(2, 26, 2, dtype=torch.long)
    ids[1, 4, 1] = 50
    with pytest.raises(ValueError, match="embedding.tables: id 50 of sparse feature 4 .* 50 rows"):
        trainer.model(torch.zeros(2, 13), ids)


# -- learning -------------------------------------------------------------------------------------------
def test_dlrm_tiny_auc_rises_above_0_7():
    """The first 100 of dlrm-tiny's 500 steps (the whole run: docs/recommenders.md)."""
    trainer = tiny_trainer()
    assert trainer.evaluate()["auc"] < 0.6
    for _ in range(100):
        trainer.train_step()
    assert trainer.evaluate()["auc"] > 0.7


def test_plan_cli_shows_the_tables_placement(capsys):
    from bigtrain.cli import main

    assert main(["plan", "--preset", "dlrm-criteo", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "over 8 ranks" in out and "column-wise" in out and "all-to-all MiB/step" in out
    assert main(["plan", "--preset", "dlrm-criteo", "--gpus", "1"]) == 2  # 90 GiB of tables, a 70 GiB budget
    assert "embedding.budget_gb" in capsys.readouterr().err
