"""The typed configuration tree: TOML presets, dotted overrides, one validation pass.

A config is a tree of dataclasses. Every field carries its help text in ``metadata["doc"]``
so that the CLI, the docs and error messages all read from one place. Values come from a
preset (``bigtrain/presets/NAME.toml``), a user's TOML file, and ``--section.key=value``
overrides, in that order. :func:`validate` runs once, before any process starts, and
reports every problem it finds with the field's dotted name and a fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

# The sections live in config_sections.py. They are re-exported here on purpose: ``from bigtrain.config
# import ModelConfig, OptimConfig, ...`` is the public entry the README's examples/ and user scripts use
# (and every section is a field type of Config below).
from bigtrain.config_sections import (CheckpointConfig, CompileConfig, DataConfig, DistributedConfig,  # noqa: F401
                                      EmbeddingConfig, LoggingConfig, MemoryConfig, ModelConfig, OffloadConfig,
                                      OptimConfig, ParallelConfig, PrecisionConfig, TrainConfig)

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the field and the fix."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


@functools.cache  # the dataclasses' annotations never change; resolving them is most of applying a value
def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


@functools.cache
def _field_types(section_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _suggest(name: str, choices: list[str]) -> str:
    """"; did you mean 'pp'?", or every match as close as the best ('dpp': 'dp' or 'pp')."""
    close = difflib.get_close_matches(name, choices, n=len(choices))
    if not close:
        return f"; valid: {', '.join(choices)}"

    def score(choice: str) -> float:
        return difflib.SequenceMatcher(None, name, choice).ratio()

    best = [c for c in close if score(c) == score(close[0])]
    return "; did you mean " + " or ".join(f"'{c}'" for c in best) + "?"


# Names other tools give these fields (Hugging Face's TrainingArguments and config.json, Megatron,
# DeepSpeed, nanoGPT): `--train.max_steps` was answered "did you mean 'max_bad_steps'?", and
# `--optim.learning_rate` with a list of every optim field.
OTHER_TOOLS_NAMES: dict[str, str] = {
    "learning_rate": "optim.lr", "lr": "optim.lr", "max_lr": "optim.lr", "warmup": "optim.warmup_steps",
    "warmup_iters": "optim.warmup_steps", "max_grad_norm": "optim.grad_clip", "clip_grad": "optim.grad_clip",
    "gradient_clipping": "optim.grad_clip", "optimizer": "optim.name", "lr_scheduler_type": "optim.schedule",
    "lr_scheduler": "optim.schedule", "lr_decay_style": "optim.schedule", "decay_ratio": "optim.decay_fraction",
    "min_lr_rate": "optim.min_lr_ratio",
    "max_steps": "train.steps", "train_iters": "train.steps", "max_iters": "train.steps", "num_steps": "train.steps",
    "batch_size": "'train.global_batch' (sequences a step) or 'train.micro_batch'", "global_batch_size": "train.global_batch",
    "train_batch_size": "train.global_batch", "micro_batch_size": "train.micro_batch",
    "per_device_train_batch_size": "train.micro_batch", "train_micro_batch_size_per_gpu": "train.micro_batch",
    "seq_length": "data.seq_len", "sequence_length": "data.seq_len", "context_length": "data.seq_len",
    "max_seq_length": "data.seq_len", "block_size": "data.seq_len", "dataset": "data.source",
    "data_path": "data.source", "hidden_size": "model.dim", "n_embd": "model.dim", "d_model": "model.dim",
    "num_hidden_layers": "model.n_layers", "num_layers": "model.n_layers", "n_layer": "model.n_layers",
    "num_attention_heads": "model.n_heads", "n_head": "model.n_heads", "num_key_value_heads": "model.n_kv_heads",
    "intermediate_size": "model.ffn_hidden", "ffn_hidden_size": "model.ffn_hidden",
    "max_position_embeddings": "model.max_seq_len", "tie_word_embeddings": "model.tie_embeddings",
    "zero_stage": "parallel.zero", "stage": "parallel.zero", "tensor_model_parallel_size": "parallel.tp",
    "tensor_parallel": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp", "pipeline_parallel": "parallel.pp",
    "data_parallel": "parallel.dp", "dtype": "precision.mode", "mixed_precision": "precision.mode",
    "output_dir": "'--output-dir' (a flag of bigtrain train, not a field)",
}


def _suggest_key(section: str, key: str, sections: dict[str, type]) -> str:
    """What an unknown ``[section] key`` most likely meant: a field of that section close to it, the
    same name in another section ('train.seq_len': 'data.seq_len'), another tool's name for a field
    (:data:`OTHER_TOOLS_NAMES`), a close field of another section, else the section's fields."""
    own = list(_field_types(sections[section]))
    if key in OTHER_TOOLS_NAMES:
        meant = OTHER_TOOLS_NAMES[key]
        return f"; did you mean {meant if meant.startswith(chr(39)) else repr(meant)}?"
    elsewhere = [f"{name}.{key}" for name, cls in sections.items() if key in _field_types(cls)]
    if elsewhere:
        return "; did you mean " + " or ".join(f"'{d}'" for d in elsewhere) + "?"
    def score(choice: str) -> float:
        return difflib.SequenceMatcher(None, key, choice).ratio()

    everywhere = [f"{name}.{field}" for name, cls in sections.items() for field in _field_types(cls)]
    close = difflib.get_close_matches(key, [d.split(".", 1)[1] for d in everywhere], n=1, cutoff=0.75)
    near = difflib.get_close_matches(key, own, n=1)
    if close and (not near or score(close[0]) > score(near[0])):  # 'train.seqlen': data.seq_len, not seed
        return "; did you mean " + " or ".join(f"'{d}'" for d in everywhere if d.endswith(f".{close[0]}")) + "?"
    return _suggest(key, own)


def _outside_hint(key: str, sections: dict[str, type]) -> str:
    """For a key above every [section]: the section(s) that have it ('steps': [train]), else the
    field it most likely meant (:func:`_suggest_key`'s guesses), else where to look."""
    homes = [name for name, cls in sections.items() if key in _field_types(cls)]
    if homes:
        return "; put it under " + " or ".join(f"[{h}] ({h}.{key})" for h in homes)
    meant = _suggest_key("train", key, sections)
    if "did you mean '" in meant and "." in meant.split("did you mean '", 1)[1].split("'", 1)[0]:
        return meant
    return "; `bigtrain fields` lists them by section"


def _coerce(dotted: str, value: Any, typ: type) -> Any:
    """Turn a TOML or command-line value into the field's type, or raise a ConfigError."""
    return _checked_value(dotted, _typed(dotted, value, typ))


def _typed(dotted: str, value: Any, typ: type) -> Any:
    if typ is str and isinstance(value, bool):  # a TOML true / false for a switch that also takes 'auto'
        return "true" if value else "false"
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            raise ConfigError(f"{dotted}: expected {typ.__name__}, got '{value}'") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{dotted}: expected {typ.__name__}, got {value!r}")
    return value


INT64 = 2**63


def _checked_value(dotted: str, value: Any) -> Any:
    """Values every field shares a limit on: integers that numpy and torch hold (64 bits), text
    that a path, a TOML file and a terminal can carry (no NUL, valid Unicode)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64 <= value < INT64:
        raise ConfigError(f"{dotted} = {value}: does not fit in 64 bits (|value| < 2**63); use a smaller number")
    if isinstance(value, str):
        if "\0" in value:
            raise ConfigError(f"{dotted} = {value!r}: contains a NUL character, which no path or name can hold")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{dotted} = {value!r}: is not valid Unicode (undecodable bytes); "
                              f"use a UTF-8 name") from None
    return value


# Older spellings of a field, still read from config files, overrides and checkpoints' manifests:
# renamed on reading, so nothing past this module sees them (one field, no second source of truth).
ALIASES: dict[tuple[str, str], str] = {("model", "name"): "family"}


def canonical_keys(section: str, items: dict[str, Any], origin: str) -> dict[str, Any]:
    """``items`` of ``[section]`` with every older spelling renamed to its field; a ConfigError
    naming both where the two spellings are given different values."""
    out = dict(items)
    for (where, old), new in ALIASES.items():
        if where != section or old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ConfigError(f"{origin}: {section}.{old} = {value!r} and {section}.{new} = {out[new]!r} disagree "
                              f"({section}.{old} is the older name of {section}.{new}); give {section}.{new} only")
        out.setdefault(new, value)
    return out


def apply_values(cfg: Config, values: dict[str, dict[str, Any]], origin: str) -> None:
    """Merge ``{section: {key: value}}`` into cfg, naming unknown keys with a suggestion."""
    problems = []
    sections = _section_types()
    for section, items in values.items():
        if section not in sections and not isinstance(items, dict):  # 'steps = 3' above every [section]
            problems.append(f"{origin}: '{section}' is set outside any [section]; every field belongs to one"
                            f"{_outside_hint(section, sections)}")
            continue
        if section not in sections:
            problems.append(f"{origin}: unknown section [{section}]{_suggest(section, list(sections))}")
            continue
        if not isinstance(items, dict):
            problems.append(f"{origin}: [{section}] must be a table of key = value")
            continue
        try:
            items = canonical_keys(section, items, origin)
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        obj = getattr(cfg, section)
        types = _field_types(sections[section])
        for key, value in items.items():
            dotted = f"{section}.{key}"
            if key not in types:
                problems.append(f"{origin}: unknown key '{dotted}'{_suggest_key(section, key, sections)}")
                continue
            try:
                setattr(obj, key, _coerce(dotted, value, types[key]))
            except ConfigError as e:
                problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)


def joined_overrides(args: list[str]) -> list[str]:
    """``['--optim.lr', '1e-3']`` -> ``['--optim.lr=1e-3']``: a value may follow its flag, as argparse
    users type it."""
    out, args = [], list(args)
    while args:
        arg = args.pop(0)
        if arg.startswith("--") and "=" not in arg and "." in arg and args and not args[0].startswith("--"):
            arg = f"{arg}={args.pop(0)}"
        out.append(arg)
    return out


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """``['--parallel.dp=2', 'train.steps=5', '--optim.lr', '1e-3']`` -> ``{'parallel': {'dp': '2'},
    'train': {'steps': '5'}, 'optim': {'lr': '1e-3'}}``."""
    out: dict[str, dict[str, str]] = {}
    for arg in joined_overrides(args):
        text = arg[2:] if arg.startswith("--") else arg
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override '{arg}': write it as --section.key=value (e.g. --parallel.dp=2)")
        key, value = text.split("=", 1)
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name.replace("-", "_")] = value
    return out


def with_overrides(cfg: Config, overrides: list[str], origin: str) -> Config:
    """A copy of ``cfg`` with ``overrides`` (``--section.key=value``) applied; ``origin`` names them in errors."""
    out = copy.deepcopy(cfg)
    apply_values(out, parse_overrides(overrides), origin)
    return out


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def read_toml(path: Path) -> dict[str, Any]:
    try:
        # Only a regular file: /dev/zero would be read forever, a FIFO would block the open itself.
        if path.exists() and not path.is_dir() and not path.is_file():
            raise ConfigError(f"config file '{path}' is not a regular file (a device, FIFO or socket)")
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}") from None


def load_config(preset: str | None = None, path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Build a config from a preset and/or a TOML file, then dotted overrides (not yet validated)."""
    cfg = Config()
    if preset is not None:
        if preset not in preset_names():
            raise ConfigError(f"--preset: no preset '{preset}'{_suggest(preset, preset_names())}")
        apply_values(cfg, read_toml(PRESET_DIR / f"{preset}.toml"), f"preset {preset}")
    if path is not None:
        apply_values(cfg, read_toml(Path(path)), str(path))
    apply_values(cfg, parse_overrides(list(overrides)), "command line")
    return cfg


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: escapes quotes, backslashes and every control character."""
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    return repr(value)


def to_toml(cfg: Config, unset: Iterable[str] = ()) -> str:
    """The resolved config as TOML, every field written, with its help as a comment. The ``unset``
    fields (dotted) are written commented out: a launcher fills them (``parallel.dp`` from the world
    size), so a file made from this one still runs at any number of ranks."""
    lines, unset = [], set(unset)
    for section in SECTIONS:
        obj = getattr(cfg, section)
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            line = f"{f.name} = {_toml_value(getattr(obj, f.name))}  # {f.metadata.get('doc', '')}"
            lines.append(f"# {line} (unset: from the world size)" if f"{section}.{f.name}" in unset else line)
        lines.append("")
    return "\n".join(lines)


def field_defaults() -> dict[str, str]:
    """``{'parallel.dp': '1', ...}``: each field's value, as TOML writes it, in a config built with
    no preset or file."""
    cfg = Config()
    return {f"{section}.{f.name}": _toml_value(getattr(getattr(cfg, section), f.name))
            for section, cls in _section_types().items() for f in dataclasses.fields(cls)}


def field_docs() -> dict[str, str]:
    """``{'parallel.dp': 'Data-parallel degree.', ...}`` for help screens and docs."""
    out = {}
    for section, cls in _section_types().items():
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = f.metadata.get("doc", "")
    return out
