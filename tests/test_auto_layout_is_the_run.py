"""``bigtrain train --parallel auto``: the run launches the layout the planner printed, whatever the
config file said of the axes the planner chose to leave at 1 (cp, dp_replicate), and an axis set
on the command line that disagrees with the planned world is refused before any rank starts."""

from pathlib import Path

import pytest

import bigtrain

from bigtrain.config import with_overrides
from bigtrain.plan.auto import auto_overrides
from bigtrain.plan.layout import Layout
from helpers import tiny_config


@pytest.mark.parametrize("axes", [{"cp": 2}, {"dp": 2, "dp_replicate": 2, "zero": 1}, {"dp": 2, "dp_replicate": 2, "dp_shard": 1, "zero": 1}])
def test_the_planned_layout_overrides_every_axis_the_config_set(axes, corpus_cache):
    cfg = tiny_config(corpus_cache, *(f"--parallel.{k}={v}" for k, v in axes.items()))
    chosen, why = auto_overrides(cfg, 2)
    run = with_overrides(cfg, chosen, "the planner's layout").parallel
    described = [part.split("=") for part in why.split(" ")[2].split(",") if "=" in part]  # Layout.describe
    planned = {k: v for k, v in described if k in ("dp", "tp", "pp", "sp", "cp", "dp_replicate")}
    assert run.world_size == 2, (why, run)
    assert {k: str(getattr(run, k)) for k in planned} == planned
    assert run.cp == int(planned.get("cp", 1)) and run.dp_replicate == int(planned.get("dp_replicate", 1))


def test_a_layout_without_cp_or_hsdp_still_names_them():
    overrides = Layout(dp=4, zero=1).to_overrides()
    assert {"--parallel.cp=1", "--parallel.dp_replicate=1", "--parallel.dp_shard=0"} <= set(overrides)


def _launches(monkeypatch, tmp_path, argv):
    import bigtrain.cli as cli
    import bigtrain.distributed.launch as launch

    started = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, run_dir, lock=None: started.append(1) or 0)
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv, **_: started.append(nproc) or 0)
    monkeypatch.setattr(launch, "init_distributed", lambda *a, **k: started.append("init"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return cli.main(argv), started


def test_a_config_files_cp_does_not_double_the_planned_world(corpus_cache, tmp_path, capsys, monkeypatch):
    config = tmp_path / "long.toml"
    config.write_text((Path(bigtrain.__file__).parent / "presets" / "tiny.toml").read_text() + "\n[parallel]\ncp = 2\n")
    code, started = _launches(monkeypatch, tmp_path, ["train", "--config", str(config), f"--data.cache_dir={corpus_cache}",
                                                      "--parallel", "auto", "--world-size", "2",
                                                      "--output-dir", str(tmp_path / "run")])
    assert code == 0 and started == [2], (started, capsys.readouterr())


def test_a_command_line_axis_against_the_planned_world_is_refused(corpus_cache, tmp_path, capsys, monkeypatch):
    code, started = _launches(monkeypatch, tmp_path, ["train", "--preset", "tiny", "--parallel.cp=2",
                                                      f"--data.cache_dir={corpus_cache}", "--parallel", "auto",
                                                      "--world-size", "2", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and started == [], started
    assert "world size 2 (--world-size) != parallel.dp x tp x pp x sp x cp" in err, err


def test_the_planner_prices_the_pipeline_cut_the_run_makes(corpus_cache, monkeypatch):
    """parallel.pp_split / pp_balance decide where the run cuts its stages; the search priced every
    cut as even. With pp_split = '1' (two stages) --parallel auto chose dp = 2, pp = 1, which the run
    then refused (1 stage needs 0 split points); with pp_balance = 'params' and a large embedding,
    3 stages of 6 blocks run 1/4/1 while the search priced 2/2/2."""
    from bigtrain.plan.fit import _layout, stage_split
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.layout import Cluster
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.model import ModelSpec
    from bigtrain.plan.search import search
    from bigtrain.validation import validate

    monkeypatch.setattr(bigtrain.plan.auto, "local_hardware", lambda: "cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = with_overrides(tiny_config(corpus_cache, "--model.n_layers=4"), ["--parallel.pp_split=1"], "the user")
    chosen, why = auto_overrides(cfg, 2)
    validate(with_overrides(cfg, chosen, "the planner's layout"))
    assert "pp=2" in why and "split=1" in why, why

    cfg = tiny_config(corpus_cache, "--model.n_layers=6", "--model.vocab_size=4096", "--parallel.pp_balance=params")
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    best = search(model, Cluster.build(3, get_profile("cpu")), cfg.train.global_batch,
                  fixed={"pp": 3, "precision": "fp32"}, precision="fp32",
                  split_of=lambda pp, v: stage_split(cfg, pp, v)).best
    assert best.layout.split == (1, 5)  # where the run cuts (the embedding and the output layer weigh 4 blocks)
    run = with_overrides(cfg, best.layout.to_overrides(), "the planner's layout")
    assert _layout(run).split == (1, 5)
    held = estimate_memory(model, _layout(run), get_profile("cpu"), cfg.train.global_batch)
    assert best.memory.total == held.total
