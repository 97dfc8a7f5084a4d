"""The config tree: presets, TOML files, dotted overrides, coercion, suggestions, TOML round trip, docs."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from bigtrain import cli
from bigtrain.config import (
    PRESET_DIR,
    Config,
    ConfigError,
    field_docs,
    load_config,
    parse_overrides,
    preset_names,
    to_toml,
)
from bigtrain.validation import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SHIPPED = ["llama-70b", "llama-7b", "small", "tiny"]


def _all_dotted_fields() -> set[str]:
    cfg = Config()  # an instance: the annotations are strings under `from __future__ import annotations`
    return {f"{s.name}.{f.name}" for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))}


def _write(tmp_path, text: str, name: str = "run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- presets


def test_preset_names_lists_the_toml_files_sorted():
    names = preset_names()
    assert names == sorted(p.stem for p in PRESET_DIR.glob("*.toml"))
    assert names == sorted(names)
    assert set(SHIPPED) <= set(names)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_validates_and_applies_its_values(name):
    cfg = load_config(preset=name)
    validate(cfg)
    with open(PRESET_DIR / f"{name}.toml", "rb") as f:
        raw = tomllib.load(f)
    assert raw, f"preset {name} sets nothing"
    for section, items in raw.items():
        for key, value in items.items():
            assert getattr(getattr(cfg, section), key) == value, f"{name}: {section}.{key}"


def test_preset_values_are_the_documented_ones():
    tiny = load_config(preset="tiny")
    assert (tiny.model.dim, tiny.model.n_layers, tiny.model.n_heads, tiny.model.n_kv_heads) == (64, 2, 4, 2)
    assert (tiny.data.seq_len, tiny.train.steps, tiny.train.global_batch, tiny.train.micro_batch) == (32, 20, 8, 4)
    # Fields the preset does not set keep the dataclass defaults.
    assert tiny.optim.beta2 == 0.95 and tiny.parallel.dp == 1 and tiny.data.source == "stdlib"
    big = load_config(preset="llama-70b")
    assert (big.model.dim, big.model.n_layers, big.model.kv_heads, big.model.ffn_dim) == (8192, 80, 8, 28672)


def test_unknown_preset_suggests_the_nearest():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiyn")
    assert len(e.value.problems) == 1
    assert "no preset 'tiyn'" in e.value.problems[0]
    assert "did you mean 'tiny'?" in e.value.problems[0]


# --------------------------------------------------------------------------- precedence


def test_file_beats_preset_and_override_beats_file(tmp_path):
    path = _write(tmp_path, "[train]\nsteps = 7\nseed = 99\n[model]\ndim = 32\n")
    cfg = load_config(preset="tiny", path=path)
    assert cfg.train.steps == 7  # file over preset (20)
    assert cfg.model.dim == 32  # file over preset (64)
    assert cfg.model.n_layers == 2  # preset, untouched by the file
    assert cfg.train.seed == 99  # file over default
    assert cfg.optim.beta1 == 0.9  # default, touched by nobody

    cfg = load_config(preset="tiny", path=path, overrides=["--train.steps=9", "model.n_layers=3"])
    assert cfg.train.steps == 9  # override over file
    assert cfg.model.n_layers == 3  # override over preset
    assert cfg.model.dim == 32  # file still applies
    assert cfg.train.seed == 99


def test_file_without_preset_starts_from_defaults(tmp_path):
    path = _write(tmp_path, "[train]\nsteps = 3\n")
    cfg = load_config(path=path)
    expected = Config()
    expected.train.steps = 3
    assert cfg.to_dict() == expected.to_dict()


def test_later_override_of_the_same_key_wins_and_dashes_mean_underscores():
    cfg = load_config(preset="tiny", overrides=["--train.steps=3", "--train.steps=4", "--train.global-batch=16"])
    assert cfg.train.steps == 4
    assert cfg.train.global_batch == 16


def test_parse_overrides_shape():
    assert parse_overrides(["--parallel.dp=2", "train.steps=5", "--data.source=a=b.txt"]) == {
        "parallel": {"dp": "2"}, "train": {"steps": "5"}, "data": {"source": "a=b.txt"}}


@pytest.mark.parametrize("arg", ["--parallel.dp", "--steps=5", "parallel"])
def test_malformed_override_says_how_to_write_it(arg):
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=[arg])
    assert e.value.problems == [f"override '{arg}': write it as --section.key=value (e.g. --parallel.dp=2)"]


def test_missing_and_invalid_toml_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' does not exist"):
        load_config(path=tmp_path / "nope.toml")
    bad = _write(tmp_path, "[train\nsteps = 3\n", "bad.toml")
    with pytest.raises(ConfigError, match=r"config file '.*bad\.toml' is not valid TOML"):
        load_config(path=bad)


def test_config_path_that_is_a_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file"):
        load_config(path=tmp_path)


def test_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"# caf\xe9\n[train]\nsteps = 3\n")
    with pytest.raises(ConfigError, match="latin1.toml"):
        load_config(path=path)


# --------------------------------------------------------------------------- coercion


def test_command_line_strings_are_coerced_to_field_types():
    cfg = load_config(preset="tiny", overrides=[
        "--parallel.dp=2", "--logging.progress=true", "--logging.report=false", "--checkpoint.save_final=0",
        "--logging.measure_memory=ON", "--optim.lr=1e-3", "--optim.grad_clip=2", "--data.source=corpus.txt",
        "--train.seed= 42 "])
    assert cfg.parallel.dp == 2 and type(cfg.parallel.dp) is int
    assert cfg.logging.progress is True
    assert cfg.logging.report is False
    assert cfg.checkpoint.save_final is False
    assert cfg.logging.measure_memory is True
    assert cfg.optim.lr == 0.001 and type(cfg.optim.lr) is float
    assert cfg.optim.grad_clip == 2.0 and type(cfg.optim.grad_clip) is float
    assert cfg.data.source == "corpus.txt"
    assert cfg.train.seed == 42


@pytest.mark.parametrize("arg, message", [
    ("--train.steps=abc", "train.steps: expected int, got 'abc'"),
    ("--train.steps=2.5", "train.steps: expected int, got '2.5'"),
    ("--train.steps=", "train.steps: expected int, got ''"),
    ("--optim.lr=fast", "optim.lr: expected float, got 'fast'"),
    ("--logging.progress=maybe", "logging.progress: expected bool, got 'maybe'"),
])
def test_bad_command_line_values_name_the_field(arg, message):
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=[arg])
    assert e.value.problems == [message]


def test_toml_values_are_coerced_or_rejected(tmp_path):
    good = _write(tmp_path, "[train]\nsteps = 3.0\n[optim]\nlr = 1\n[model]\ndim = \"96\"\n", "good.toml")
    cfg = load_config(path=good)
    assert cfg.train.steps == 3 and type(cfg.train.steps) is int
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.model.dim == 96

    bad = _write(tmp_path, "[train]\nsteps = 3.5\n[model]\ndim = true\n[checkpoint]\nsave_final = 1\n"
                           "[data]\nsource = 5\n", "bad.toml")
    with pytest.raises(ConfigError) as e:
        load_config(path=bad)
    assert e.value.problems == [
        "train.steps: expected int, got 3.5",
        "model.dim: expected int, got True",
        "checkpoint.save_final: expected bool, got 1",
        "data.source: expected str, got 5",
    ]


# --------------------------------------------------------------------------- unknown names


def test_unknown_section_suggests_the_nearest():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=["--paralel.dp=2"])
    assert e.value.problems == ["command line: unknown section [paralel]; did you mean 'parallel'?"]


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=["--train.stepz=5"])
    assert e.value.problems == ["command line: unknown key 'train.stepz'; did you mean 'steps'?"]


@pytest.mark.parametrize("given, meant", [
    ("train.max_steps", "'train.steps'"),  # was "did you mean 'max_bad_steps'?"
    ("optim.learning_rate", "'optim.lr'"),  # was every optim field
    ("train.seq_len", "'data.seq_len'"),  # a field of another section
    ("train.seqlen", "'data.seq_len'"),  # close to another section's field: not 'seed'
    ("model.hidden_size", "'model.dim'"),
    ("parallel.zero_stage", "'parallel.zero'"),
    ("train.batch_size", "'train.global_batch' (sequences a step) or 'train.micro_batch'"),
    ("train.output_dir", "'--output-dir' (a flag of bigtrain train, not a field)"),
])
def test_an_unknown_key_is_answered_with_the_field_a_user_of_other_tools_meant(given, meant):
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=[f"--{given}=5"])
    assert e.value.problems == [f"command line: unknown key '{given}'; did you mean {meant}?"]


@pytest.mark.parametrize("line, said", [
    ("steps = 3", "'steps' is set outside any [section]; every field belongs to one; put it under [train] (train.steps)"),
    ("learning_rate = 1e-3", "'learning_rate' is set outside any [section]; every field belongs to one; did you "
                             "mean 'optim.lr'?"),
    ("xyzzy = 1", "'xyzzy' is set outside any [section]; every field belongs to one; `bigtrain fields` lists them "
                  "by section"),
])
def test_a_key_above_every_section_is_named_as_such(tmp_path, line, said):
    """'steps = 3' at the top of a file was answered "unknown section [steps]; valid: model, ..."."""
    path = _write(tmp_path, line + "\n[train]\nseed = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path=path)
    assert e.value.problems == [f"{path}: {said}"]


def test_other_tools_names_point_at_fields_that_exist():
    import re

    from bigtrain.config import OTHER_TOOLS_NAMES, _field_types, _section_types

    sections = _section_types()
    for name, meant in OTHER_TOOLS_NAMES.items():
        for dotted in re.findall(r"\b([a-z]+)\.([a-z_0-9]+)", meant):
            assert dotted[1] in _field_types(sections[dotted[0]]), (name, dotted)


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=["--precision.qqqqqq=1"])
    assert e.value.problems == ["command line: unknown key 'precision.qqqqqq'; valid: mode, reduce_dtype, loss_scale, "
                                "scale_growth_interval, scale_backoff, fp8, fp8_emulate"]


def test_unknown_names_in_a_file_name_the_file_and_all_problems(tmp_path):
    path = _write(tmp_path, "[optim]\nbeta_1 = 0.9\n[trian]\nsteps = 3\n[model]\ndim = \"x\"\n")
    with pytest.raises(ConfigError) as e:
        load_config(path=path)
    assert e.value.problems == [
        f"{path}: unknown key 'optim.beta_1'; did you mean 'beta1'?",
        f"{path}: unknown section [trian]; did you mean 'train'?",
        "model.dim: expected int, got 'x'",
    ]
    # str(e) lists each problem on its own line.
    assert str(e.value).splitlines() == [f"  - {p}" for p in e.value.problems]


def test_a_section_that_is_not_a_table(tmp_path):
    path = _write(tmp_path, "model = 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path=path)
    assert e.value.problems == [f"{path}: [model] must be a table of key = value"]


# --------------------------------------------------------------------------- to_toml


@pytest.mark.parametrize("name", preset_names())
def test_to_toml_round_trips_every_preset(tmp_path, name):
    cfg = load_config(preset=name)
    path = _write(tmp_path, to_toml(cfg), "resolved.toml")
    again = load_config(path=path)
    assert again.to_dict() == cfg.to_dict()
    assert again == cfg


def test_to_toml_round_trips_awkward_values(tmp_path):
    cfg = load_config(preset="tiny", overrides=[
        '--data.cache_dir=C:\\cache\\"quoted" dir\twith tab', "--data.source=/tmp/naïve corpus.txt",
        "--optim.eps=1e-12", "--optim.lr=123456789.125", "--model.rope_theta=500000", "--train.seed=0",
        "--logging.progress=false", "--parallel.bucket_mb=0.5"])
    text = to_toml(cfg)
    path = tmp_path / "resolved.toml"
    path.write_text(text, encoding="utf-8")
    again = load_config(path=path)
    assert again.to_dict() == cfg.to_dict()
    assert again.data.cache_dir == 'C:\\cache\\"quoted" dir\twith tab'
    assert again.optim.eps == 1e-12


def test_to_toml_writes_every_field_with_its_doc():
    text = to_toml(Config())
    lines = [line for line in text.splitlines() if line and not line.startswith("[")]
    assert len(lines) == len(_all_dotted_fields())
    assert "dp = 1  # Data-parallel degree." in text.splitlines()
    assert [line for line in text.splitlines() if line.startswith("[")] == [
        f"[{s.name}]" for s in dataclasses.fields(Config)]


def test_to_toml_round_trips_control_characters(tmp_path):
    cfg = load_config(preset="tiny", overrides=["--data.cache_dir=line one\nline two"])
    path = _write(tmp_path, to_toml(cfg), "resolved.toml")
    assert load_config(path=path).data.cache_dir == "line one\nline two"


def test_cli_config_command_prints_toml_that_round_trips(tmp_path, capsys):
    assert cli.main(["config", "--preset", "tiny", "--train.steps=3", "--parallel.bucket_mb=12.5"]) == 0
    out = capsys.readouterr().out
    path = _write(tmp_path, out, "printed.toml")
    expected = load_config(preset="tiny", overrides=["--train.steps=3", "--parallel.bucket_mb=12.5"])
    assert load_config(path=path).to_dict() == expected.to_dict()


# --------------------------------------------------------------------------- field_docs


def test_field_docs_cover_every_field_with_text():
    docs = field_docs()
    assert set(docs) == _all_dotted_fields()
    assert len(docs) == len(_all_dotted_fields()) > 40
    empty = [k for k, v in docs.items() if not v.strip()]
    assert empty == []
    assert docs["parallel.dp"] == "Data-parallel degree."
    assert docs["train.global_batch"].startswith("Sequences per optimizer step")


def test_cli_fields_command_lists_every_field(capsys):
    assert cli.main(["fields"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(field_docs())
