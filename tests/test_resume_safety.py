"""Safe resume: the reproductions of issue 11 ("resume loads the wrong thing or nothing",
"checkpoint files are trusted", "Ctrl-C saves nothing"), each a clear message and its exit code."""

import errno
import json
import os
import shutil
import signal
import warnings

import pytest
import torch

from bigtrain import checkpoint as ckpt
from bigtrain.checkpoint import commit
from bigtrain.checkpoint.resume import ResumeError
from bigtrain.cli import main
from bigtrain.metrics import read_metrics
from bigtrain.preemption import Preempted
from bigtrain.run_dir import read_run_id
from bigtrain.testing import RankFailure, run_ranks
from bigtrain.train import Trainer
from helpers import run_steps, tiny_config, trainer_on_rank


def _args(cache, out, *extra):
    return ["train", "--preset", "tiny", "--output-dir", str(out), "--logging.progress=false",
            "--logging.report=false", f"--data.cache_dir={cache}", "--data.max_bytes=400000",
            "--logging.log_every=1", *extra]


def _resume(out, *extra):
    return ["train", "--output-dir", str(out), "--resume", *extra]


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def straight(corpus_cache, tmp_path_factory):
    """Six steps without interruption, saving every 2: the curve every resume must continue."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(_args(corpus_cache, out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3")) == 0
    return out


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


# -- resume reads the run's own config; what it cannot serve is refused before launch --------------
def test_resume_reads_the_run_directorys_own_config(straight, tmp_path, capsys):
    out = _copy(straight, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # the run "died" after its step-4 save
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 7, "lo')  # torn line
    assert main(_resume(out)) == 0  # no --preset: tiny's shapes come from out/config.toml
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))  # truncated at 4, not emptied or doubled
    assert _losses(out) == _losses(straight)
    assert "is not a whole metrics record" in capsys.readouterr().err
    assert main(["report", str(out)]) == 0


def test_resume_with_a_preset_goes_on_with_the_preset_and_says_what_it_changes_of_the_runs_own(tmp_path, capsys):
    """``--resume --preset X`` takes X's settings, as torchtitan, accelerate and Hugging Face's Trainer
    resume with the config on the command line (a job script repeating its first command with
    --resume must run): said once, naming the fields X changes of the run's config.toml and how to
    keep them; what the command line sets itself was asked for and is not named. It was about ten
    per-field warnings (compat.py's, the schedule and data only) that never named --preset."""
    from bigtrain.config import load_config, to_toml

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # nothing saved: refused after the warnings, nothing trains
    own = load_config(preset="tiny", overrides=["--optim.lr=0.01", "--train.seed=7", "--checkpoint.every=2"])
    (run / "config.toml").write_text(to_toml(own))
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), "--resume", "--train.steps=9",
                 "--train.seed=7"]) == 2
    err = capsys.readouterr().err
    notice = next(line for line in err.splitlines() if "--resume with --preset tiny" in line)
    assert f"not with {run / 'config.toml'}" in notice and "leave out --preset" in notice
    assert "optim.lr 0.01 -> 0.003" in notice and "checkpoint.every 2 -> 0" in notice
    assert "train.seed" not in notice and "train.steps" not in notice  # given on the command line
    for same in (["--config", str(run / "config.toml")], []):  # the run's own settings: nothing to say
        assert main(["train", *same, "--output-dir", str(run), "--resume", "--train.steps=9"]) == 2
        assert "--resume with" not in capsys.readouterr().err


def test_resume_warns_for_each_override_that_changes_the_schedule(straight, tmp_path, capsys):
    out = _copy(straight, tmp_path)
    assert main(_resume(out, "--train.steps=8", "--optim.lr=1e-3", "--parallel.zero=1")) == 0
    err = capsys.readouterr().err
    assert "train.steps = 8 differs from the checkpoint's 6: this changes the learning-rate schedule" in err
    assert "optim.lr = 0.001 differs" in err
    assert not [line for line in err.splitlines() if "resuming" in line and "parallel.zero" in line]  # layouts are free
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))


def test_resuming_on_a_corpus_that_changed_under_the_same_source_says_so(corpus_cache, tmp_path, capsys):
    """Documents added to a corpus (the same data.source) move the held-out slice: the run trains on
    other data from there, possibly on tokens its earlier evaluations held out. Said on resume."""
    import numpy as np

    ids, out = tmp_path / "ids.npy", tmp_path / "run"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16))
    assert main(_args(corpus_cache, out, "--train.steps=2", f"--data.source={ids}", "--data.val_fraction=0.1")) == 0
    assert main(_resume(out, "--train.steps=3")) == 0
    assert "the corpus changed" not in capsys.readouterr().err  # the same corpus: nothing to say
    np.save(ids, np.random.default_rng(1).integers(0, 256, 6000).astype(np.uint16))
    assert main(_resume(out, "--train.steps=4")) == 0
    assert (f"data.source = '{ids}' now gives 5,400 training and 600 held-out tokens, 3,600 and 400 when the "
            f"checkpoint was written: the corpus changed, so the run trains on other data from here") \
        in capsys.readouterr().err
    # Edited in place with as many tokens (or tokenized again by another tokenizer): said too.
    np.save(ids, np.random.default_rng(2).integers(0, 256, 6000).astype(np.uint16))
    assert main(_resume(out, "--train.steps=5")) == 0
    assert (f"data.source = '{ids}' holds as many tokens as when the checkpoint was written, but other ones "
            f"(edited in place, or tokenized again otherwise): the corpus changed") in capsys.readouterr().err


def test_a_checkpoint_of_another_model_is_refused_naming_the_fields(straight, tmp_path, capsys, corpus_cache):
    out = _copy(straight, tmp_path)
    assert main(_resume(out, "--model.n_layers=1", "--model.dim=32")) == 2
    err = capsys.readouterr().err
    assert "model.n_layers = 1, but the checkpoint step_00000006 was written with model.n_layers = 2" in err
    assert ("model.dim = 32, but the checkpoint step_00000006 was written with model.dim = 64 (and so "
            "model.ffn_hidden 192 -> 128, model.attention_head_dim 16 -> 8)") in err
    assert "model.ffn_hidden = " not in err  # computed from model.dim: not a field the user set
    cfg = tiny_config(corpus_cache, "--model.n_layers=3", "--checkpoint.resume=auto")  # the Python API too
    with pytest.raises(ResumeError, match="model.n_layers = 3, but"):
        trainer_on_rank(0, 1, cfg, str(out)).fit()


def test_a_refused_resume_names_the_fields_the_user_changed_and_shows_computed_sizes_as_following():
    """tiny's model.ffn_hidden and model.attention_head_dim are 0 (computed from model.dim and
    n_heads): a resume with another model.dim listed them as if the user had set them. A size
    computed from a changed field follows it (through MoE's sizes too); one the user set is its own line."""
    from bigtrain.checkpoint.compat import compare_configs

    saved = tiny_config("").to_dict()
    errors, _ = compare_configs(saved, tiny_config("", "--model.dim=128"), "step_6")
    assert errors[:-1] == ["model.dim = 128, but the checkpoint step_6 was written with model.dim = 64 (and so "
                           "model.ffn_hidden 192 -> 384, model.attention_head_dim 16 -> 32)"]
    errors, _ = compare_configs(saved, tiny_config("", "--model.dim=128", "--model.ffn_hidden=352"), "step_6")
    assert errors[:-1] == ["model.dim = 128, but the checkpoint step_6 was written with model.dim = 64 (and so "
                           "model.attention_head_dim 16 -> 32)",
                           "model.ffn_hidden = 352, but the checkpoint step_6 was written with model.ffn_hidden = 192"]
    errors, _ = compare_configs(saved, tiny_config("", "--model.n_heads=2"), "step_6")
    assert errors[:-1] == ["model.n_heads = 2, but the checkpoint step_6 was written with model.n_heads = 4 (and so "
                           "model.attention_head_dim 16 -> 32)"]
    moe = ("--model.moe_experts=4", "--model.moe_shared_expert=true")
    errors, _ = compare_configs(tiny_config("", *moe).to_dict(), tiny_config("", *moe, "--model.dim=128"), "s")
    assert errors[:-1] == ["model.dim = 128, but the checkpoint s was written with model.dim = 64 (and so "
                           "model.ffn_hidden 192 -> 384, model.attention_head_dim 16 -> 32, model.moe_ffn_hidden "
                           "192 -> 384, model.moe_shared_expert_hidden 192 -> 384)"]


def test_a_checkpoint_of_another_optimizer_is_refused_before_launch(straight, tmp_path, capsys):
    """Its state cannot serve the run's optimizer: the ranks refused it (exit 1, each rank printing
    the line, under torchrun its failure report too) after the launch; now before it, as another
    model is, with the folder as it was."""
    out = _copy(straight, tmp_path)
    before = (out / "metrics.jsonl").read_text()
    assert main(_resume(out, "--optim.name=lion", "--train.steps=8")) == 2
    err = capsys.readouterr().err
    assert ("optim.name = 'lion', but the checkpoint step_00000006 holds adamw's optimizer state; resume with "
            "optim.name = 'adamw'") in err
    assert (out / "metrics.jsonl").read_text() == before and 'name = "lion"' not in (out / "config.toml").read_text()


def test_every_model_data_train_optim_and_embedding_field_is_compared_or_free_by_name():
    """A field a resumed run may change without a word must be listed free, with why: val_fraction
    (the corpus the sampler draws from), Adafactor's settings, the routing of MoE tokens and the
    tables' optimizer changed on resume without a warning."""
    from bigtrain.checkpoint.compat import CHANGES, EXPERT_FIELDS, FREE_FIELDS, SHAPE_FIELDS, compare_configs
    from bigtrain.config import Config

    fields = {f"{section}.{name}" for section, values in Config().to_dict().items()
              if section in ("model", "data", "train", "optim", "embedding") for name in values}
    kinds = [set(SHAPE_FIELDS), set(EXPERT_FIELDS), set(CHANGES), set(FREE_FIELDS)]
    assert fields == set().union(*kinds), sorted(fields ^ set().union(*kinds))
    assert sum(len(kind) for kind in kinds) == len(fields), "a field in two kinds"
    saved = tiny_config("", "--data.val_fraction=0.1").to_dict()
    _, changes = compare_configs(saved, tiny_config("", "--data.val_fraction=0.2"), "step_6")
    assert changes == ["data.val_fraction = 0.2 differs from the checkpoint's 0.1: this changes the training part "
                       "and the held-out slice (a smaller one trains on tokens earlier evaluations held out; "
                       "eval_loss before and after differ) and the order of the data from here on"]


def test_resume_of_a_folder_without_a_run_exits_2_and_creates_nothing(tmp_path, capsys):
    assert main(_resume(tmp_path / "typo")) == 2
    assert "holds no bigtrain run" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_explicit_resume_with_nothing_valid_exits_2(straight, tmp_path, capsys):
    out = _copy(straight, tmp_path)
    for path in ckpt.list_checkpoints(out / "checkpoints"):
        meta = json.loads((path / "meta.json").read_text())
        meta["step"] += 1  # edited: the manifest's own checksum no longer matches
        (path / "meta.json").write_text(json.dumps(meta))
    before = (out / "metrics.jsonl").read_text()
    assert main(_resume(out)) == 2
    err = capsys.readouterr().err
    assert "--resume: nothing valid to resume from" in err and "was modified after it was written" in err
    assert (out / "metrics.jsonl").read_text() == before  # nothing lost


def test_a_second_run_in_the_same_directory_is_refused_without_overwrite(straight, tmp_path, capsys, corpus_cache):
    out = _copy(straight, tmp_path)
    old_id = read_run_id(out)
    assert main(_args(corpus_cache, out, "--train.steps=2", "--train.seed=7")) == 2
    assert "holds a run (run id" in capsys.readouterr().err
    assert read_run_id(out) == old_id and len(ckpt.list_checkpoints(out / "checkpoints")) == 3
    assert main(_args(corpus_cache, out, "--train.steps=2", "--train.seed=7", "--overwrite")) == 0
    assert read_run_id(out) != old_id
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000002"]
    meta = json.loads((out / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["run_id"] == read_run_id(out)


@pytest.mark.parametrize("inside", ["checkpoints/step_00000004", "checkpoints"])
def test_overwrite_never_removes_the_checkpoint_the_run_starts_from(inside, straight, tmp_path, capsys, corpus_cache):
    """--overwrite with checkpoint.resume naming a checkpoint of the run it replaces: it removed every
    checkpoint (that one too), config.toml and metrics, then stopped: 'no such checkpoint' (exit 2)."""
    out = _copy(straight, tmp_path)
    before = sorted(p.name for p in out.iterdir())
    assert main(_args(corpus_cache, out, "--train.steps=6", f"--checkpoint.resume={out / inside}",
                      "--overwrite")) == 2
    err = capsys.readouterr().err
    assert "--overwrite removes" in err and "leave out --overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == before and len(ckpt.list_checkpoints(out / "checkpoints")) == 3
    assert main(_args(corpus_cache, out, "--train.steps=6", f"--checkpoint.resume={out / inside}")) == 0
    assert _losses(out) == _losses(straight)  # the fix the message gives: the run goes on from it


def test_a_restarted_rank_command_continues_the_same_run(straight, tmp_path):
    """What torchrun re-runs after a restart: the run's own config, resume 'auto'; accepted."""
    out = _copy(straight, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step_00000006")
    argv = ["train", "--config", str(out / "config.toml"), "--output-dir", str(out)]
    assert main(argv) == 2  # a fresh start from the same config would replace the run
    assert main(argv + ["--checkpoint.resume=auto"]) == 0
    assert _losses(out) == _losses(straight)


def test_checkpoints_of_another_run_are_not_resumed(straight, tmp_path, corpus_cache):
    out = _copy(straight, tmp_path)
    (out / "run.json").write_text(json.dumps({"run_id": "someone-else"}))
    cfg = tiny_config(corpus_cache, "--train.steps=6", "--checkpoint.resume=auto")
    with pytest.warns(UserWarning, match="written by another run"), \
            pytest.raises(ResumeError, match="holds no checkpoint that verifies"):
        trainer_on_rank(0, 1, cfg, str(out)).resume("auto")


def test_a_run_that_lost_its_run_json_keeps_the_id_of_the_checkpoints_it_continues(straight, tmp_path,
                                                                                   corpus_cache):
    """A run folder without run.json (copied without it, or lost) resumed its checkpoints, then
    recorded a new run id: before its first save, its next resume (a crash, a launcher's restart)
    skipped every checkpoint as another run's and had nothing to resume from."""
    out = _copy(straight, tmp_path)
    saved_by = read_run_id(out)
    (out / "run.json").unlink()
    cfg = tiny_config(corpus_cache, "--train.steps=6", "--checkpoint.resume=auto", "--checkpoint.save_final=false")
    first = trainer_on_rank(0, 1, cfg, str(out))
    first.fit()  # resumes step 6 of 6: nothing to train, nothing saved
    assert read_run_id(out) == saved_by
    again = trainer_on_rank(0, 1, cfg, str(out))
    assert again.resume("auto") and again.step == 6


# -- ranks agree on the step they resume at -------------------------------------------------------
def _resume_from_own_dir(rank, world_size, cfg, dirs):
    trainer = trainer_on_rank(rank, world_size, cfg, dirs[rank])
    return trainer.resume("auto")


def test_ranks_that_see_different_checkpoints_stop_naming_them(corpus_cache, tmp_path):
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]  # no shared filesystem
    for steps, run_dir in zip((4, 2), dirs):
        trainer = trainer_on_rank(0, 1, tiny_config(corpus_cache), run_dir)
        run_steps(trainer, steps)
        trainer.save()
    with pytest.raises(RankFailure, match=r"different checkpoints to resume from \(rank 0: step 4, rank 1: step 2\)"):
        run_ranks(_resume_from_own_dir, 2, tiny_config(corpus_cache, "--parallel.dp=2"), dirs)


# -- the manifest is not trusted ------------------------------------------------------------------
def _resign(path):
    """Rewrite a checkpoint's manifest so that it verifies again (a writer that got it wrong)."""
    meta = json.loads((path / "meta.json").read_text())
    meta["sha256"] = {n: commit._sha256(path / n) for n in meta["sha256"]}
    meta["manifest_sha256"] = commit._manifest_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def saved(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        ckpt.save_checkpoint(root, step, {"model.pt": {"w": torch.full((2,), float(step))}}, {}, keep=5)
    return root


def _tamper(path, change):
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    meta["manifest_sha256"] = commit._manifest_digest(meta)  # even with a recomputed checksum
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update(step=7), "says step 7 but the folder is step 2"),
    (lambda m: m.pop("sha256"), "lists no file checksums"),
    (lambda m: m["sha256"].update({"/dev/zero": "0" * 64}), "'/dev/zero', which is not a checkpoint file"),
    (lambda m: m["sha256"].update({"../step_00000001/model.pt": "0" * 64}), "not a checkpoint file's name"),
], ids=["edited-step", "no-checksum-map", "dev-zero", "dot-dot"])
def test_a_tampered_manifest_is_corrupt(saved, change, message):
    newest = saved / "step_00000002"
    _tamper(newest, change)
    with pytest.raises(ckpt.CorruptCheckpoint, match=message):
        ckpt.verify_checkpoint(newest)
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        assert ckpt.newest_valid_checkpoint(saved)[0].name == "step_00000001"


def test_an_edited_manifest_fails_its_own_checksum(saved):
    newest = saved / "step_00000002"
    meta = json.loads((newest / "meta.json").read_text())
    meta["step"] = 3
    (newest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CorruptCheckpoint, match="modified after it was written"):
        ckpt.verify_checkpoint(newest)


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "meta-fifo"])
def test_special_files_are_never_opened(saved, kind):
    newest = saved / "step_00000002"
    def hung(signum, frame):
        raise TimeoutError(f"{kind}: verification hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)  # a blocked open or an endless read would hang here
    try:
        if kind == "meta-fifo":
            (newest / "meta.json").unlink()
            os.mkfifo(newest / "meta.json")
        else:
            (newest / "model.pt").unlink()
            os.mkfifo(newest / "model.pt") if kind == "fifo" else os.symlink("/dev/zero", newest / "model.pt")
        with pytest.raises(ckpt.CorruptCheckpoint, match="not a regular file|cannot be opened as a plain file"):
            ckpt.verify_checkpoint(newest)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_stray_folders_are_ignored_by_listing_and_rotation(saved):
    for name in ("step_latest", "step_", "step_12abc", "steps_00000009"):
        (saved / name).mkdir()
    (saved / "step_00000099").write_text("a file, not a checkpoint")
    for step in (3, 4):
        ckpt.save_checkpoint(saved, step, {"model.pt": {"w": torch.zeros(1)}}, {}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(saved)] == ["step_00000004", "step_00000003"]
    assert (saved / "step_latest").is_dir() and (saved / "step_00000099").is_file()


# -- a trainer's resume falls back, cleans up, and survives a full disk ----------------------------
def test_a_checkpoint_that_verifies_but_fails_to_load_falls_back(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--checkpoint.keep=3")
    trainer = trainer_on_rank(0, 1, cfg, tmp_path)
    for _ in range(2):
        run_steps(trainer, 2)
        trainer.save()
    newest = ckpt.list_checkpoints(trainer.checkpoint_root)[0]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _resign(newest)
    ckpt.verify_checkpoint(newest)  # it verifies
    again = trainer_on_rank(0, 1, cfg, tmp_path)
    with pytest.warns(UserWarning, match="step_00000004 verifies but failed to load"):
        assert again.resume("auto") and again.step == 2
    # None loads: the files verify, so the message points at the settings, not at removing them.
    oldest = ckpt.list_checkpoints(trainer.checkpoint_root)[1]
    shard = next(oldest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _resign(oldest)
    with pytest.warns(UserWarning), pytest.raises(ResumeError) as err:
        trainer_on_rank(0, 1, cfg, tmp_path).resume("auto")
    assert "their files verify, so this run's settings" in str(err.value)
    assert "remove them only to start afresh" in str(err.value)


def _fall_back_when_rank_1_cannot_load(rank, world_size, cfg, run_dir):
    from bigtrain.checkpoint.sharded import ChunkReader

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    for _ in range(2):
        run_steps(trainer, 2)
        trainer.save()
    original = ChunkReader.read

    def read(self, requests):
        if rank == 1 and self.path.name == "step_00000004":
            raise OSError(errno.EIO, "Input/output error")
        return original(self, requests)

    ChunkReader.read = read  # this forked rank's copy only
    again = trainer_on_rank(rank, world_size, cfg, run_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert again.resume("auto")
    return again.step, [str(w.message) for w in caught if "failed to load" in str(w.message)]


def test_a_load_that_fails_on_one_rank_falls_back_on_every_rank(corpus_cache, tmp_path):
    """ZeRO-1: a load ends with a gather of the loaded masters; the rank that failed joins it."""
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=1", "--checkpoint.keep=3")
    (step0, warned0), (step1, warned1) = run_ranks(_fall_back_when_rank_1_cannot_load, 2, cfg, str(tmp_path))
    assert step0 == step1 == 2
    assert "on another rank" in warned0[0] and "Input/output error" in warned1[0]


def test_non_finite_state_is_never_saved(corpus_cache, tmp_path, capsys):
    trainer = trainer_on_rank(0, 1, tiny_config(corpus_cache), tmp_path)
    run_steps(trainer, 1)
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("inf")
    assert not trainer.save()
    assert "not saving a checkpoint: the weights or optimizer state are not finite" in capsys.readouterr().out
    assert ckpt.list_checkpoints(trainer.checkpoint_root) == []


def test_a_stray_folder_and_leftover_temporaries_do_not_stop_a_fresh_run(corpus_cache, tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_latest", "step_00000001.tmp", "step_00000005.tmp-4242"):
        (root / name).mkdir(parents=True)
        (root / name / "junk").write_bytes(b"x" * 100)
    trainer_on_rank(0, 1, tiny_config(corpus_cache, "--train.steps=2", "--checkpoint.every=1"), tmp_path).fit()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002", "step_latest"]


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(corpus_cache, tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint.filesystem as dcp_files

    original = dcp_files._write_item

    def full_disk(transforms, stream, data, write_item, *args):
        if "step_00000004" in getattr(stream, "name", ""):
            stream.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(transforms, stream, data, write_item, *args)

    monkeypatch.setattr(dcp_files, "_write_item", full_disk)
    out = tmp_path / "run"
    assert main(_args(corpus_cache, out, "--train.steps=6", "--checkpoint.every=2")) == 1
    err = capsys.readouterr().err
    assert "checkpoint step 4: no space left on device" in err and "step_00000002 is intact" in err
    assert os.listdir(out / "checkpoints") == ["step_00000002"]  # the partial save is gone
    ckpt.verify_checkpoint(out / "checkpoints" / "step_00000002")


def _save_twice(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 1)
    trainer.save()
    run_steps(trainer, 1)
    try:
        trainer.save()
    except ckpt.CheckpointWriteError as e:
        return str(e)
    return None


def test_a_full_disk_on_one_rank_stops_every_rank(corpus_cache, tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    original = dcp_files._write_item

    def full_disk_on_rank_1(transforms, stream, data, write_item, *args):
        name = getattr(stream, "name", "")
        if "step_00000002" in name and os.path.basename(name).startswith("__1_"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(transforms, stream, data, write_item, *args)

    monkeypatch.setattr(dcp_files, "_write_item", full_disk_on_rank_1)  # the forked ranks inherit it
    errors = run_ranks(_save_twice, 2, tiny_config(corpus_cache, "--parallel.dp=2"), str(tmp_path))
    for error in errors:
        assert "checkpoint step 2: no space left on device" in error and "step_00000001 is intact" in error
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000001"]


# -- SIGINT / SIGTERM save at the next step boundary -----------------------------------------------
def _signal_at(step, signum, only_rank=None):
    original = Trainer.train_step

    def train_step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if result.step == step and only_rank in (None, self.mesh.rank):
            os.kill(os.getpid(), signum)
        return result

    return train_step


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_at_the_next_step_and_the_run_resumes(signum, straight, tmp_path, monkeypatch, capsys,
                                                            corpus_cache):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", _signal_at(2, signum))
        assert main(_args(corpus_cache, out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3")) \
            == 128 + signum
    err = capsys.readouterr().err
    assert f"stopped by {signal.Signals(signum).name} after step 3: saved checkpoint step_00000003" in err
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000003", "step_00000002"]
    assert main(_resume(out)) == 0
    assert _losses(out) == _losses(straight)


def _fit_signalled(rank, world_size, cfg, run_dir):
    Trainer.train_step = _signal_at(1, signal.SIGTERM, only_rank=1)  # this forked rank's copy only
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    try:
        trainer.fit()
    except Preempted as e:
        return e.exit_code, trainer.step
    return 0, trainer.step


def test_ranks_agree_to_stop_when_one_of_them_gets_the_signal(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--train.steps=6")
    assert run_ranks(_fit_signalled, 2, cfg, str(tmp_path)) == [(143, 2), (143, 2)]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]
