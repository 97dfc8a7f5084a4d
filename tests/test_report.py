"""``report.md`` says which run it is and what it reached, and sets the planner's prediction beside
what was measured."""

import json

import pytest

from bigtrain.cli import main
from bigtrain.config import load_config
from bigtrain.metrics import read_metrics
from bigtrain.run_info import config_hash


@pytest.fixture(scope="module")
def run(corpus_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report") / "run"
    args = ["--preset", "tiny", f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000", "--train.steps=12",
            "--logging.log_every=5", "--train.eval_every=4", "--data.val_fraction=0.05", "--train.eval_batches=1",
            "--checkpoint.save_final=false", "--logging.progress=false"]
    assert main(["train", "--output-dir", str(run_dir), *args]) == 0
    return run_dir, load_config(path=run_dir / "config.toml")


def test_eval_loss_is_logged_and_reported(run, capsys):
    run_dir, _ = run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 8, 12]
    assert [r["step"] for r in records] == [1, 4, 5, 8, 10, 12]  # evaluated steps are logged
    report = (run_dir / "report.md").read_text()
    assert f"held-out loss {records[-1]['eval_loss']:.4f} (after step 12)" in report


def test_report_identifies_the_run(run):
    import torch

    run_dir, cfg = run
    report = (run_dir / "report.md").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"config {config_hash(cfg)}" in report and f"torch {torch.__version__}" in report
    assert "- layout: dp=1,tp=1,pp=1,sp=1,zero=0,mb=4" in report
    assert f"- model: {summary['model_params']:,} parameters" in report and summary["model_params"] > 100_000
    assert "- data: stdlib (380,000 training tokens, 20,000 held out)" in report
    assert f"- tokens seen: {12 * 8 * 32:,}; wall time " in report


def test_report_sets_prediction_beside_measurement(run):
    run_dir, _ = run
    report = (run_dir / "report.md").read_text()
    assert "## Predicted (planner, profile 'cpu') vs measured" in report
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in report.splitlines()
            if line.startswith("| ") and line.count("|") == 5}
    assert {"step time", "tokens/s", "memory: params", "memory: activations"} <= set(rows)
    # One rank: the planner's parameter and optimizer bytes are the trainer's, exactly.
    assert rows["memory: params"][2] == "1 |" and rows["memory: optimizer"][2] == "1 |"


def test_loss_plot_has_integer_step_ticks_and_the_eval_curve(run):
    run_dir, _ = run
    assert (run_dir / "loss.png").stat().st_size > 0  # drawn by plot_loss; the ticks below are what it sets
    import matplotlib

    matplotlib.use("Agg")
    from unittest import mock

    from bigtrain import report

    with mock.patch("matplotlib.pyplot.close"):
        import matplotlib.pyplot as plt

        report.plot_loss(read_metrics(run_dir), run_dir / "again.png")
        ax = plt.gcf().axes[0]
        assert [line.get_label() for line in ax.get_lines()] == ["training", "held-out"]
        assert all(float(t).is_integer() for t in ax.get_xticks())
        plt.close("all")


def test_plan_png_shows_speed_differences_and_memory_per_ranked_layout(tmp_path):
    from unittest import mock

    import matplotlib.pyplot as plt

    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.layout import Cluster
    from bigtrain.plan.model import ModelSpec
    from bigtrain.plan.report import write_png
    from bigtrain.plan.search import search

    cfg = load_config(preset="llama-7b")
    result = search(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len),
                    Cluster.build(4, get_profile("h100-80g")), cfg.train.global_batch)
    with mock.patch("matplotlib.pyplot.close"):
        write_png(tmp_path / "plan.png", result, top=6)
        _, speed, memory = plt.gcf().axes
        plt.close("all")
    speeds = [p.tokens_per_s for p in result.ranked[:6]]
    assert speed.get_xlim()[0] == 0 and speed.get_xlim()[1] >= max(speeds)  # from 0: bar lengths compare honestly
    assert "vs #1)" in speed.texts[0].get_text()
    totals = sorted(round(sum(b.get_width() for b in memory.patches if round(b.get_y() + b.get_height() / 2) == y), 3)
                    for y in range(6))
    expected = sorted(round(sum(p.memory.to_dict()[k] for k in ("params", "grads", "optimizer", "activations",
                                                                 "buffers", "allocator")) / 2**30, 3)
                      for p in result.ranked[:6])
    assert totals == expected


def test_a_recommender_run_writes_its_report(tmp_path):
    from bigtrain.cli import main

    out = tmp_path / "dlrm"
    assert main(["train", "--preset", "dlrm-tiny", "--output-dir", str(out), "--train.steps=4",
                 "--logging.log_every=2"]) == 0
    report = (out / "report.md").read_text()
    assert "- held-out AUC " in report and "samples/s" in report and (out / "loss.png").is_file()
    assert [line.split(" | ")[0] for line in report.splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")] \
        == ["| 2", "| 4"]


def test_a_recommender_report_when_its_last_logged_step_has_no_held_out_metrics(tmp_path):
    """A step the NaN policy skipped is logged without AUC: the report still reads as a click
    model's (samples/s, the held-out metrics of the steps that have them), where it once either
    fell to the decoder's report, which reads tokens/s, or raised on the missing AUC."""
    import json

    from bigtrain.report import write_report

    records = [{"step": 1, "loss": 0.7, "samples_per_s": 900.0, "auc": 0.51, "log_loss": 0.69},
               {"step": 2, "loss": 0.6, "samples_per_s": 1000.0, "auc": 0.55, "log_loss": 0.66},
               {"step": 3, "loss": float("nan"), "samples_per_s": 1100.0, "skipped": True}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report(tmp_path).read_text()
    assert "- held-out AUC 0.5100 -> 0.5500; log loss 0.6900 -> 0.6600 (after step 2)" in report
    assert "| 3 | nan | - | - | 1,100 |" in report and "tokens/s" not in report
