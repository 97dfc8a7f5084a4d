"""Sharded checkpoints of a DLRM run: saved after 4 of 8 steps and resumed, the run goes on as the
uninterrupted one did. Resumed on the same layout: bit for bit; on another sharding and another
number of ranks (the tables' rectangles resharded by torch.distributed.checkpoint): within 1e-5, as
any two layouts agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigtrain.recsys.train import gather_tables
from bigtrain.testing import run_ranks
from bigtrain.train import Trainer
from tests.helpers import assert_rel_close, trainer_on_rank
from tests.test_dlrm_parallel import MIX, TABLES, dlrm_config

SAVED_AT, STEPS = 4, 8


def snapshot(trainer: Trainer, losses: list[float]) -> dict:
    return {"losses": losses, "tables": gather_tables(trainer.parallel, trainer.parallel.layout),
            "dense": {n: p.detach().clone() for n, p in trainer.parallel.dense.named_parameters()},
            "step": trainer.step}


def saved_checkpoint(run_dir: str) -> str:
    return str(Path(run_dir) / "checkpoints" / f"step_{SAVED_AT:08d}")


def train_and_save(rank: int, world: int, cfg, run_dir: str) -> dict:
    """The uninterrupted run, saving its state after SAVED_AT steps (the Trainer's save, as any family's)."""
    trainer = trainer_on_rank(rank, world, cfg, run_dir)
    losses = [trainer.train_step().loss for _ in range(SAVED_AT)]
    assert trainer.save()
    trainer.wait_for_save()
    losses += [trainer.train_step().loss for _ in range(STEPS - SAVED_AT)]
    return snapshot(trainer, losses)


def resume_and_train(rank: int, world: int, cfg, run_dir: str, resumed_dir: str) -> dict:
    trainer = trainer_on_rank(rank, world, cfg, resumed_dir)
    assert trainer.resume(saved_checkpoint(run_dir))
    assert trainer.step == SAVED_AT
    return snapshot(trainer, [trainer.train_step().loss for _ in range(STEPS - SAVED_AT)])


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_resumed_dlrm_run_equals_the_uninterrupted_one(tmp_path, optimizer):
    path = str(tmp_path / "run")
    whole = run_ranks(train_and_save, 2, dlrm_config(2, MIX, optimizer), path, timeout=300)[0]
    same = run_ranks(resume_and_train, 2, dlrm_config(2, MIX, optimizer), path, str(tmp_path / "same"),
                     timeout=300)[0]
    assert same["losses"] == whole["losses"][SAVED_AT:]
    for t, table in whole["tables"].items():
        assert torch.equal(same["tables"][t], table), f"table {t}"
    for name, weight in whole["dense"].items():
        assert torch.equal(same["dense"][name], weight), name
    # another sharding on another number of ranks: the row pieces of 4 ranks read parts of the
    # saved whole tables, row pieces and column pieces
    other = run_ranks(resume_and_train, 4, dlrm_config(4, "row", optimizer), path, str(tmp_path / "other"),
                      timeout=300)[0]
    for loss, expected in zip(other["losses"], whole["losses"][SAVED_AT:]):
        assert abs(loss - expected) <= 1e-5 * abs(expected)
    for t, table in whole["tables"].items():
        assert_rel_close(other["tables"][t], table, 1e-5, f"table {t}, resumed row-wise on 4 ranks")
    for name, weight in whole["dense"].items():
        assert_rel_close(other["dense"][name], weight, 1e-5, name)


def test_a_fresh_run_differs_from_the_resumed_one(tmp_path):
    """The check above can fail: without the checkpoint's accumulators the run goes elsewhere."""
    path = str(tmp_path / "run")
    cfg = dlrm_config(2, MIX)
    whole = run_ranks(train_and_save, 2, cfg, path, timeout=300)[0]

    def resume_weights_only(rank: int, world: int, cfg, path: str) -> dict:
        trainer = trainer_on_rank(rank, world, cfg, str(tmp_path / "lost"))
        assert trainer.resume(saved_checkpoint(path))
        for state in trainer.parallel.embeddings.state_tensors():
            state.zero_()  # as if the row-wise Adagrad state had not been saved
        return snapshot(trainer, [trainer.train_step().loss for _ in range(STEPS - SAVED_AT)])

    lost = run_ranks(resume_weights_only, 2, cfg, path, timeout=300)[0]
    assert lost["losses"][0] == whole["losses"][SAVED_AT]  # the same weights: the same first loss
    assert any(not torch.equal(lost["tables"][t], table) for t, table in whole["tables"].items())


def fit_in(rank: int, world: int, cfg, run_dir: str) -> dict:
    trainer = trainer_on_rank(rank, world, cfg, run_dir)
    return snapshot(trainer, [r.loss for r in trainer.fit()])


def test_fit_saves_every_n_steps_and_resumes_from_a_checkpoint_on_another_sharding(tmp_path):
    """``checkpoint.every`` and ``checkpoint.resume`` in :meth:`Trainer.fit` taking the DLRM's step: a run saving at steps
    4 and 8, and a run resuming its step-4 checkpoint column-wise, end alike (the resumed one
    saving its final step)."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    saving = dlrm_config(2, MIX, overrides=("--checkpoint.every=4", f"--train.steps={STEPS}"))
    whole = run_ranks(fit_in, 2, saving, str(first), timeout=300)[0]
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    resuming = dlrm_config(2, "column", overrides=(
        f"--checkpoint.resume={first / 'checkpoints' / 'step_00000004'}", f"--train.steps={STEPS}"))
    resumed = run_ranks(fit_in, 2, resuming, str(second), timeout=300)[0]
    assert resumed["step"] == whole["step"] == STEPS
    assert [p.name for p in (second / "checkpoints").iterdir()] == ["step_00000008"]
    for t, table in whole["tables"].items():
        assert_rel_close(resumed["tables"][t], table, 1e-5, f"table {t}, resumed column-wise")
    assert abs(resumed["losses"][-1] - whole["losses"][-1]) <= 1e-5 * abs(whole["losses"][-1])


def test_a_checkpoint_of_other_tables_or_another_dense_optimizer_is_refused(tmp_path):
    """Reading fewer rows than were saved would succeed and cut a table short: the run's tables,
    MLPs and dense optimizer must be the checkpoint's (found by review: a resume with smaller tables
    loaded the first rows of each)."""
    from bigtrain.testing import RankFailure

    saving = dlrm_config(2, "table", overrides=("--checkpoint.every=4", "--train.steps=4"))
    run_ranks(fit_in, 2, saving, str(tmp_path), timeout=300)
    saved = tmp_path / "checkpoints" / "step_00000004"
    assert TABLES == "4x64,2x32"
    for changed, message in (("--embedding.tables=4x32,2x32", r"embedding.tables = .*written with embedding.tables"),
                             ("--optim.name=lion", r"optimizer state is 'adamw'.*resume with optim.name = 'adamw'")):
        cfg = dlrm_config(2, "table", overrides=(f"--checkpoint.resume={saved}", "--train.steps=8", changed))
        with pytest.raises(RankFailure, match=f"ResumeError: .*{message}"):
            run_ranks(fit_in, 2, cfg, str(tmp_path / "again"), timeout=300)


def _save_then_resume_with(rank: int, world: int, saved_with: str, resumed_with: str, run_dir: str) -> int:
    first = trainer_on_rank(rank, world, dlrm_config(world, "row", saved_with), run_dir)
    first.train_step()
    assert first.save()
    cfg = dlrm_config(world, "row", resumed_with)
    cfg.checkpoint.resume = "auto"
    again = trainer_on_rank(rank, world, cfg, run_dir)
    assert again.resume("auto")
    return again.step


def test_tables_saved_without_state_refuse_an_optimizer_that_needs_it_by_name(tmp_path):
    """A checkpoint of SGD tables has no row-wise Adagrad accumulators. The check before launch let it
    pass with a warning ('its state is ... missing'); every rank then found each checkpoint 'verifies
    but failed to load' and stopped with 'remove the broken ones to start afresh': good checkpoints,
    which the advice would have deleted. Now one error naming the field and the value to resume with,
    before launch and in the ranks; the other way (the state dropped) resumes with a warning."""
    import json

    from bigtrain.checkpoint.compat import compare_configs
    from bigtrain.checkpoint.resume import ResumeError

    with pytest.raises(ResumeError, match="embedding.optimizer = 'rowwise_adagrad', but the checkpoint .* "
                                          "resume with embedding.optimizer = 'sgd'") as refused:
        _save_then_resume_with(0, 1, "sgd", "rowwise_adagrad", str(tmp_path / "sgd"))
    assert "broken" not in str(refused.value)
    meta = json.loads((tmp_path / "sgd" / "checkpoints" / "step_00000001" / "meta.json").read_text())
    errors, _ = compare_configs(meta["config"], dlrm_config(1, "row", "rowwise_adagrad"), "step_00000001")
    assert len(errors) == 1 and "resume with embedding.optimizer = 'sgd'" in errors[0]
    with pytest.warns(UserWarning, match="embedding.optimizer = 'sgd' differs .* per-row state is dropped"):
        assert _save_then_resume_with(0, 1, "rowwise_adagrad", "sgd", str(tmp_path / "adagrad")) == 1
