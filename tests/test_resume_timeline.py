"""A run rolled back to an earlier checkpoint of its own leaves the later ones behind, and the
checkpoints a run resumed past never rotate its new saves away.

A roll-back (``checkpoint.resume`` = a path under ``RUN/checkpoints``: past a loss spike, with other
settings maybe) trains those steps again on another timeline. The later checkpoints used to stay:
rotation (``checkpoint.keep``) counted them as the newest, deleting the rolled-back run's new saves
(with ``keep = 1`` each save as it was committed), and the next 'auto' resume (a crash, a launcher's
restart, whose ``resume_after_restart`` saw "a checkpoint of its own") loaded the abandoned step
without a word. Now rank 0 removes them once every rank has loaded the roll-back's checkpoint. An
'auto' fall-back past newer checkpoints that do not verify or load removes nothing (the same steps
trained again are the same run; the failure may pass), and rotation counts only the checkpoints up
to the step it commits, so they no longer evict the run's new saves either.
"""

from __future__ import annotations

import shutil

import pytest

from bigtrain import checkpoint as ckpt
from bigtrain.checkpoint.resume import resume_after_restart
from helpers import run_steps, tiny_config, trainer_on_rank


def _names(run_dir):
    return [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")]


@pytest.fixture
def four_steps(corpus_cache, tmp_path):
    """A run saved at steps 2 and 4 (keep 2); its step 4 is the timeline a roll-back leaves."""
    run = tmp_path / "run"
    trainer = trainer_on_rank(0, 1, tiny_config(corpus_cache, "--train.steps=6", "--checkpoint.keep=2"), str(run))
    for _ in range(2):
        run_steps(trainer, 2)
        trainer.save()
    assert _names(run) == ["step_00000004", "step_00000002"]
    return run


@pytest.mark.parametrize("keep", [1, 2])
def test_a_rolled_back_run_resumes_its_own_newest_checkpoint_after_a_crash(keep, four_steps, corpus_cache):
    run = four_steps
    cfg = tiny_config(corpus_cache, "--train.steps=6", f"--checkpoint.keep={keep}")
    rolled_back = trainer_on_rank(0, 1, cfg, str(run))
    assert rolled_back.resume(str(run / "checkpoints" / "step_00000002")) and rolled_back.step == 2
    # a launcher's restart before its first save starts from the roll-back's checkpoint again, not step 4
    restarted = trainer_on_rank(0, 1, cfg, str(run))
    assert restarted.resume(resume_after_restart(str(run / "checkpoints" / "step_00000002"), run))
    assert restarted.step == 2
    run_steps(rolled_back, 1)
    rolled_back.save()  # step 3, then the run "crashes"
    assert _names(run)[0] == "step_00000003"
    again = trainer_on_rank(0, 1, cfg, str(run))
    assert again.resume("auto") and again.step == 3


def test_a_fallback_past_a_corrupt_newest_checkpoint_keeps_the_runs_new_saves(four_steps, corpus_cache):
    run = four_steps
    shard = next((run / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])  # the checksum no longer matches
    cfg = tiny_config(corpus_cache, "--train.steps=6", "--checkpoint.keep=1")
    resumed = trainer_on_rank(0, 1, cfg, str(run))
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert resumed.resume("auto") and resumed.step == 2
    run_steps(resumed, 1)
    resumed.save()
    assert _names(run) == ["step_00000004", "step_00000003"]  # the save is kept (not the corrupt step 4 alone)
    again = trainer_on_rank(0, 1, cfg, str(run))
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert again.resume("auto") and again.step == 3


def test_a_fallback_in_a_checkpoints_folder_named_by_path_removes_nothing(four_steps, corpus_cache):
    """checkpoint.resume = the checkpoints folder (not one checkpoint): falling back past its newest,
    which fails to verify, is no roll-back; that checkpoint stays (its failure may pass)."""
    run = four_steps
    shard = next((run / "checkpoints" / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    resumed = trainer_on_rank(0, 1, tiny_config(corpus_cache, "--train.steps=6"), str(run))
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert resumed.resume(str(run / "checkpoints")) and resumed.step == 2
    assert _names(run) == ["step_00000004", "step_00000002"]


def test_resuming_the_newest_checkpoint_removes_nothing(four_steps, corpus_cache):
    run = four_steps
    copy = run.parent / "copy"
    shutil.copytree(run, copy)
    cfg = tiny_config(corpus_cache, "--train.steps=6", "--checkpoint.keep=2")
    assert trainer_on_rank(0, 1, cfg, str(run)).resume("auto")
    assert _names(run) == ["step_00000004", "step_00000002"]
    # a checkpoint of another folder (a run started from it) leaves that folder as it was
    other = trainer_on_rank(0, 1, cfg, str(run.parent / "elsewhere"))
    assert other.resume(str(copy / "checkpoints" / "step_00000002"))
    assert _names(copy) == ["step_00000004", "step_00000002"]


def test_a_run_resumed_at_its_last_step_does_not_write_that_checkpoint_again(corpus_cache, tmp_path, monkeypatch):
    """A launcher's restart of a run whose ranks failed after the final save resumes at train.steps
    with nothing to train: its final save wrote the same step again, deleting the old folder first
    (a second failure meanwhile lost the run's newest checkpoint). As ``--resume`` of a finished run,
    it changes no checkpoint now."""
    from bigtrain.checkpoint import commit

    cfg = tiny_config(corpus_cache, "--train.steps=2", "--checkpoint.save_final=true", "--checkpoint.every=0")
    trainer_on_rank(0, 1, cfg, str(tmp_path)).fit()
    assert _names(tmp_path) == ["step_00000002"]
    replaced, remove = [], commit._remove
    monkeypatch.setattr(commit, "_remove", lambda path: (replaced.append(path.name), remove(path)))
    restarted = tiny_config(corpus_cache, "--train.steps=2", "--checkpoint.save_final=true", "--checkpoint.every=0",
                            "--checkpoint.resume=auto")
    trainer = trainer_on_rank(0, 1, restarted, str(tmp_path))
    trainer.fit()
    assert trainer.step == 2 and replaced == []


def test_a_roll_back_repeated_after_the_run_went_on_is_refused_before_launch(four_steps, corpus_cache):
    """A job script holding the roll-back (checkpoint.resume = RUN/checkpoints/step_2), requeued after
    the run trained on, would roll it back again and remove what it trained since: refused, naming
    both fixes; once the record is removed (a deliberate second roll-back), it runs."""
    from bigtrain.config import ConfigError
    from bigtrain.run_dir import check_run_dir

    run, target = four_steps, str(four_steps / "checkpoints" / "step_00000002")
    cfg = tiny_config(corpus_cache, "--train.steps=6", f"--checkpoint.resume={target}")
    assert check_run_dir(cfg, run, explicit_resume=False, overwrite=False) is not None  # the first roll-back
    rolled_back = trainer_on_rank(0, 1, cfg, str(run))
    assert rolled_back.resume(target) and rolled_back.step == 2
    assert check_run_dir(cfg, run, explicit_resume=False, overwrite=False) is not None  # nothing trained since
    run_steps(rolled_back, 1)
    rolled_back.save()  # step 3
    with pytest.raises(ConfigError) as err:
        check_run_dir(cfg, run, explicit_resume=False, overwrite=False)
    said = str(err.value)
    assert "rolls the run back to step 2 again" in said and "newest: step_00000003" in said, said
    assert "continue with --resume" in said and str(run / "checkpoints" / "rolled_back.json") in said
    (run / "checkpoints" / "rolled_back.json").unlink()
    assert check_run_dir(cfg, run, explicit_resume=False, overwrite=False) is not None
    assert _names(run) == ["step_00000003", "step_00000002"]  # the record is no checkpoint
