"""``bigtrain check`` and the layout fuzzer on the DLRM: sharded tables against the one-process
plain-PyTorch reference (:mod:`bigtrain.check.reference_dlrm`), per step, within fp32's bounds;
a broken row offset and a column-wise Adagrad that forgets the other columns are caught, at the
step, module and table they break; a fixed sample of DLRM fuzz draws is rejected by name or agrees."""

from __future__ import annotations

import random

import pytest

from bigtrain.check.fuzz import COMPILED, draw_sample, run_sample
from bigtrain.check.fuzz_layouts import DLRM, sample_dlrm_layout
from bigtrain.check.run import check_on_rank
from bigtrain.cli import main
from bigtrain.config import load_config
from bigtrain.parallel.embedding import ShardedEmbeddingBags
from bigtrain.testing import run_ranks
from bigtrain.validation import validate

SMALL = ["--embedding.tables=16,8,24", "--embedding.dim=8", "--embedding.hotness=2", "--train.global_batch=8",
         "--embedding.lr=0.1", "--optim.warmup_steps=1", "--optim.grad_clip=0.5"]


def dlrm_config(*overrides: str):
    cfg = load_config(preset="dlrm-tiny", overrides=SMALL + list(overrides))
    validate(cfg)
    return cfg


def test_check_agrees_on_sharded_tables(tmp_path):
    cfg = dlrm_config("--parallel.dp=2", "--embedding.sharding=row,column,data")
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3)[0]
    assert report.agree and report.steps == 3, report.text()
    # measured, not only passed: every kind was compared, the tables' weights among them
    assert report.worst["loss"] <= 1e-5 and 0 < report.worst["weight"] <= 1e-5, report.worst
    assert {"grad_norm", "gradient", "forward"} <= set(report.worst)


def _row_offset_off_by_one(original):
    """``_group_rows`` whose row pieces on rank 1 look up the next row of their piece."""
    def faulty(self, g, *args):
        rows, bags, offsets = original(self, g, *args)
        if g.kind == "row" and self.rank == 1:
            rows = (rows + 1) % g.store.shape[0]
        return rows, bags, offsets
    return faulty


def test_check_catches_a_broken_row_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(ShardedEmbeddingBags, "_group_rows", _row_offset_off_by_one(ShardedEmbeddingBags._group_rows))
    cfg = dlrm_config("--parallel.dp=2", "--embedding.sharding=row")
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3)[0]
    assert not report.agree and report.first_step == 0, report.text()
    assert report.first("forward").name == "embeddings"  # the lookup, before the top MLP
    assert report.first("loss").error > 1e-5
    wrong = {f.name for f in report.findings if f.kind == "weight"}
    assert {f"embeddings.tables.{t}.weight" for t in range(3)} <= wrong
    assert "DIFFER from step 1" in report.text() and "module embeddings output" in report.text()


def test_check_catches_column_adagrad_without_the_other_columns(tmp_path, monkeypatch):
    """Row-wise Adagrad on a column piece must add the other pieces' squares: without that the
    forward and loss of step 0 are right, the tables' update is not."""
    original = ShardedEmbeddingBags._update
    monkeypatch.setattr(ShardedEmbeddingBags, "_update",
                        lambda self, weight, state, rows, grad, column, bags=None:
                        original(self, weight, state, rows, grad, False, bags))
    cfg = dlrm_config("--parallel.dp=2", "--embedding.sharding=table,column,table")
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3)[0]
    assert not report.agree and report.first_step == 0, report.text()
    assert report.first("forward") is None and report.first("loss") is None
    assert [f.name for f in report.findings if f.kind == "weight"] == ["embeddings.tables.1.weight"]


def test_the_check_command_on_a_dlrm_preset(tmp_path, capsys):
    code = main(["check", "--preset", "dlrm-tiny", "--steps", "2", "--output-dir", str(tmp_path), *SMALL,
                 "--embedding.sharding=table"])
    assert code == 0
    assert "agree: 2 steps" in capsys.readouterr().out


SEED, COUNT = 20261123, 8
SAMPLES = [sample_dlrm_layout(random.Random(f"{SEED}:{i}"), 4) for i in range(COUNT)]


@pytest.mark.parametrize("overrides", SAMPLES, ids=[f"dlrm{i}" for i in range(COUNT)])
def test_a_fixed_dlrm_fuzz_sample_is_rejected_by_name_or_agrees(overrides, tmp_path):
    outcome = run_sample(overrides, str(tmp_path), steps=3)
    assert outcome.ok, f"{outcome.verdict}: {' '.join(overrides)}\n{outcome.detail}"


def test_the_dlrm_draws_span_shardings_optimizers_and_ranks():
    draws = [sample_dlrm_layout(random.Random(f"{SEED}:{i}"), 4) for i in range(60)]
    values = {o for d in draws for o in d}
    for kind in ("table", "row", "column", "data", "auto"):
        assert f"--embedding.sharding={kind}" in values
    assert any("," in o for o in values if o.startswith("--embedding.sharding="))  # per-table kinds
    for o in ("--embedding.optimizer=sgd", "--embedding.optimizer=rowwise_adagrad", "--parallel.dp=1",
              "--parallel.dp=2", "--parallel.dp=4", "--optim.name=lion", "--optim.name=adafactor"):
        assert o in values, o
    assert any(o.startswith("--embedding.budget_gb=") for o in values)


def test_the_model_draw_keeps_the_decoder_samples_of_a_seed():
    from bigtrain.check.fuzz_layouts import sample_layout

    mixed = [draw_sample(SEED, i, 8, 0.5, resume_share=0.0, int8_share=0.0, hf_share=0.0, cp_share=0.0,
                         documents_share=0.0)
             for i in range(40)]
    assert 5 < sum(DLRM in s for s in mixed) < 35
    for i, s in enumerate(mixed):
        if DLRM not in s:  # compilation is drawn on top, from a generator of its own
            assert [o for o in s if o != COMPILED] == sample_layout(random.Random(f"{SEED}:{i}"), 8)
    assert all(DLRM not in draw_sample(SEED, i, 8, 0.0) for i in range(40))


def test_the_compile_draw_keeps_the_decoder_samples_and_never_compiles_a_dlrm():
    from bigtrain.check.fuzz_layouts import sample_layout

    compiled = [draw_sample(SEED, i, 8, 0.0, resume_share=0.0, int8_share=0.0, compile_share=1.0, hf_share=0.0,
                cp_share=0.0, documents_share=0.0)
                for i in range(20)]
    assert all(s[-1] == COMPILED and s[:-1] == sample_layout(random.Random(f"{SEED}:{i}"), 8)
               for i, s in enumerate(compiled))
    assert all(COMPILED not in draw_sample(SEED, i, 8, 1.0, compile_share=1.0) for i in range(20))  # DLRMs only
    assert all(COMPILED not in draw_sample(SEED, i, 8, 0.2, compile_share=0.0) for i in range(20))


def test_the_int8_draw_never_joins_a_float8_sample():
    """Validation refuses int8 compression with float8 linears, so int8 drawn on a float8 sample
    would only make it a rejection: the float8 samples (compared at the bf16 bounds) all train."""
    from bigtrain.check.fuzz import INT8

    samples = [draw_sample(SEED, i, 8, 0.0, resume_share=0.0, int8_share=1.0, hf_share=hf, compile_share=0.0)
               for hf in (0.0, 1.0) for i in range(60)]
    float8 = [s for s in samples if any(o.startswith("--precision.fp8=") for o in s)]
    assert float8 and not any(INT8 in s for s in float8)
    assert any(INT8 in s for s in samples)


@pytest.mark.slow
def test_the_check_command_runs_dlrm_ranks_under_torchrun(tmp_path, capsys):
    code = main(["check", "--preset", "dlrm-tiny", "--steps", "2", "--output-dir", str(tmp_path), *SMALL,
                 "--parallel.dp=2", "--embedding.sharding=row,column,table"])
    assert code == 0
    assert "agree: 2 steps" in capsys.readouterr().out
