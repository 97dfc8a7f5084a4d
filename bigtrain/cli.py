"""``bigtrain train | check | plan | bench | report | export | generate | config | presets | fields``.

``bigtrain train`` validates the config before anything starts. When the layout needs several
ranks and no launcher started us, it writes the resolved config into the run directory and starts
itself under torchrun; inside a launcher (ours or a user's) it runs one rank of the job.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from bigtrain.cli_finished_run import cmd_export, cmd_generate
from bigtrain.cli_help import (BENCH_HELP, PLAN_HELP, dp_given, inferred_dp, resume_source_warnings, suggest_command,
                               train_epilog, unknown_arguments_message, unread_model_overrides)
from bigtrain.config import Config, ConfigError, field_defaults, field_docs, joined_overrides, load_config, preset_names, to_toml
from bigtrain.failure import INTERRUPTED, RunFailure
from bigtrain.families import family_of
from bigtrain.families.init_from import init_from_architecture
from bigtrain.run_rank import run_rank
from bigtrain.validation import validate

DEFAULT_PRESET = "small"
WORLD_SIZE_MAX = 2**20  # --world-size for --parallel auto; the planner enumerates the divisors of it
MAX_RESTARTS_MAX = 10_000  # --max-restarts: a bound that still reads as a number of failures, not an accident


# Commands that build no model: their process imports no torch (about 2 s of CPU a start), so the
# parser leaves out the arguments of the commands whose modules import it. So does the top-level
# help (`bigtrain --help`, or no command at all), which lists each command's name and help line only:
# a new user's first command took 3.3 s here, 2.9 of them importing torch for the planner's parser.
LIGHT_COMMANDS = ("presets", "fields", "config")
TOP_LEVEL_HELP = ("", "-h", "--help")  # "": no command given


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``command``: the command about to run (its first word, ``""`` when
    none is given), which decides whether plan and bench get their arguments (None, the default, and
    any command but the light ones and the top-level help get them all)."""
    parser = argparse.ArgumentParser(prog="bigtrain", description="Train models that do not fit on one accelerator.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "train a model (overrides: --section.key=value)"),
                       ("config", "print the resolved, validated config as TOML"),
                       ("data", "show what a config trains on: its corpora, tokens, how often a run reads each, and "
                                "step 1's first windows as text")):
        extra = {"epilog": train_epilog(DEFAULT_PRESET), "formatter_class": argparse.RawDescriptionHelpFormatter} \
            if name == "train" else {}
        p = sub.add_parser(name, help=text, description=text, **extra)
        source = p.add_mutually_exclusive_group()
        source.add_argument("--preset", help=f"a shipped preset: {', '.join(preset_names())} (default {DEFAULT_PRESET})")
        source.add_argument("--config", help="a TOML config file")
        if name == "train":
            p.add_argument("--output-dir", help="run directory (default runs/<preset>-<time>)")
            p.add_argument("--resume", action="store_true",
                           help="continue the run in --output-dir from its newest valid checkpoint, with its own "
                                "config.toml (overrides on top); with --preset or --config, with theirs instead "
                                "(the fields that differ from the run's are named)")
            p.add_argument("--overwrite", action="store_true",
                           help="replace the run --output-dir holds (its checkpoints, metrics and records)")
            p.add_argument("--parallel", choices=["auto"], help="let the planner choose the layout")
            p.add_argument("--world-size", type=int, help="ranks of the run: with --parallel auto, what the planner "
                                                          "plans for; otherwise parallel.dp follows from it when "
                                                          "no preset, file or override sets dp (default: the "
                                                          "launcher's, else 1)")
            p.add_argument("--hardware-file", metavar="PATH",
                           help="with --parallel auto: plan with this machine's measured profile "
                                "(bigtrain bench --calibrate --output PATH) instead of the preset")
            p.add_argument("--force", action="store_true",
                           help="launch even when the planner says the run does not fit this machine's memory")
            p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                           help="after a rank fails, restart all ranks up to N times (torchrun elastic); "
                                "each restart resumes from the run directory's newest checkpoint (default 0)")
        if name == "data":
            p.add_argument("--windows", type=int, default=2, metavar="N", help="windows of step 1 to show (default 2)")
    from bigtrain.check.cli import add_check_parser

    add_check_parser(sub)
    # plan and bench by name and help line only: their module imports torch
    if command in LIGHT_COMMANDS + TOP_LEVEL_HELP:
        sub.add_parser("plan", help=PLAN_HELP)
        sub.add_parser("bench", help=BENCH_HELP)
    else:
        from bigtrain.plan.cli import add_bench_parser, add_plan_parser

        add_plan_parser(sub)
        add_bench_parser(sub)
    report = sub.add_parser("report", help="write report.md and loss.png for a run directory")
    report.add_argument("run_dir")
    export = sub.add_parser("export", help="write the newest checkpoint's weights: one safetensors file, or a "
                                           "Hugging Face Llama folder (--format hf)")
    export.add_argument("run_dir", help="a run directory, its checkpoints/, or one checkpoint")
    export.add_argument("out", help="the file to write (model.safetensors), or with --format hf the folder")
    export.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                        help="'safetensors': one file of bigtrain's weights by name (default); 'hf': config.json "
                             "and model.safetensors that transformers' LlamaForCausalLM.from_pretrained loads, "
                             "and model.init_from = 'hf:OUT' starts a run from")
    export.set_defaults(run=cmd_export)
    generate = sub.add_parser("generate", help="print text a trained model writes after a prompt (in the run's tokenizer, or bytes)")
    generate.add_argument("run_dir", help="a run directory, its checkpoints/, one checkpoint, or a Hugging Face "
                                          "Llama folder")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=int, default=200, help="new tokens to write (bytes for a byte-level run) (default 200)")
    generate.add_argument("--temperature", type=float, default=0.8,
                          help="sampling temperature; 0 is greedy (the most likely token each time) (default 0.8)")
    generate.add_argument("--top-k", type=int, default=0,
                          help="sample among the k most likely tokens only; 0: all of them (default 0)")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    generate.add_argument("--ignore-eos", action="store_true",
                          help="write all --tokens, past the model's end-of-text token (default: stop after it, as "
                               "transformers' generate does)")
    generate.set_defaults(run=cmd_generate)
    sub.add_parser("presets", help="list the shipped presets")
    sub.add_parser("fields", help="list every config field with its help")
    return parser


def _preset(args: argparse.Namespace) -> str | None:
    """The preset a command starts from: ``--preset``, none under ``--config``, else the default."""
    return args.preset if args.preset is not None else (None if args.config else DEFAULT_PRESET)


def _resolve(args: argparse.Namespace, overrides: list[str]) -> Config:
    resume = getattr(args, "resume", False)
    if resume and not args.output_dir:  # (with --preset it resumed a new runs/<preset>-<time>: "nothing valid")
        raise ConfigError(f"--resume continues the run in --output-dir: give --output-dir RUN_DIR{_newest_run()}")
    if resume and args.preset is None and args.config is None:  # the run's own settings, not the default preset
        cfg = load_config(path=_run_config(args), overrides=overrides)
    else:
        preset = _preset(args)
        cfg = load_config(preset=preset, path=args.config, overrides=overrides)
        if architecture := init_from_architecture(cfg):  # the folder's shape, under what the user set
            cfg = load_config(preset=preset, path=args.config, overrides=architecture + list(overrides))
    if problems := unread_model_overrides(cfg, overrides):
        raise ConfigError(problems)
    if resume:
        cfg.checkpoint.resume = "auto"
    return cfg


def _newest_run() -> str:
    """' (the newest here: runs/small-20261128-160452)': the run folder a bare --resume most likely meant."""
    try:
        runs = [p for p in Path("runs").iterdir() if (p / "config.toml").is_file()]
    except OSError:
        return ""
    if not runs:
        return ""
    return f" (the newest here: {max(runs, key=lambda p: p.stat().st_mtime)})"


def _run_config(args: argparse.Namespace) -> Path:
    """``--output-dir``'s config.toml, which ``--resume`` continues from."""
    if not args.output_dir:
        raise ConfigError("--resume continues the run in --output-dir: give --output-dir RUN_DIR")
    path = Path(args.output_dir).expanduser() / "config.toml"
    if not path.is_file():
        raise ConfigError(f"--resume: --output-dir = '{args.output_dir}' holds no bigtrain run ({path} does not "
                          f"exist; a mistyped folder?); give the run directory to continue, or leave out --resume "
                          f"to start a new run")
    return path


def _run_dir(args: argparse.Namespace) -> Path:
    if args.output_dir:
        # '~' is the home directory, as the checks before launch read it: `--output-dir=~/runs/x` (no
        # shell expands a '~' after '=') made a folder named '~' here while they checked the home's
        return Path(args.output_dir).expanduser()
    name = args.preset or (Path(args.config).stem if args.config else DEFAULT_PRESET)
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():  # two runs started within one second get their own folders
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from bigtrain.checkpoint.resume import resume_after_restart
    from bigtrain.distributed.elastic import elastic_warnings, restart_notice, restart_round
    from bigtrain.distributed.launch import env_world_size, launched_externally, stop_when_orphaned
    from bigtrain.preflight import LAUNCHER_MARKERS, check_environment, check_inputs, print_warnings
    from bigtrain.run_dir import claim_run_dir, finished_run, recorded_exit_code

    env_warnings = check_environment()  # before anything reads RANK / WORLD_SIZE
    if args.world_size is not None and not 1 <= args.world_size <= WORLD_SIZE_MAX:
        raise ConfigError(f"--world-size = {args.world_size}: must be between 1 and {WORLD_SIZE_MAX}")
    if args.output_dir is not None and not args.output_dir.strip():
        raise ConfigError("--output-dir is empty; give a folder, or leave the flag out for runs/<preset>-<time>")
    check_max_restarts(args.max_restarts)
    if args.hardware_file is not None and args.parallel != "auto":
        raise ConfigError("--hardware-file is what --parallel auto plans with; add --parallel auto, or leave it out")
    cfg = _resolve(args, overrides)
    if args.parallel == "auto":
        from bigtrain.plan.auto import auto_overrides

        planned = args.world_size or env_world_size() or 1
        chosen, why = auto_overrides(cfg, planned, hardware_file=args.hardware_file)
        print(why)
        cfg = _resolve(args, chosen + overrides)  # what the user set explicitly still wins
    else:
        planned = None
        cfg = _infer_dp(args, overrides, cfg, args.world_size or env_world_size())
    # Under --parallel auto too: an axis set on the command line wins over the planner's layout, and
    # must not silently launch a world other than the one planned for.
    validate(cfg, world_size=env_world_size() or args.world_size or planned,
             world_size_from="from the launcher" if env_world_size() else
             "--world-size" if args.world_size else "what --parallel auto planned for",
             cuda_available=torch.cuda.is_available(),
             cuda_capability=torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    if launched_externally() and any(k in os.environ for k in LAUNCHER_MARKERS):
        stop_when_orphaned(cfg.distributed.timeout_s)  # a rank: stop when its launcher is gone
    run_dir = _run_dir(args)
    if restart_round() > 0:  # torchrun restarted this group: go on from the run's newest checkpoint
        if (stopped := recorded_exit_code(run_dir)) is not None:
            # The previous round stopped on purpose (the NaN policy, a signal): torchrun restarts on
            # any failure, but going on would only repeat the stop. Leave at once with its code.
            if os.environ.get("RANK", "0") == "0":
                print(f"bigtrain: not resuming after the restart: the previous round stopped on purpose with "
                      f"exit code {stopped} ({run_dir / 'stopped.json'})", file=sys.stderr)
            return stopped
        cfg.checkpoint.resume = resume_after_restart(cfg.checkpoint.resume, run_dir)
        # The same command line as the first round's: its --overwrite replaced the old run then, and
        # here would remove what the first round saved (and train from step 0 again).
        args.overwrite = False
        if notice := restart_notice(cfg.checkpoint.resume, run_dir):
            print(notice, file=sys.stderr)
    print_warnings(env_warnings + elastic_warnings() + restart_warnings(cfg, args.max_restarts)
                   + (resume_source_warnings(args.preset, args.config, overrides, cfg, run_dir) if args.resume else [])
                   + check_inputs(cfg, run_dir, "--output-dir", check_size=not args.force))
    if args.resume and (finished := finished_run(run_dir, cfg)) is not None:
        print(finished)  # and nothing in the folder changes: no lock taken, no launch, no report rewritten
        return 0
    lock = claim_run_dir(cfg, run_dir, args.resume, args.overwrite)  # owned before anything is written
    try:
        return _train_in(args, cfg, run_dir, lock)
    finally:
        if lock is not None:
            lock.release()


def _train_in(args: argparse.Namespace, cfg: Config, run_dir: Path, lock) -> int:
    """``bigtrain train`` once the run directory is this run's (``lock``): launch the ranks, or be one."""
    from bigtrain.distributed.elastic import restart_round
    from bigtrain.distributed.launch import launch_local, launched_externally
    from bigtrain.run_dir import clear_run, forget_stop, recorded_exit_code, write_run_config
    from bigtrain.run_lock import TOKEN_ENV

    if args.overwrite and os.environ.get("RANK", "0") == "0":  # one process clears; the others find it clear
        clear_run(run_dir)
    if restart_round() == 0 and os.environ.get("RANK", "0") == "0":
        # An earlier launch's stop is not this launch's: a restarted round reads stopped.json as its
        # previous round's, and one left from before (a run stopped by SIGTERM, then resumed under
        # torchrun) ended every restart at once if the first round failed before fit forgot it.
        forget_stop(run_dir)
    if family_of(cfg).reads_tokens:  # text tokenized once, here: in the launcher, or by the first rank to come
        from bigtrain.data.load import prepare_run_data

        prepare_run_data(cfg, run_dir, main=os.environ.get("RANK", "0") == "0", log=print)
    if (cfg.parallel.world_size > 1 or args.max_restarts) and not launched_externally():
        resolved = write_run_config(run_dir, cfg)
        forget_stop(run_dir)
        times = f"{args.max_restarts} time{'s' if args.max_restarts > 1 else ''}"
        restarts = f", restarted up to {times} after a failure" if args.max_restarts else ""
        ranks = f"{cfg.parallel.world_size} rank{'s' if cfg.parallel.world_size > 1 else ''}"
        print(f"bigtrain: starting {ranks} with torchrun{restarts}; run directory {run_dir}")
        forced = ["--force"] if args.force else []
        code = launch_local(cfg.parallel.world_size, ["train", "--config", str(resolved), "--output-dir", str(run_dir)]
                            + forced,
                            max_restarts=args.max_restarts, env={TOKEN_ENV: lock.token} if lock and lock.token else {})
        # A run that stopped on purpose recorded its code (its ranks exit 0: no restart, no torchrun
        # traceback); rank 0 said why.
        stopped = recorded_exit_code(run_dir)
        if stopped is not None:
            return stopped
        if code != 0:
            print(f"bigtrain: the ranks exited with status {code}; see the messages above", file=sys.stderr)
        return code
    return run_rank(cfg, run_dir, lock)


def _infer_dp(args: argparse.Namespace, overrides: list[str], cfg: Config, world_size: int | None) -> Config:
    """``parallel.dp`` from the world size (``--world-size``, or the launcher's) when nothing sets
    it: under a user's ``torchrun --nproc-per-node 4``, a tp=2 config runs dp=2. HSDP's
    ``parallel.dp_replicate`` x ``parallel.dp_shard``, both given, set it when nothing else does."""
    p = cfg.parallel
    if p.dp_shard > 0 and p.dp != p.dp_replicate * p.dp_shard and not getattr(args, "resume", False) \
            and not dp_given(_preset(args), args.config, overrides):
        cfg = _resolve(args, [f"--parallel.dp={p.dp_replicate * p.dp_shard}"] + list(overrides))
    if world_size is None or world_size == cfg.parallel.world_size or getattr(args, "resume", False):
        return cfg
    preset = _preset(args)
    dp = inferred_dp(cfg, world_size)
    if dp is None or dp_given(preset, args.config, overrides) or cfg.parallel.dp_shard > 0:
        return cfg  # validation names the mismatch and the fix (HSDP's two axes, both given, set dp)
    if os.environ.get("RANK", "0") == "0":  # under a launcher every rank comes here; one says it
        print(f"bigtrain: parallel.dp = {dp} (world size {world_size} / tp x pp x sp x cp = "
              f"{cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.sp * cfg.parallel.cp})")
    return _resolve(args, [f"--parallel.dp={dp}"] + list(overrides))


def check_max_restarts(max_restarts: int) -> None:
    """``--max-restarts`` is for the launcher we start; inside someone else's, theirs decides."""
    from bigtrain.distributed.launch import launched_externally

    if not 0 <= max_restarts <= MAX_RESTARTS_MAX:
        raise ConfigError(f"--max-restarts = {max_restarts}: must be between 0 and {MAX_RESTARTS_MAX}")
    if max_restarts and launched_externally():
        raise ConfigError(f"--max-restarts = {max_restarts}, but a launcher (torchrun?) already started this rank "
                          f"and its own restart setting applies; pass --max-restarts to the launcher instead")


def restart_warnings(cfg: Config, max_restarts: int) -> list[str]:
    if max_restarts and not cfg.checkpoint.every and not cfg.checkpoint.every_minutes:
        return [f"--max-restarts = {max_restarts} with checkpoint.every = 0 and checkpoint.every_minutes = 0: a "
                f"restarted run has no checkpoint to resume from and starts again at step 0; set one of them"]
    return []


def _stop_code(error: RuntimeError) -> int | None:
    """The exit code of a run that stopped on purpose or on a named failure; None for a bug."""
    from bigtrain.checkpoint import CheckpointWriteError
    from bigtrain.data.sampler import DataChanged
    from bigtrain.distributed.comm import CollectiveError
    from bigtrain.nonfinite import NonFiniteStop
    from bigtrain.run_dir import RunDirWriteError
    from bigtrain.preemption import Preempted

    if isinstance(error, (NonFiniteStop, Preempted)):
        return error.exit_code
    if isinstance(error, (CollectiveError, CheckpointWriteError, RunDirWriteError, DataChanged)):
        return 1
    return None


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Our own warnings as one line each, like the checks' ``bigtrain: warning: ...``."""
    if issubclass(category, UserWarning):
        print(f"bigtrain: warning: {message}", file=sys.stderr)
    else:
        print(warnings.formatwarning(message, category, filename, lineno, line), file=sys.stderr, end="")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (the console script, python -m bigtrain), not a caller's process
        # At exit, before the interpreter's last collections, every object moves to the collector's
        # permanent generation: shutdown then skips the million-odd objects ``import torch`` made,
        # about 1 s of CPU per process on a 2-core machine (``import bigtrain.cli`` then exit: 3.5-3.8
        # s user without, 2.6-2.7 s with), paid by the launcher, the agent and every rank (a 2-rank
        # 1-step run: 16.3 s of CPU in all against 17-19). bigtrain writes its files in ``with``
        # blocks, so none waits on a collection to be flushed.
        atexit.register(gc.freeze)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _main(argv)
        except BrokenPipeError:  # `bigtrain fields | head`: the reader has gone; a traceback told it nothing
            _drop_stdout()
            return 128 + signal.SIGPIPE  # as a program the pipe's signal ended
        except KeyboardInterrupt:  # anywhere, the parsing and the lazy imports too (the CLI's own: entry_point)
            print(INTERRUPTED, file=sys.stderr)
            return 130


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not raise on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture)
        pass


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv[0] if argv else "")
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if wrong := suggest_command(argv, list(commands)):
        print(wrong, file=sys.stderr)
        return 2
    args, rest = parser.parse_known_args(argv)
    rest = joined_overrides(rest)
    takes_overrides = args.command in ("train", "config", "check", "data")
    unknown = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if unknown or (rest and not takes_overrides):
        print(unknown_arguments_message(args.command, unknown or rest, commands[args.command], takes_overrides),
              file=sys.stderr)
        return 2
    try:
        if hasattr(args, "run"):  # commands that carry their own entry point (plan, bench)
            return args.run(args)
        if args.command == "train":
            return cmd_train(args, rest)
        if args.command == "check":
            from bigtrain.check.cli import cmd_check

            return cmd_check(args, rest)
        if args.command == "config":
            cfg = _resolve(args, rest)
            validate(cfg)
            preset = _preset(args)
            # dp left to the launcher's world size, so `torchrun ... --config` of this file runs as is
            print(to_toml(cfg, unset=() if dp_given(preset, args.config, rest) else ("parallel.dp",)))
        elif args.command == "data":
            from bigtrain.data_summary import cmd_data

            return cmd_data(_resolve(args, rest), args.windows)
        elif args.command == "report":
            from bigtrain.report import write_report

            if not Path(args.run_dir).is_dir():
                print(f"bigtrain report: {args.run_dir} is not a folder; give a run directory (runs/<name>)",
                      file=sys.stderr)
                return 1
            path = write_report(Path(args.run_dir))
            if path is None:
                print(f"bigtrain report: no metrics.jsonl in {args.run_dir}; is it a run directory?", file=sys.stderr)
                return 1
            print(path)
        elif args.command == "presets":
            print("\n".join(preset_names()))
        elif args.command == "fields":
            defaults = field_defaults()
            print("\n".join(f"{k:32s} {v} (default: {defaults[k]})" for k, v in field_docs().items()))
        return 0
    except ConfigError as e:
        print(f"bigtrain: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    except RunFailure as e:
        print(f"bigtrain: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # the run's own stops, each with its exit code (docs/reliability.md)
        code = _stop_code(e)
        if code is None:
            raise
        print(f"bigtrain: {e}", file=sys.stderr)
        return code
    except ValueError as e:
        from bigtrain.checkpoint.resume import ResumeError

        if not isinstance(e, ResumeError):
            raise
        print(f"bigtrain: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    warnings.simplefilter("default")
    sys.exit(main())
