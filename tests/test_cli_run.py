"""End to end through the command line: one rank in-process, two ranks through torchrun."""

import json
import subprocess
import sys

import pytest

from bigtrain.cli import main
from bigtrain.metrics import read_metrics

SCHEMA = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem", "comm"}
MEM = {"params", "grads", "optimizer", "activations"}


def _args(cache, out, *extra):
    return ["train", "--preset", "tiny", "--output-dir", str(out), "--logging.progress=false",
            f"--data.cache_dir={cache}", "--data.max_bytes=400000", "--train.steps=6", "--logging.log_every=1",
            *extra]


def test_one_rank_run_writes_metrics_report_and_config(corpus_cache, tmp_path):
    assert main(_args(corpus_cache, tmp_path)) == 0
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert SCHEMA <= set(r) and MEM == set(r["mem"])
        assert r["mem"]["params"] > 0 and r["mem"]["activations"] > 0
    for name in ("config.toml", "report.md", "loss.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "dim = 64" in (tmp_path / "config.toml").read_text()


def test_cli_resume_continues_and_rewrites_the_log(corpus_cache, tmp_path, capsys):
    assert main(_args(corpus_cache, tmp_path / "straight")) == 0
    straight = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    assert main(_args(corpus_cache, tmp_path / "resumed", "--checkpoint.every=3")) == 0
    # Drop the last checkpoint as if the run had died after step 3.
    import shutil
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000006")
    capsys.readouterr()
    assert main(_args(corpus_cache, tmp_path / "resumed", "--checkpoint.every=3", "--resume")) == 0
    # said first: a resumed run had begun at 'step 4/6' without a word of where it came from
    out = capsys.readouterr().out
    assert out.startswith("bigtrain: resuming from step_00000003 (step 3 of 6)\n")
    # and its last line is this launch's: '6 steps, loss <step 4's> -> ...' read as the whole run's
    assert "bigtrain: steps 4-6 (resumed at step 3), loss " in out
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == straight


@pytest.mark.slow
def test_two_ranks_through_torchrun_match_one_rank(corpus_cache, tmp_path):
    assert main(_args(corpus_cache, tmp_path / "one")) == 0
    cmd = [sys.executable, "-m", "bigtrain", *_args(corpus_cache, tmp_path / "two", "--parallel.dp=2")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["comm"]["dp"] > 0 and a["comm"] == {}
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["mesh"]["dp"] == 2


def test_parallel_auto_plans_the_layout_before_launch(corpus_cache, tmp_path, capsys):
    assert main(_args(corpus_cache, tmp_path, "--train.steps=2") + ["--parallel", "auto", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "--parallel auto: dp=1," in out and "tokens/s" in out
    assert "[parallel]" in (tmp_path / "config.toml").read_text()


def test_plan_command_says_why_7b_does_not_fit_one_gpu(capsys):
    code = main(["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000", "--seq", "4096",
                 "--gpus", "1", "--hardware", "h100-80g"])
    out = capsys.readouterr().out
    assert code == 1 and "Nothing fits" in out and "18 bytes per parameter" in out


def test_parallel_auto_on_cpu_plans_ranks_that_share_the_host_cores(monkeypatch, tmp_path):
    """4 CPU ranks on 2 cores each get half a core: planned at a whole core each, they were
    predicted 2.8x faster than they ran. A calibrated profile is taken with --hardware-file."""
    from bigtrain.config import load_config
    from bigtrain.plan import auto, hardware
    from bigtrain.plan.hardware import get_profile, save_profile

    monkeypatch.setattr(auto, "local_hardware", lambda: "cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config(preset="small")
    predicted = {}
    for cores in (2, 8):
        monkeypatch.setattr(hardware, "usable_cores", lambda: cores)
        _, why = auto.auto_overrides(cfg, 4)
        predicted[cores] = float(why.split("predicted ")[1].split(" tokens/s")[0].replace(",", ""))
    assert predicted[2] < 0.65 * predicted[8]  # half a core per rank: compute at half speed
    faster = save_profile(get_profile("cpu").with_values(peak_flops_fp32=3.2e11, name="calibrated"),
                          tmp_path / "hw.json")
    _, why = auto.auto_overrides(cfg, 4, hardware_file=str(faster))
    assert "4 x calibrated" in why



def test_parallel_auto_plans_as_many_machines_as_the_launcher_started(monkeypatch):
    """Under torchrun on 2 machines of 4 ranks (LOCAL_WORLD_SIZE = 4) the plan was of one machine
    of 8 (the H100 profile's gpus_per_node): the same 6.6M tokens/s as 8 ranks on one machine, its
    gradient all-reduce priced at the bandwidth within a machine."""
    from bigtrain.config import load_config
    from bigtrain.plan import auto

    cfg = load_config(preset="small")
    why = {}
    for local in ("8", "4"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        why[local] = auto.auto_overrides(cfg, 8, hardware="h100-80g")[1]
    predicted = {k: float(v.split("predicted ")[1].split(" tokens/s")[0].replace(",", "")) for k, v in why.items()}
    assert "on 8 x h100-80g" in why["8"] and "on 2 machines of 4 x h100-80g" in why["4"], why
    assert predicted["4"] < 0.6 * predicted["8"], predicted
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # bigtrain's own launcher: every rank on this machine
    assert auto.ranks_per_machine(8) == 8

def test_hardware_file_without_parallel_auto_is_refused(capsys):
    assert main(["train", "--hardware-file", "hw.json", "--train.steps=1"]) == 2
    assert "--hardware-file is what --parallel auto plans with" in capsys.readouterr().err
