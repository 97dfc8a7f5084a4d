"""The DLRM trains through the Trainer every family shares (issue 30, "one trainer"): the NaN policy
(tests/test_nan_policy.py), SIGINT / SIGTERM at a step boundary and resume safety
(tests/test_resume_safety.py) that the decoder's runs pass, on a small DLRM (six tables of at most
64 rows, batch 16). Its own loop before had none of them: it updated the tables with a NaN
gradient, saved whatever the state, resumed checkpoints of another run, and appended to the
metrics of the steps it resumed over."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import bigtrain.recsys.train as recsys_train
from bigtrain import checkpoint as ckpt
from bigtrain.checkpoint.resume import ResumeError
from bigtrain.cli import main
from bigtrain.config import load_config
from bigtrain.metrics import log_line, read_metrics
from bigtrain.testing import RankFailure, run_ranks
from bigtrain.train import Trainer
from bigtrain.validation import validate
from tests.helpers import run_steps, trainer_on_rank
from tests.test_nan_policy import _NanGradient, _assert_stopped_with_last_finite_checkpoint
from tests.test_resume_safety import _fit_signalled, _resign, _resume_from_own_dir, _signal_at
from tests.test_run_ownership import ROOT, _env, _kill_all

SMALL = ["--embedding.tables=4x64,2x32", "--embedding.dim=8", "--embedding.hotness=2", "--train.global_batch=16",
         "--embedding.lr=0.1", "--optim.warmup_steps=2"]
MIX = "--embedding.sharding=table,row,column,data,table,row"  # every kind of piece, at dp=2


def small(*overrides: str, dp: int = 1):
    cfg = load_config(preset="dlrm-tiny", overrides=SMALL + [f"--parallel.dp={dp}", *overrides])
    validate(cfg)
    return cfg


def _args(out, *extra):
    return ["train", "--preset", "dlrm-tiny", "--output-dir", str(out), "--logging.progress=false",
            "--logging.report=false", "--logging.log_every=1", *SMALL, *extra]


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)]


def _faulty(fault: str, from_call: int = 0):
    """The DLRM step's loss, NaN (``loss``) or with NaN gradients (``grad``) from call ``from_call`` on."""
    original, calls = recsys_train.bce_loss_sum, []

    def loss(logits, labels):
        value = original(logits, labels)
        calls.append(1)
        if len(calls) <= from_call:
            return value
        return value + float("nan") if fault == "loss" else _NanGradient.apply(value)

    return loss


# -- the NaN policy ------------------------------------------------------------------------------
def _state(trainer):
    """(every weight, tables whole; the dense optimizer's state; this rank's tables' optimizer state)."""
    weights = trainer.parallel.full_weights()  # collective
    dense = trainer.engine.full_state()[1]["state"]
    tables = [t.clone() for t in trainer.parallel.embeddings.state_tensors()]
    return weights, dense, tables


def _unchanged(before, after) -> list[str]:
    changed = [n for n, w in before[0].items() if not torch.equal(after[0][n], w)]
    changed += [f"{n} {k}" for n, s in before[1].items() for k, v in s.items() if not torch.equal(after[1][n][k], v)]
    changed += [f"table state {i}" for i, (a, b) in enumerate(zip(before[2], after[2])) if not torch.equal(a, b)]
    return changed


def _skips_on_rank(rank, world, cfg, run_dir):
    trainer = trainer_on_rank(rank, world, cfg, run_dir)
    run_steps(trainer, 2)
    original, out = recsys_train.bce_loss_sum, []
    for fault in ("loss", "grad", "table"):
        before = _state(trainer)
        hook = None
        if rank == 0 and fault == "table":  # NaN gradients reach the tables alone (the MLPs' stay finite)
            hook = trainer.model.embeddings.register_forward_hook(
                lambda module, args, pooled: pooled.register_hook(lambda grad: grad * float("nan")) and None)
        elif rank == 0:  # one rank's fault: every rank must skip
            recsys_train.bce_loss_sum = _faulty(fault)
        result = trainer.train_step()
        recsys_train.bce_loss_sum = original
        if hook is not None:
            hook.remove()
        out.append((result.skipped, result.loss, result.grad_norm, _unchanged(before, _state(trainer))))
    before = _state(trainer)
    applied = trainer.train_step()
    moved = [n for n in _unchanged(before, _state(trainer)) if n.startswith("embeddings.")]
    return out, not applied.skipped and bool(moved), len(before[1]) and len(before[2])


def test_a_skipped_step_leaves_tables_dense_weights_and_optimizer_state_untouched_on_every_rank(tmp_path):
    """Fault on rank 0 alone (a NaN loss, NaN gradients everywhere, NaN gradients of the tables only):
    the tables (updated in backward before, whatever the step) and the dense part skip on both ranks."""
    results = run_ranks(_skips_on_rank, 2, small(MIX, dp=2), str(tmp_path), timeout=300)
    for faults, applied, compared in results:
        (loss_skipped, loss, _, loss_changed), (grad_skipped, _, norm, grad_changed), table = faults
        assert loss_skipped and grad_skipped and table[0], "a rank applied a bad step"
        assert not loss_changed and not grad_changed and not table[3], (loss_changed, grad_changed, table[3])
        assert not math.isfinite(loss) and not math.isfinite(norm)
        assert math.isfinite(table[1]) and math.isfinite(table[2])  # only the tables' gradients were bad
        assert applied and compared  # the next, clean step moves the tables; optimizer states were compared


def test_a_diverging_dlrm_run_stops_with_exit_3_and_keeps_the_last_finite_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(recsys_train, "bce_loss_sum", _faulty("loss", from_call=2))  # NaN from step 3 on
    code = main(_args(tmp_path, "--train.steps=20", "--checkpoint.every=1"))
    err = capsys.readouterr().err
    assert code == 3, err[-2000:]
    line = [text for text in err.splitlines() if "stopped at step" in text]
    assert len(line) == 1 and "train.max_bad_steps = 5" in line[0], err[-2000:]
    _assert_stopped_with_last_finite_checkpoint(tmp_path)
    assert json.loads((tmp_path / "stopped.json").read_text())["exit_code"] == 3


def test_a_dlrm_run_that_ends_on_bad_steps_exits_3(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(recsys_train, "bce_loss_sum", _faulty("grad", from_call=2))
    code = main(_args(tmp_path, "--train.steps=4", "--checkpoint.every=1"))
    err = capsys.readouterr().err
    assert code == 3 and "stopped at the end of the run" in err, err[-2000:]
    _assert_stopped_with_last_finite_checkpoint(tmp_path, max_bad=2)


def test_non_finite_dlrm_state_is_never_saved(tmp_path, capsys):
    trainer = trainer_on_rank(0, 1, small(), tmp_path)
    run_steps(trainer, 1)
    with torch.no_grad():
        trainer.parallel.embeddings.weight(0).view(-1)[0] = float("inf")
    assert not trainer.save()
    assert "not saving a checkpoint" in capsys.readouterr().out
    assert ckpt.list_checkpoints(trainer.checkpoint_root) == []


# -- signals: save at the next step boundary, every rank ---------------------------------------------
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Six steps without interruption, saving every 2: the curve every resume must continue."""
    out = tmp_path_factory.mktemp("dlrm-straight") / "run"
    assert main(_args(out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3")) == 0
    return out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_dlrm_at_the_next_step_and_the_run_resumes(signum, straight, tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", _signal_at(2, signum))
        assert main(_args(out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3")) == 128 + signum
    err = capsys.readouterr().err
    assert f"stopped by {signal.Signals(signum).name} after step 3: saved checkpoint step_00000003" in err
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000003", "step_00000002"]
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    assert _losses(out) == _losses(straight)  # bit for bit: the tables and their Adagrad state resumed


def test_dlrm_ranks_agree_to_stop_when_one_of_them_gets_the_signal(tmp_path):
    cfg = small(MIX, "--train.steps=6", dp=2)
    assert run_ranks(_fit_signalled, 2, cfg, str(tmp_path), timeout=300) == [(143, 2), (143, 2)]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_a_two_rank_dlrm_run_with_one_line(tmp_path):
    """As tests/test_run_ownership.py's decoder run: kill -TERM to bigtrain's pid alone; both ranks
    save the step they reached and stop, exit 143, one stop line and no traceback."""
    run, log = tmp_path / "run", tmp_path / "log"
    cmd = [sys.executable, "-m", "bigtrain", *_args(run, "--parallel.dp=2", MIX, "--train.steps=100000")]
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=out,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or (run / "metrics.jsonl").read_text().count("\n") < 2:
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(job.pid, signal.SIGTERM)
        code = job.wait(timeout=240)
    finally:
        if job.poll() is None:
            _kill_all(job)
    err = log.read_text()
    assert code == 143 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("bigtrain: stopped by SIGTERM")]
    assert len(lines) == 1 and "saved checkpoint" in lines[0], err[-3000:]
    stopped = json.loads((run / "stopped.json").read_text())
    assert json.loads((run / "checkpoints" / f"step_{stopped['step']:08d}" / "meta.json").read_text())["format"] \
        == "dcp-dlrm/1"


# -- resume safety ----------------------------------------------------------------------------------
def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_a_resumed_dlrm_run_rewinds_its_metrics_to_the_checkpoint(straight, tmp_path):
    out = _copy(straight, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # the run "died" after its step-4 save
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))  # steps 5 and 6 once, not twice
    assert _losses(out) == _losses(straight)


def test_a_dlrm_records_its_throughput_in_samples_and_claims_no_tokens(straight):
    """A click model's step counts samples: its records say samples_per_s and nothing holds samples
    under a tokens name (tokens_per_s once did, and the progress bar showed it as tok/s)."""
    records = read_metrics(straight)
    assert all(r["samples_per_s"] > 0 and "tokens_per_s" not in r for r in records)
    assert log_line(records[-1], 6, None).endswith(" samples/s") and "tok" not in log_line(records[-1], 6, None)


def test_summary_json_counts_the_samples_of_every_segment(straight, tmp_path):
    """A resume that changes train.global_batch (a warned change) trains its steps with the new
    batch: summary.json said step x the new batch for the whole run (8 x 32 here), not the segments'
    sum the report and the decoder's tokens_seen use (6 x 16 + 2 x 32)."""
    out = _copy(straight, tmp_path)
    assert main(["train", "--output-dir", str(out), "--resume", "--train.steps=8", "--train.global_batch=32"]) == 0
    assert json.loads((out / "summary.json").read_text())["samples_seen"] == 6 * 16 + 2 * 32
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()  # the segments' total, said as what it counts
    assert f"- samples seen: {6 * 16 + 2 * 32:,};" in report and "tokens seen" not in report


def test_a_fresh_dlrm_run_over_a_runs_checkpoints_is_refused(straight, tmp_path):
    out = _copy(straight, tmp_path)
    with pytest.raises(ResumeError, match="holds checkpoints of a run"):
        trainer_on_rank(0, 1, small("--train.steps=6"), str(out)).fit()


def test_dlrm_checkpoints_of_another_run_are_not_resumed(straight, tmp_path):
    out = _copy(straight, tmp_path)
    (out / "run.json").write_text(json.dumps({"run_id": "someone-else"}))
    with pytest.warns(UserWarning, match="written by another run"), \
            pytest.raises(ResumeError, match="holds no checkpoint that verifies"):
        trainer_on_rank(0, 1, small("--train.steps=6"), str(out)).resume("auto")


def test_dlrm_ranks_that_see_different_checkpoints_stop_naming_them(tmp_path):
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]  # no shared filesystem
    for steps, run_dir in zip((4, 2), dirs):
        trainer = trainer_on_rank(0, 1, small(), run_dir)
        run_steps(trainer, steps)
        trainer.save()
    with pytest.raises(RankFailure, match=r"different checkpoints to resume from \(rank 0: step 4, rank 1: step 2\)"):
        run_ranks(_resume_from_own_dir, 2, small(MIX, dp=2), dirs, timeout=300)


def test_a_dlrm_checkpoint_that_verifies_but_fails_to_load_falls_back(tmp_path):
    cfg = small("--checkpoint.keep=3")
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert again.resume("auto") and again.step == 2
    assert any("step_00000004 verifies but failed to load" in str(w.message) for w in caught)


def test_an_asynchronous_dlrm_save_resumes_as_the_synchronous_one(straight, tmp_path):
    """checkpoint.async: the tables' parts are snapshotted and written while training goes on."""
    out = tmp_path / "run"
    assert main(_args(out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3",
                      "--checkpoint.async=true")) == 0
    shutil.rmtree(out / "checkpoints" / "step_00000006")
    assert main(["train", "--output-dir", str(out), "--resume"]) == 0
    assert _losses(out) == _losses(straight)
