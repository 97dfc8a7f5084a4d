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
    record = {"step": 9, "loss": 3.21012, "tokens_per_s": 8723.4, "mem": {"params": 3 << 20, "grads": 0},
              "eval_loss": 3.5}
    assert log_line(record, 300, 65.2) == "step 10/300 | loss 3.2101 | eval 3.5000 | 8,723 tok/s | mem 3.0 MiB | eta 1m05s"
    assert log_line({**record, "mem": {}}, 300, None) == "step 10/300 | loss 3.2101 | eval 3.5000 | 8,723 tok/s"


def test_report_on_a_missing_or_empty_folder_fails(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nonexistent")]) == 1
    assert main(["report", str(tmp_path)]) == 1
    assert "not a folder" in capsys.readouterr().err
