"""The names a script uses, at the package's top (bigtrain/__init__.py): each resolves to its
defining module's object, ``import bigtrain`` does not import torch (the CLI starts from it), and
the Trainer a script builds from its own config is held to the CLI's validation."""

import subprocess
import sys

import pytest

import bigtrain
from helpers import CORPUS_BYTES


def test_every_exported_name_is_its_modules_own():
    from bigtrain.config import load_config
    from bigtrain.train import Trainer

    assert bigtrain.Trainer is Trainer and bigtrain.load_config is load_config
    for name in bigtrain._EXPORTS:
        assert getattr(bigtrain, name) is getattr(sys.modules[bigtrain._EXPORTS[name]], name), name
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        bigtrain.Trainr  # noqa: B018


def test_importing_the_package_imports_no_torch():
    code = "import sys, bigtrain; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_scripts_trainer_validates_its_config_naming_each_field(tmp_path):
    cfg = bigtrain.load_config(preset="tiny", overrides=["--train.global_batch=3", "--model.n_heads=3"])
    with pytest.raises(bigtrain.ConfigError) as refused:
        bigtrain.Trainer(cfg, tmp_path, bigtrain.Mesh({}))
    message = str(refused.value)
    assert "model.n_heads = 3" in message and "train.global_batch = 3" in message
    assert not (tmp_path / "config.toml").exists()  # refused before anything was written
    two = bigtrain.load_config(preset="tiny", overrides=["--parallel.dp=2"])
    with pytest.raises(bigtrain.ConfigError, match=r"world size 1 \(the mesh\) != parallel.dp"):
        bigtrain.Trainer(two, tmp_path, bigtrain.Mesh({}))


def test_the_packages_example_trains(corpus_cache, tmp_path):
    cfg = bigtrain.load_config(preset="tiny", overrides=[
        "--train.steps=2", f"--data.cache_dir={corpus_cache}", f"--data.max_bytes={CORPUS_BYTES}",
        "--logging.progress=false", "--logging.report=false"])
    history = bigtrain.Trainer(cfg, tmp_path / "run", bigtrain.Mesh({})).fit()
    assert [r.step for r in history] == [0, 1] and (tmp_path / "run" / "metrics.jsonl").exists()
