"""What the command line says to a user who is finding their way: a suggestion for a mistyped flag
or command ("did you mean ...?"), the config fields and examples under ``bigtrain train --help``, and
the data-parallel degree a launcher's world size implies when the config leaves it unset."""

from __future__ import annotations

import argparse
import difflib
import shlex
from pathlib import Path

from bigtrain.config import Config, ConfigError, canonical_keys, field_docs, load_config, parse_overrides, read_toml

COMMON_FIELDS = ("train.steps", "train.global_batch", "train.micro_batch", "parallel.dp", "parallel.tp",
                 "parallel.pp", "parallel.sp", "parallel.zero", "precision.mode", "memory.checkpointing",
                 "data.source", "data.seq_len", "data.val_fraction", "train.eval_every", "checkpoint.every",
                 "logging.log_every", "model.init_from")

TRAIN_EXAMPLES = """\
examples:
  bigtrain train --preset tiny                              # seconds
  bigtrain train --train.steps=500 --output-dir runs/mine   # the small preset, longer
  bigtrain train --parallel.dp=2 --parallel.zero=3          # two ranks (bigtrain starts torchrun), ZeRO-3
  bigtrain train --parallel auto --world-size 4             # the planner picks the layout
  bigtrain train --data.val_fraction=0.01 --train.eval_every=50   # held-out loss in the metrics
  bigtrain train --output-dir runs/mine --resume            # continue that run
  torchrun --nproc-per-node 2 -m bigtrain train --preset tiny   # your launcher: dp = 2 when left unset"""


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and " " not in value else repr(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _gist(text: str, width: int = 72) -> str:
    first = text.split(". ")[0].rstrip(".")
    return first if len(first) <= width else first[:width - 3].rsplit(" ", 1)[0] + " ..."


def train_epilog(preset: str) -> str:
    """Examples, the common fields with their help, then every field with its default."""
    try:
        cfg = load_config(preset=preset)
    except Exception:  # noqa: BLE001 - help must print even if a preset is broken
        cfg = Config()
    docs = field_docs()
    lines = [TRAIN_EXAMPLES, "", f"common fields (--section.key=value; defaults of the '{preset}' preset):"]
    for name in COMMON_FIELDS:
        section, key = name.split(".")
        lines.append(f"  --{name}={_value(getattr(getattr(cfg, section), key))}".ljust(36) + f" {_gist(docs[name])}")
    lines += ["", "all fields with their defaults (bigtrain fields: each one's help):"]
    by_section: dict[str, list[str]] = {}
    for name in docs:
        section, key = name.split(".")
        by_section.setdefault(section, []).append(f"{key}={_value(getattr(getattr(cfg, section), key))}")
    for section, items in by_section.items():
        line = f"  [{section}]"
        for item in items:
            if len(line) + len(item) + 1 > 110:
                lines.append(line)
                line = "   "
            line += " " + item
        lines.append(line)
    return "\n".join(lines)


# -- suggestions ------------------------------------------------------------------------------------
def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def suggest_flag(arg: str, parser: argparse.ArgumentParser, takes_overrides: bool) -> str | None:
    """The flag (or config override) ``arg`` was probably meant to be, with its value kept."""
    name, eq, value = arg.partition("=")
    options = _options(parser)
    fields = list(field_docs()) if takes_overrides else []
    spelled = "--" + name.lstrip("-").replace("_", "-")
    if spelled in options:
        return spelled + eq + value
    flat = {f.replace(".", "-").replace("_", "-"): f for f in fields}  # --parallel-dp, --train_steps
    if spelled[2:].replace(".", "-") in flat:
        return f"--{flat[spelled[2:].replace('.', '-')]}" + ("=" + value if eq else "=VALUE")
    close = difflib.get_close_matches(spelled, options, n=1, cutoff=0.7)  # the command's own flags first
    if close:
        return close[0] + eq + value
    bare = name.lstrip("-")
    if fields and "." not in bare:  # --steps=5: a field's key without its section
        keys = {f.split(".", 1)[1]: f for f in fields}
        close = difflib.get_close_matches(bare.replace("-", "_"), list(keys), n=1, cutoff=0.75)
        if close:
            return f"--{keys[close[0]]}" + ("=" + value if eq else "=VALUE")
    close = difflib.get_close_matches(name, [f"--{f}" for f in fields], n=1, cutoff=0.7)
    return close[0] + ("=" + value if eq else "=VALUE") if close else None


def unknown_arguments_message(command: str, unknown: list[str], parser: argparse.ArgumentParser,
                              takes_overrides: bool) -> str:
    lines = [f"bigtrain {command}: unrecognized arguments: {' '.join(unknown)}"]
    for arg in unknown:
        if arg.startswith("-") and (hint := suggest_flag(arg, parser, takes_overrides)):
            lines.append(f"  {arg}: did you mean {hint}?")
        elif not arg.startswith("-") and "--preset" in _options(parser) and (preset := _preset_meant(arg)):
            # `bigtrain train tiny`: was answered as a run folder given without --output-dir
            lines.append(f"  {arg}: a preset is given as --preset {preset}")
        elif not arg.startswith("-") and "--config" in _options(parser) and arg.endswith(".toml"):
            lines.append(f"  {arg}: a config file is given as --config {shlex.quote(arg)}")
        elif not arg.startswith("-") and "--output-dir" in _options(parser) and "--resume" in _options(parser):
            # `--resume runs/x`, as resume_from_checkpoint=PATH elsewhere: --resume takes no value
            folder = shlex.quote(arg)
            lines.append(f"  {arg}: a run folder is given as --output-dir {folder} (--resume takes no value: "
                         f"bigtrain {command} --output-dir {folder} --resume continues that run)")
    if takes_overrides:
        lines.append(f"  (config fields are given as --section.key=value, e.g. --train.steps=5; "
                     f"bigtrain {command} --help lists them)")
    else:
        lines.append(f"  (bigtrain {command} --help lists its flags)")
    return "\n".join(lines)


def _preset_meant(arg: str) -> str | None:
    """The preset a bare word names or nearly names ('tiny', 'smal'), else None."""
    from bigtrain.config import preset_names

    if Path(arg).exists():  # a folder or file of that name: not a preset (the other hints say what it is)
        return None
    close = difflib.get_close_matches(arg, preset_names(), n=1, cutoff=0.75)
    return close[0] if close else None


# The one-line help of the commands whose modules import torch (bigtrain.plan.cli): the CLI lists
# them under these lines without importing those modules when another command runs (cli._parser).
PLAN_HELP = "predict per-rank memory and step time; find the fastest layout"
BENCH_HELP = "measure this machine (--calibrate writes a hardware profile)"


def suggest_command(argv: list[str], commands: list[str]) -> str | None:
    """For ``bigtrain trian ...``: 'did you mean train?'; for ``bigtrain --preset tiny``: the command
    it lacks (argparse said "invalid choice: 'tiny'"). None when the command is known."""
    if argv and argv[0].startswith("--") and argv[0] not in ("--help", "--version") and "-h" not in argv:
        flag = argv[0].split("=", 1)[0]
        if flag in ("--preset", "--config", "--output-dir", "--resume") or "." in flag:
            return (f"bigtrain: no command before {flag}; give one first, e.g. bigtrain train {' '.join(argv)} "
                    f"(commands: {', '.join(commands)})")
    if not argv or argv[0].startswith("-") or argv[0] in commands:
        return None
    close = difflib.get_close_matches(argv[0], commands, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"bigtrain: no command '{argv[0]}'{hint} (commands: {', '.join(commands)})"


# -- the data-parallel degree a world size implies ------------------------------------------------
def dp_given(preset: str | None, config_path: str | None, overrides: list[str]) -> bool:
    """Whether ``parallel.dp`` is set anywhere: the preset, the config file or an override."""
    from bigtrain.config import PRESET_DIR

    sources = [parse_overrides(list(overrides))]
    if config_path:
        sources.append(read_toml(Path(config_path)))
    if preset:
        sources.append(read_toml(PRESET_DIR / f"{preset}.toml"))
    return any(isinstance(s.get("parallel"), dict) and "dp" in s["parallel"] for s in sources)


def inferred_dp(cfg: Config, world_size: int) -> int | None:
    """``parallel.dp`` that makes the mesh ``world_size`` ranks (None when tp x pp x sp x cp does not divide it)."""
    p = cfg.parallel
    rest = p.tp * p.pp * p.sp * p.cp
    return world_size // rest if world_size % rest == 0 else None


def unread_model_overrides(cfg: Config, overrides: list[str]) -> list[str]:
    """``--model.KEY=...`` overrides that the model family does not read (``Family.model_keys``):
    ``--model.vocab_size=32000`` beside ``--model.family=hf`` would train the config.json's
    vocabulary all the same. Only the command line is judged: a config file written by ``bigtrain
    config`` holds every field, and a preset's shape beside ``model.family = 'hf'`` is documented use."""
    from bigtrain.families import family_of

    try:
        family = family_of(cfg)
    except KeyError:
        return []  # validation names the unknown family
    if family.model_keys is None:
        return []
    given = canonical_keys("model", parse_overrides(list(overrides)).get("model", {}), "command line")
    return [f"--model.{key}: model.family = '{family.name}' does not read model.{key}, so it would change nothing; "
            f"leave it out" + (", or set model.family = 'hf' to use model.hf_config" if key == "hf_config" else "")
            for key in given if key not in family.model_keys]


# -- what --resume continues with ------------------------------------------------------------------
def resume_source_warnings(preset: str | None, config_path: str | None, overrides: list[str], cfg: Config,
                           run_dir: Path) -> list[str]:
    """``--resume`` beside ``--preset`` or ``--config``: the run goes on with the settings they give
    (as torchtitan, accelerate and Hugging Face's Trainer resume with the config on the command line;
    a job script that repeats its first command with ``--resume`` must run), not with the run's own
    ``config.toml``, which a bare ``--resume`` reads. Said once, naming the fields that differ from the
    run's own settings and how to keep them: the checks against the checkpoint (compat.py) warn field
    by field about the schedule and the data only, and say nothing of where the change came from.
    Compared with what a bare ``--resume`` and the same ``overrides`` would run: what the command
    line changes was asked for."""
    if preset is None and config_path is None:
        return []
    try:
        own = load_config(path=Path(run_dir) / "config.toml", overrides=overrides)
    except ConfigError:  # no run here (refused after, naming the folder), or a file older than its fields
        return []
    flat = lambda c: {f"{s}.{k}": v for s, values in c.to_dict().items() for k, v in values.items()}  # noqa: E731
    before, after = flat(own), flat(cfg)
    moved = [f"{k} {before[k]!r} -> {after[k]!r}" for k in after if k in before and before[k] != after[k]
             and k != "checkpoint.resume"]
    if not moved:
        return []
    given = f"--preset {preset}" if preset is not None else f"--config {config_path}"
    shown = "; ".join(moved[:8]) + (f"; and {len(moved) - 8} more" if len(moved) > 8 else "")
    return [f"--resume with {given}: the run goes on with the settings {given} gives, not with "
            f"{Path(run_dir) / 'config.toml'} (the run's own, which --resume reads without --preset or --config); "
            f"{len(moved)} field{'s differ' if len(moved) > 1 else ' differs'} from it: {shown}; to go on "
            f"with the run's own settings, leave out {given.split()[0]} (and give only what you change as "
            f"--section.key=value)"]
