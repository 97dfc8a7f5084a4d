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


def test_the_commands_that_build_no_model_import_no_torch():
    """`bigtrain presets`, `fields` and `config` (of the decoder) paid about 2 s of CPU importing torch
    (the families' model modules, the data and checkpoint packages, the planner's parser); the
    suite and the README's shells start them often. The families are imported when a config names
    one, and their models when one is built. So did `bigtrain --help` and a bare `bigtrain` (3.3 s
    against 0.33), which list the commands by name and help line."""
    code = ("import contextlib, io, sys; from bigtrain.cli import main\n"
            "for argv in (['presets'], ['fields'], ['config', '--preset', 'small', '--parallel.dp=2']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out: assert main(argv) == 0, argv\n"
            "    assert out.getvalue(), argv\n"
            "for argv, code in ((['--help'], 0), (['-h'], 0), ([], 2)):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit as e: assert e.code == code, (argv, e.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[]\n", done.stdout


def test_the_top_level_help_is_the_full_parsers():
    """The light parser of `bigtrain --help` lists every command with the help line the full one has."""
    from bigtrain.cli import _parser

    assert _parser("--help").format_help() == _parser("").format_help() == _parser().format_help()


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
