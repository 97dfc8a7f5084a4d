"""The model-family seam (bigtrain/families, issue 30): validation, preflight, the planner, check
and the CLI ask the family of ``model.family`` and never name one."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from bigtrain.config import ConfigError, load_config
from bigtrain.families import FAMILIES, family_of, registry
from bigtrain.validation import MODELS, validate

PACKAGE = Path(__file__).resolve().parents[1] / "bigtrain"


def test_the_dlrm_is_named_only_in_its_family_module():
    """``grep -rn '"dlrm"' bigtrain/`` finds it in bigtrain/families/dlrm.py only (the presets aside:
    configs name the family they describe; help texts quote it as 'dlrm'), and in the registry's
    table of the built-in families by name (imported when a config names one), there only."""
    found = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if '"dlrm"' in p.read_text())
    assert found == ["families/dlrm.py", "families/registry.py"], found
    in_registry = [line for line in (PACKAGE / "families/registry.py").read_text().splitlines() if '"dlrm"' in line]
    assert len(in_registry) == 1 and in_registry[0].startswith("BUILT_IN_NAMES"), in_registry


def test_model_names_are_the_registered_families():
    assert set(MODELS) == set(FAMILIES) == {"llama", "dlrm", "hf"}
    assert family_of(load_config(preset="dlrm-tiny")).name == "dlrm"
    with pytest.raises(ConfigError, match="model.family = 'gpt'.*'llama', 'dlrm', 'hf'"):
        validate(load_config(preset="tiny", overrides=["--model.family=gpt"]))


def test_model_name_is_read_as_model_family(tmp_path):
    """``model.name`` is the older spelling of ``model.family``: renamed on reading (from an override, a
    file or a checkpoint's manifest), so the config has one field and nothing reads a second one."""
    from bigtrain.checkpoint.compat import compare_configs
    from bigtrain.config import Config, ModelConfig

    assert "name" not in {f.name for f in fields(ModelConfig)}
    assert load_config(preset="tiny", overrides=["--model.name=dlrm"]).model.family == "dlrm"
    path = tmp_path / "old.toml"
    path.write_text('[model]\nname = "hf"\n')
    assert load_config(path=path).model.family == "hf"
    path.write_text('[model]\nname = "hf"\nfamily = "hf"\n')  # both, agreeing: one value
    assert load_config(path=path).model.family == "hf"
    # A manifest written before the rename: its model.name compares as model.family.
    old = Config().to_dict()
    old["model"]["name"] = old["model"].pop("family")
    assert compare_configs(old, Config(), "OLD") == ([], [])
    old["model"]["name"] = "dlrm"
    errors, _ = compare_configs(old, Config(), "OLD")
    assert errors and "model.family = 'llama', but the checkpoint OLD was written with model.family = 'dlrm'" in errors[0]


@pytest.mark.parametrize("where", ["file", "overrides"])
def test_model_name_and_family_in_conflict_are_refused_naming_both(tmp_path, where):
    if where == "file":
        path = tmp_path / "both.toml"
        path.write_text('[model]\nfamily = "llama"\nname = "dlrm"\n')
        kwargs = {"path": path}
    else:
        kwargs = {"preset": "tiny", "overrides": ["--model.family=llama", "--model.name=dlrm"]}
    with pytest.raises(ConfigError, match=r"model\.name = 'dlrm' and model\.family = 'llama' disagree.*"
                                          r"give model\.family only"):
        load_config(**kwargs)


@pytest.mark.parametrize("preset", ["tiny", "dlrm-tiny"])
def test_validation_runs_the_familys_own_rules(monkeypatch, preset):
    """The seam: a family's check_config is what validation asks (a rule skipped would pass here)."""
    cfg = load_config(preset=preset)
    family = family_of(cfg)
    monkeypatch.setitem(registry.FAMILIES, family.name,
                        replace(family, check_config=lambda c: ["model.family: the family's own rule ran"]))
    with pytest.raises(ConfigError, match="the family's own rule ran"):
        validate(cfg)


def test_the_familys_batch_rule_replaces_the_decoders():
    """A DLRM's global batch divides by dp alone; a decoder's by micro-batch x dp."""
    validate(load_config(preset="dlrm-tiny", overrides=["--train.micro_batch=3"]))  # not the decoder's rule
    with pytest.raises(ConfigError, match="train.micro_batch x parallel.dp"):
        validate(load_config(preset="tiny", overrides=["--train.global_batch=10", "--train.micro_batch=4"]))


def test_preflight_and_the_planner_ask_the_family(monkeypatch, tmp_path):
    from bigtrain.plan.cli import cmd_plan
    from bigtrain.preflight import preflight

    cfg = load_config(preset="dlrm-tiny")
    calls = []
    family = replace(family_of(cfg), size_problems=lambda c, *a, **k: (calls.append("size") or [], ["w"]),
                     plan_command=lambda c, gpus, as_json: calls.append(("plan", gpus)) or 0)
    monkeypatch.setitem(registry.FAMILIES, "dlrm", family)
    assert "w" in preflight(cfg, tmp_path)
    args = type("Args", (), {"preset": "dlrm-tiny", "config": None, "gpus": 3, "json": False, "global_batch": None})()
    assert cmd_plan(args) == 0
    assert calls == ["size", ("plan", 3)]
