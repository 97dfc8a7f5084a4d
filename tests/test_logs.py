"""What a run prints where no terminal reads it (a log file, CI): plain lines, one per logged step."""

import pytest

from bigtrain.cli import main
from bigtrain.metrics import log_line


def test_a_non_tty_run_of_300_steps_writes_plain_lines(corpus_cache, tmp_path, capsys):
    # capsys stands in for a pipe: stdout is not a terminal, so the default progress = true prints lines.
    assert main(["train", "--preset", "tiny", "--output-dir", str(tmp_path), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000", "--train.steps=300", "--logging.log_every=10",
                 "--model.n_layers=1", "--model.dim=32", "--data.seq_len=16", "--checkpoint.save_final=false"]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    lines = (out + err).splitlines()
    assert len(lines) <= 35, "\n".join(lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 31  # step 1, then every 10th
    assert steps[0].startswith("step 1/300 | loss ") and " tok/s | mem " in steps[0]
    assert "| eta " in steps[1]
    assert steps[-1].startswith("step 300/300 | loss ") and "eta" not in steps[-1]


def test_log_line_reads_well():
    record = {"step": 10, "loss": 3.21012, "tokens_per_s": 8723.4, "mem": {"params": 3 << 20, "grads": 0},
              "eval_loss": 3.5}
    assert log_line(record, 300, 65.2) == "step 10/300 | loss 3.2101 | eval 3.5000 | 8,723 tok/s | mem 3.0 MiB | eta 1m05s"
    assert log_line({**record, "mem": {}}, 300, None) == "step 10/300 | loss 3.2101 | eval 3.5000 | 8,723 tok/s"


def test_report_on_a_missing_or_empty_folder_fails(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nonexistent")]) == 1
    assert main(["report", str(tmp_path)]) == 1
    assert "not a folder" in capsys.readouterr().err


def _tiny_run(cache, out, *extra):
    return main(["train", "--preset", "tiny", "--output-dir", str(out), f"--data.cache_dir={cache}",
                 "--data.max_bytes=400000", "--train.steps=4", "--logging.log_every=2", "--logging.progress=false",
                 "--logging.report=false", "--checkpoint.save_final=false", *extra])


def test_tensorboard_scalars_go_through_torchs_writer(corpus_cache, tmp_path, monkeypatch):
    import sys
    import types

    written, closed = [], []

    class Writer:  # stands in for torch.utils.tensorboard.SummaryWriter (tensorboard is an optional extra)
        def __init__(self, log_dir, purge_step=None):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((self.log_dir, tag, value, step))

        def close(self):
            closed.append(True)

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    assert _tiny_run(corpus_cache, tmp_path, "--logging.tensorboard=true", "--data.val_fraction=0.05",
                     "--train.eval_every=4", "--train.eval_batches=1") == 0
    assert {w[0] for w in written} == {str(tmp_path / "tensorboard")} and closed == [True]
    losses = [(step, value) for _, tag, value, step in written if tag == "train/loss"]
    assert [s for s, _ in losses] == [1, 2, 4]  # logged steps, counted from 1
    assert [tag for _, tag, _, step in written if step == 4].count("eval/loss") == 1
    assert {"train/lr", "train/tokens_per_s", "memory/total_bytes"} <= {tag for _, tag, _, _ in written}


def test_a_resumed_run_purges_the_tensorboard_steps_it_trains_again(corpus_cache, tmp_path, monkeypatch):
    """metrics.jsonl drops the records past the checkpoint a run resumes from (a killed run's last
    steps, an abandoned timeline); the event files kept them, so TensorBoard drew two values for each
    step trained again. torch's writer purges them when told the step (``purge_step``): the first
    step the run trains."""
    import shutil
    import sys
    import types

    purged = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            purged.append(purge_step)

        def add_scalar(self, tag, value, step):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    assert _tiny_run(corpus_cache, tmp_path, "--logging.tensorboard=true", "--checkpoint.every=2") == 0
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")  # the run "died" after its step-2 save
    assert main(["train", "--output-dir", str(tmp_path), "--resume"]) == 0
    assert purged == [1, 3]  # a fresh run (a restart before any save leaves events too), then from step 3


def test_tensorboard_without_the_package_warns_and_trains(corpus_cache, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    assert _tiny_run(corpus_cache, tmp_path, "--logging.tensorboard=true") == 0
    assert "pip install tensorboard" in capsys.readouterr().err
    assert not (tmp_path / "tensorboard").exists()


def test_console_metrics_checkpoints_and_messages_count_steps_alike(corpus_cache, tmp_path, capsys, monkeypatch):
    """One numbering (docs/reliability.md): step k is the k-th update, in the console line, the
    metrics record, the checkpoint holding the state after it and the NaN policy's message."""
    import re

    from bigtrain.metrics import read_metrics
    from bigtrain.train import Trainer

    original = Trainer.train_step

    def nan_at_third_update(self, *args, **kwargs):  # the update that makes step_00000003
        if self.step != 2:
            return original(self, *args, **kwargs)
        clean = self.parallel.loss_sum
        self.parallel.loss_sum = lambda logits, targets: clean(logits, targets) + float("nan")
        try:
            return original(self, *args, **kwargs)
        finally:
            self.parallel.loss_sum = clean

    monkeypatch.setattr(Trainer, "train_step", nan_at_third_update)
    assert _tiny_run(corpus_cache, tmp_path, "--logging.log_every=1", "--checkpoint.every=2",
                     "--checkpoint.save_final=true") == 0
    out = capsys.readouterr().out
    console = [int(m) for m in re.findall(r"^step (\d+)/4 ", out, re.M)]
    records = read_metrics(tmp_path)
    assert console == [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["skipped"]] == [3]
    assert re.search(r"^bigtrain: step 3: the loss was nan", out, re.M), out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
