"""``bigtrain check [--preset P | --config F] [--steps K] [--section.key=value ...]``.

Validates the layout (exit 2, naming the field, before any rank starts), runs it beside the
independent reference, prints the comparison and exits 0 when they agree within the precision's
tolerance, 1 when they do not (with the bisection: step, module, parameter, ranks, size).
Several ranks are started under torchrun like ``bigtrain train``; the first rank writes
``check.json`` into the output directory and the launching process reads it back.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bigtrain.check.bounds import STEPS_MAX, check_steps
from bigtrain.cli_help import unread_model_overrides
from bigtrain.config import Config, ConfigError, load_config, parse_overrides, preset_names
from bigtrain.families.init_from import init_from_architecture
from bigtrain.validation import validate

DEFAULT_PRESET = "tiny"
DEFAULT_STEPS = 4
REPORT = "check.json"


def add_check_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    text = "run a layout beside the independent single-process reference and say where they differ"
    p = subparsers.add_parser("check", help=text, description=text)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"a shipped preset: {', '.join(preset_names())} (default {DEFAULT_PRESET})")
    source.add_argument("--config", help="a TOML config file")
    # read as text and parsed by check_steps (bigtrain.check.bounds, the fuzzer's --steps too)
    p.add_argument("--steps", metavar="K", help=f"optimizer steps to compare, 1 to {STEPS_MAX} (default "
                                                f"{DEFAULT_STEPS}; --train.steps sets the learning-rate schedule's "
                                                f"length only)")
    p.add_argument("--output-dir", help="where the ranks write (default: a temporary directory)")
    return p


def check_config(preset: str | None, path: str | None, overrides: list[str]) -> Config:
    preset = preset if preset is not None else (None if path else DEFAULT_PRESET)
    cfg = load_config(preset=preset, path=path, overrides=overrides)
    # model.init_from's folder gives the [model] shape, as `bigtrain train` takes it: a config that
    # trained was refused here, each shape field named as differing from the folder's.
    if architecture := init_from_architecture(cfg):
        cfg = load_config(preset=preset, path=path, overrides=architecture + list(overrides))
    if problems := unread_model_overrides(cfg, overrides):
        raise ConfigError(problems)
    # A check compares numbers: no progress bar, report, checkpoint or resume of an older run.
    cfg.logging.progress = cfg.logging.report = cfg.checkpoint.save_final = False
    cfg.checkpoint.every, cfg.checkpoint.resume = 0, "none"
    return cfg


def cmd_check(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from bigtrain.check.run import reference_problems
    from bigtrain.distributed.launch import env_world_size, launch_local, launched_externally
    from bigtrain.preflight import check_environment, check_inputs, print_warnings
    from bigtrain.run_dir import users_config_problem, write_run_config

    env_warnings = check_environment()  # before anything reads RANK / WORLD_SIZE
    try:
        given = check_steps(args.steps)
    except ValueError as e:
        print(f"bigtrain check: {e}", file=sys.stderr)
        return 2
    if args.output_dir is not None and not args.output_dir.strip():
        raise ConfigError("--output-dir is empty; give a folder, or leave the flag out for a temporary one")
    # the rule `bigtrain train` follows: the ranks' resolved config (and the Trainer's) went over a
    # config.toml the user keeps there (their --config, even)
    if args.output_dir is not None and (problem := users_config_problem(Path(args.output_dir).expanduser(),
                                                                        writer="the check")):
        raise ConfigError(problem)
    cfg = check_config(args.preset, args.config, overrides)
    validate(cfg, world_size=env_world_size(), cuda_available=torch.cuda.is_available(),
             cuda_capability=torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    if problems := reference_problems(cfg):
        raise ConfigError(problems)
    steps = DEFAULT_STEPS if given is None else given
    if note := steps_note(given, overrides):
        print(note, file=sys.stderr)
    print_warnings(env_warnings + check_inputs(cfg, args.output_dir or tempfile.gettempdir(),
                                               "--output-dir" if args.output_dir else "the temporary folder"))
    out = Path(args.output_dir).expanduser() if args.output_dir else Path(tempfile.mkdtemp(prefix="bigtrain-check-"))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.parallel.world_size > 1 and not launched_externally():
        resolved = write_run_config(out, cfg)  # marked as bigtrain's: the next check may replace it
        (out / REPORT).unlink(missing_ok=True)
        code = launch_local(cfg.parallel.world_size, ["check", "--config", str(resolved), "--steps",
                                                      str(steps), "--output-dir", str(out)])
        if code != 0 or not (out / REPORT).exists():
            print(f"bigtrain check: the ranks exited with status {code}; see the messages above", file=sys.stderr)
            return code or 1
        report = json.loads((out / REPORT).read_text())
        print(report["text"])
        return 0 if report["agree"] else 1
    return _check_rank(cfg, out, steps)


def steps_note(steps: int | None, overrides: list[str]) -> str | None:
    """The line for ``--train.steps=N`` given without ``--steps``: a user who writes it means N
    steps compared, but the check compares ``--steps`` (default 4) and N is the schedule's length
    (its warm-up and cosine decay), so the check ran 4 steps of an N-step schedule without a word."""
    given = parse_overrides(overrides).get("train", {}).get("steps")
    if given is None or steps is not None:
        return None
    return (f"bigtrain check: note: --train.steps={given} sets the learning-rate schedule's length; the steps "
            f"compared are --steps (default {DEFAULT_STEPS}): give --steps {given} to compare {given}")


def _check_rank(cfg: Config, out: Path, steps: int) -> int:
    from bigtrain.check.run import check_layout
    from bigtrain.distributed.join import join_group
    from bigtrain.distributed.launch import launched_externally, shutdown_distributed
    from bigtrain.distributed.mesh import Mesh

    info = join_group(cfg)
    try:
        mesh = Mesh.from_config(cfg.parallel, info.rank, info.world_size)
        report = check_layout(cfg, mesh, out, steps, info.device)
    finally:
        shutdown_distributed()
    if report is None:
        return 0
    (out / REPORT).write_text(json.dumps({"agree": report.agree, "text": report.text(), **report.to_dict()},
                                         default=str))
    if not launched_externally():  # under a launcher, whoever started it reads check.json
        print(report.text())
    return 0 if report.agree or launched_externally() else 1
