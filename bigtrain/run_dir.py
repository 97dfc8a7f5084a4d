"""A run directory's identity and records: which run it holds, and why that run stopped.

A run gets an id when it starts (``run.json``, written by rank 0) and every checkpoint's manifest
carries it, so resuming never picks up another run's checkpoints. ``bigtrain train`` refuses an
``--output-dir`` that holds a run unless it continues that run (``--resume``, or
``checkpoint.resume = 'auto'``: what a restarted rank runs) or ``--overwrite`` replaces it.

``stopped.json`` records a run that stopped on purpose with an exit code of its own (the NaN
policy's 3, a signal's 128 + N): torchrun reports any failing rank as 1, so the process that
launched the ranks reads the code from here.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

from bigtrain.checkpoint.commit import list_checkpoints
from bigtrain.config import to_toml
from bigtrain.data.load import RUN_TOKENIZER_NAMES
from bigtrain.distributed.launch import launched_by_bigtrain, launched_externally
from bigtrain.run_lock import RunLock, own_run_dir

RUN_FILE = "run.json"
STOP_FILE = "stopped.json"
SEGMENTS_FILE = "segments.json"  # each launch's share of the run (bigtrain.run_segments)
# What a run writes into its directory (and --overwrite removes); anything else is left alone. The
# tokenizer's copy too: a new run with another tokenizer (or none) would keep the old one, which its
# export would then ship beside weights that never saw it.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "config.toml", RUN_FILE, STOP_FILE, SEGMENTS_FILE, "summary.json",
               "report.md", "report.json", "loss.png", "timeline_measured.png", "timeline_simulated.png", "tensorboard",
               *RUN_TOKENIZER_NAMES.values())


class RunDirWriteError(RuntimeError):
    """A file of the run directory could not be written (a full disk, say); nothing half-written
    was left (exit 1)."""


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or keeps what it held: written beside it and renamed over
    it. A failure (a full disk) removes the partial copy and raises RunDirWriteError naming the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, e, "it was left as it was") from e


def write_failed(path: Path, error: OSError, state: str) -> RunDirWriteError:
    """The error for a run-directory file ``path`` that could not be written; ``state``: what became
    of the file (kept whole, or a record appended in part)."""
    return RunDirWriteError(f"{path} could not be written ({error.strerror or error}); {state}; {_fix(error)}")


def _fix(error: OSError) -> str:
    import errno

    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that disk (or choose another --output-dir), then continue with --resume"
    return "make the folder writable (or choose another --output-dir), then continue with --resume"


def _write_json(path: Path, value: dict) -> None:
    """Written whole or not at all: another rank may read it at any moment."""
    write_atomic(path, json.dumps(value, indent=1) + "\n")


def _read_json(path: Path) -> dict | None:
    try:
        if not path.is_file():
            return None
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_run_id(run_dir: Path) -> str | None:
    value = (_read_json(Path(run_dir) / RUN_FILE) or {}).get("run_id")
    return value if isinstance(value, str) else None


def ensure_run_id(run_dir: Path, continued: str | None = None) -> str:
    """The run's id, recorded now if the directory has none (rank 0 only): ``continued``, the id of
    the run's own checkpoint it resumed from (its run.json was lost: a new id would make the next
    resume skip every checkpoint as another run's), else a new one."""
    run_dir = Path(run_dir)
    found = read_run_id(run_dir)
    if found is not None:
        return found
    run_id = continued or uuid.uuid4().hex[:16]
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json(run_dir / RUN_FILE, {"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return run_id


def held_run(run_dir: Path) -> str | None:
    """A description of the run ``run_dir`` holds (its checkpoints or metrics), None if it holds
    none. A config.toml alone is not a run: the launcher writes it for the ranks it starts."""
    run_dir = Path(run_dir)
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    metrics = run_dir / "metrics.jsonl"
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    if not checkpoints and not has_metrics:
        return None
    parts = [f"run id {read_run_id(run_dir) or 'unknown'}"]
    if checkpoints:
        parts.append(f"checkpoints {', '.join(p.name for p in checkpoints[:3])}" + (", ..." if len(checkpoints) > 3
                                                                                   else ""))
    if has_metrics:
        parts.append("metrics.jsonl")
    return "; ".join(parts)


# What a launch writes before its run has an id (the resolved config for its ranks, the tokenizer's
# copy): left by a launch that stopped before training, not another program's files.
BEFORE_RUN_ID = ("config.toml", *RUN_TOKENIZER_NAMES.values())


def foreign_outputs(run_dir: Path) -> list[str]:
    """The names a run writes (:data:`RUN_OUTPUTS`) that ``run_dir`` holds although no run of ours
    ever started there (no run.json): another program's ``checkpoints/`` or ``report.md``, which
    ``--overwrite`` removed (a whole folder of checkpoints) and a fresh run wrote over. An empty
    ``checkpoints/`` holds nothing to lose."""
    run_dir = Path(run_dir)
    if read_run_id(run_dir) is not None or not run_dir.is_dir():
        return []
    found = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if name in BEFORE_RUN_ID or name == RUN_FILE or not os.path.lexists(path):
            continue
        if path.is_dir() and not path.is_symlink():
            try:
                if not any(path.iterdir()):
                    continue
            except OSError:
                pass
            name += "/"
        found.append(name)
    return found


# The first line of the config.toml bigtrain writes into a run folder: how a later command tells it
# from a config.toml the user wrote there (their --config, or notes), which no run may remove or replace.
CONFIG_HEADER = "# bigtrain: the resolved config of the run in this folder (bigtrain train writes it; --resume reads it)"


def write_run_config(run_dir: Path, cfg) -> Path:
    """The run's resolved config as ``run_dir/config.toml``, marked as bigtrain's (:data:`CONFIG_HEADER`)."""
    path = Path(run_dir) / "config.toml"
    write_atomic(path, f"{CONFIG_HEADER}\n{to_toml(cfg)}")  # a full disk keeps the old one whole
    return path


def users_config(run_dir: Path) -> Path | None:
    """``run_dir/config.toml`` when bigtrain did not write it: no :data:`CONFIG_HEADER` and no run of
    ours ever started in the folder (run.json; a run before the header wrote its config.toml
    unmarked). None when there is none, or it is bigtrain's."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file() or read_run_id(run_dir) is not None:
        return None
    try:
        with open(path, errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    return None if first == CONFIG_HEADER else path


def users_config_problem(run_dir: Path, overwrite: bool = False, writer: str = "the run") -> str | None:
    """The refusal, before launch, of an ``--output-dir`` that holds a config.toml the user wrote
    (:func:`users_config`), naming the fix; None when it holds none. ``bigtrain train`` and
    ``bigtrain check`` both ask here: --overwrite removed it (the --config of this very run, even),
    and a fresh run or check wrote its resolved config over it. A file bigtrain did not write is
    neither removed nor replaced. ``writer``: who would write over it."""
    if users_config(run_dir) is None:
        return None
    run_dir = Path(run_dir)
    does = "--overwrite would remove it and " if overwrite else ""
    return (f"--output-dir = '{run_dir}' holds a config.toml that bigtrain did not write (yours: a --config, or "
            f"notes); {does}{writer} would write its resolved config over it; move it out of the folder (e.g. to "
            f"{run_dir.with_name(run_dir.name + '.toml')}, and give --config that path), or choose another "
            f"--output-dir")


def clear_run(run_dir: Path) -> list[str]:
    """Remove what a run wrote into ``run_dir`` (``--overwrite``); other files stay (a config.toml the
    user wrote too: :func:`check_run_dir` refused the run already). The names removed."""
    removed = []
    keep = users_config(run_dir)
    for name in RUN_OUTPUTS:
        path = Path(run_dir) / name
        if keep is not None and path == keep:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def record_stop(run_dir: Path, exit_code: int, message: str, step: int) -> None:
    _write_json(Path(run_dir) / STOP_FILE, {"exit_code": exit_code, "step": step, "message": message})


def recorded_exit_code(run_dir: Path) -> int | None:
    code = (_read_json(Path(run_dir) / STOP_FILE) or {}).get("exit_code")
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def forget_stop(run_dir: Path) -> None:
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def claim_run_dir(cfg, run_dir: Path, explicit_resume: bool, overwrite: bool) -> RunLock | None:
    """Own ``run_dir`` (:mod:`bigtrain.run_lock`) before anything is written into it, then check
    under the lock that this run may write there (:func:`check_run_dir`): a ConfigError names the
    run that holds it, or what the folder's state forbids (and what taking it created is removed).
    The lock, to release when the run ends; None for a rank that holds none."""
    rank = int(os.environ["RANK"]) if launched_externally() else 0
    lock, took = own_run_dir(Path(run_dir), rank, launched_by_bigtrain())
    try:
        # The process that took the folder verifies the files of what it resumes from too (every
        # checkpoint corrupt is refused here, before launch); the ranks its launcher starts need not.
        check_run_dir(cfg, run_dir, explicit_resume, overwrite, verify_files=took)
    except BaseException:
        if lock is not None:
            lock.release(remove_created=took)
        raise
    return lock


def check_run_dir(cfg, run_dir: Path, explicit_resume: bool, overwrite: bool,
                  verify_files: bool = False) -> tuple[Path, dict] | None:
    """Before launch: may this run write into ``run_dir``, and can what it resumes from serve it?
    Raises a ConfigError naming the flag or field and the fix; returns the checkpoint it would
    resume from (path, manifest), None for a fresh start. ``verify_files``: that checkpoint must
    pass its files' checksums too, not only its manifest's.

    Continuing the run the directory holds is the accepted path: ``--resume``, or
    ``checkpoint.resume = 'auto'`` (a restarted rank: ``train --config RUN/config.toml
    --output-dir RUN`` with resume 'auto'). A fresh start, or one from another run's checkpoint
    path, into a directory that holds a run is refused without ``--overwrite``.
    """
    import warnings

    from bigtrain.checkpoint.commit import ROLLBACK_RECORD, repeated_rollback, valid_checkpoints
    from bigtrain.checkpoint.compat import compare_configs
    from bigtrain.config import ConfigError

    run_dir = Path(run_dir)
    resume = cfg.checkpoint.resume
    if explicit_resume and overwrite:
        raise ConfigError("--resume continues the run in --output-dir and --overwrite replaces it: give one of them")
    root = run_dir / "checkpoints"
    source = root if resume == "auto" else Path(resume) if resume != "none" else None
    continuing = resume == "auto" or (source is not None and _inside(source, root))
    held = held_run(run_dir)
    if held is not None and not continuing and not overwrite:
        raise ConfigError(f"--output-dir = '{run_dir}' holds a run ({held}); continue it with --resume, choose "
                          f"another --output-dir, or pass --overwrite to replace it")
    if held is None and not continuing and (foreign := foreign_outputs(run_dir)):
        does = "--overwrite would remove them first" if overwrite else "the run would write over them"
        raise ConfigError(f"--output-dir = '{run_dir}' holds no bigtrain run (no {RUN_FILE}, no checkpoints or "
                          f"metrics of one) but files under the names a run writes: {', '.join(foreign)}; {does} "
                          f"(a folder of another program's checkpoints?); choose another --output-dir, or move "
                          f"them out of it")
    if not continuing and (problem := users_config_problem(run_dir, overwrite)) is not None:
        raise ConfigError(problem)
    if overwrite and not continuing and (used := inputs_among_outputs(cfg, run_dir)):
        raise ConfigError(f"--overwrite removes what a run wrote into '{run_dir}', and this run reads "
                          f"{'; '.join(used)} from there: it would be gone before the run reads it; copy it out of "
                          f"--output-dir first and name the copy, or choose another --output-dir")
    if overwrite and continuing and resume != "auto":
        # A path into the run's own checkpoints: --overwrite would remove it with the rest, and the
        # ranks would then stop on a path that is gone, the whole run lost.
        raise ConfigError(f"--overwrite removes {root}, which holds checkpoint.resume = '{resume}': leave out "
                          f"--overwrite to go on from it (a checkpoint of the run's own continues the run; its "
                          f"later checkpoints are removed), or copy it out of --output-dir first")
    if source is None or (overwrite and continuing):  # what it would continue is about to be removed
        return None
    if continuing and resume != "auto" and (again := repeated_rollback(root, source)) is not None:
        step, newest = again
        raise ConfigError(f"checkpoint.resume = '{resume}' rolls the run back to step {step} again: it rolled back to "
                          f"it before and has trained on since (newest: {newest}), which a roll-back removes (a "
                          f"requeued job whose command holds the roll-back?); continue with --resume "
                          f"(checkpoint.resume = 'auto'), or, to roll back to step {step} once more, remove "
                          f"{root / ROLLBACK_RECORD} first")
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always")
        found = next(valid_checkpoints(source, read_run_id(run_dir) if continuing else None, files=verify_files),
                     None)
    if found is None:
        if explicit_resume or resume != "auto" or list_checkpoints(source):
            why = "; ".join(str(w.message) for w in skipped) or f"no checkpoint under {source}"
            flag = "--resume" if explicit_resume else f"checkpoint.resume = '{resume}'"
            raise ConfigError(f"{flag}: nothing valid to resume from in '{source}' ({why}); give "
                              f"checkpoint.resume the path of a good checkpoint, or start a new run (another "
                              f"--output-dir, or --overwrite)")
        return None  # 'auto' with nothing saved yet: a fresh start (a first launch, or a restart before any save)
    path, meta = found
    errors, _ = compare_configs(meta.get("config", {}), cfg, path.name)
    if errors:
        raise ConfigError(errors)
    return found


def finished_run(run_dir: Path, cfg) -> str | None:
    """The line ``--resume`` prints for a run that has nothing left to train (its newest valid
    checkpoint is at or past ``train.steps`` and the config may resume it), None when it has, or
    when the checks before launch have something to say. Reads only: taking the folder's lock would
    already change it. The checkpoint's files are verified: a corrupt one finishes nothing."""
    import warnings

    from bigtrain.checkpoint.commit import valid_checkpoints
    from bigtrain.checkpoint.compat import compare_configs

    steps = cfg.train.steps
    with warnings.catch_warnings():  # a corrupt one is skipped here and named by the checks after
        warnings.simplefilter("ignore")
        found = next(valid_checkpoints(Path(run_dir) / "checkpoints", read_run_id(run_dir)), None)
    if found is None or not isinstance(found[1].get("step"), int) or found[1]["step"] < steps:
        return None
    if compare_configs(found[1].get("config", {}), cfg, found[0].name)[0]:
        return None  # another model: refused, naming the fields, by check_run_dir
    step = found[1]["step"]
    return (f"bigtrain: {run_dir} is finished: {found[0].name} holds step {step} of train.steps = {steps}; "
            f"nothing to do (to train further: --resume --train.steps=N with N > {step})")


def inputs_among_outputs(cfg, run_dir: Path) -> list[str]:
    """The inputs of ``cfg`` (``field = path``) that lie among what ``--overwrite`` removes from
    ``run_dir`` (:data:`RUN_OUTPUTS`: the earlier run's tokenizer copy, say, given as
    data.tokenizer to train the new run with the same one)."""
    from bigtrain.data.blend_spec import parse_blend

    named = [("data.tokenizer", cfg.data.tokenizer), ("data.source", cfg.data.source),
             ("data.val_source", cfg.data.val_source), ("model.init_from", cfg.model.init_from),
             ("model.hf_config", cfg.model.hf_config)]
    if cfg.data.blend:
        try:
            named += [("data.blend", path) for path, _ in parse_blend(cfg.data.blend)]
        except ValueError:
            pass  # validation names it
    outputs = [Path(run_dir) / name for name in RUN_OUTPUTS]
    out = []
    for field_name, value in named:
        text = str(value or "").removeprefix("hf:")
        if text and os.path.lexists(Path(text).expanduser()) and any(
                _inside(Path(text).expanduser(), output) for output in outputs if os.path.lexists(output)):
            out.append(f"{field_name} = '{value}'")
    return out


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, ValueError):
        return False


SHARED_CHECK_FILE = ".shared-check-"  # + a fresh token: written by rank 0, removed by it once every rank looked
SHARED_CHECK_WAIT_S = 3.0  # how long a rank looks for it: a network filesystem may show a new file late


def check_shared_run_dir(run_dir: Path, world, device, wait_s: float = SHARED_CHECK_WAIT_S) -> tuple[bool, str | None]:
    """Whether every rank sees the run directory rank 0 writes into; collective over ``world``
    (the mesh's "world" axis), once the group has formed and before anything trains.

    Every rank writes its part of each checkpoint into ``run_dir/checkpoints`` and rank 0 commits it
    (checksums, manifest): a folder that is not shared (node-local disks, the same relative path on
    each machine) would commit checkpoints that lack the other machines' files, and train on with
    nothing resumable. Rank 0 writes a file with a fresh token, every rank reads it back.
    ``wait_s``: how long a rank that does not see the file looks again (keep it below the group's
    timeout: rank 0 waits for it in the gather that follows).
    Returns (stop, message): ``stop`` on every rank when any rank did not see it; ``message`` (the
    error to raise) on rank 0 and on the ranks that did not see it, None on the others."""
    import socket

    import torch

    if world.size == 1:
        return False, None
    run_dir = Path(run_dir)
    token = uuid.uuid4().hex if world.rank == 0 else ""
    written = None
    if world.rank == 0:
        marker = run_dir / f"{SHARED_CHECK_FILE}{token}"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, token)
        except (OSError, RunDirWriteError) as e:
            written = str(e)
    sent = torch.zeros(32, dtype=torch.uint8, device=device)  # rank 0's token; all zeros: it could not write it
    if written is None and world.rank == 0:
        sent.copy_(torch.tensor(list(token.encode()), dtype=torch.uint8))
    world.broadcast(sent, 0, tag="run_dir")
    token = bytes(sent.tolist()).decode() if sent.any() else None
    # A name never used before: an NFS client may trust a cached "no such file" for a name it
    # looked up lately (the previous check's) for up to 30 s.
    marker = run_dir / f"{SHARED_CHECK_FILE}{token}"
    seen, deadline = False, time.monotonic() + wait_s
    while token is not None and not seen:
        try:
            seen = marker.read_text() == token
        except (OSError, UnicodeDecodeError):
            pass
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    views = world.gather_objects((seen, socket.gethostname(), str(run_dir.absolute())))
    failed = torch.zeros(1, device=device)
    message = None
    if world.rank == 0:
        marker.unlink(missing_ok=True)
        if written is not None:
            message = f"--output-dir = '{run_dir}': rank 0 could not write into it: {written}"
        elif blind := [r for r, (ok, _, _) in enumerate(views) if not ok]:
            places: dict[tuple[str, str], list[int]] = {}  # (host, folder): its ranks, one entry a machine
            for r in blind:
                places.setdefault(views[r][1:], []).append(r)
            where = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {host} ({path})"
                              for (host, path), ranks in places.items())
            message = (f"--output-dir = '{run_dir}' is not one folder for every rank: {where} "
                       f"{'does' if len(blind) == 1 else 'do'} not see the file that rank 0 on {views[0][1]} wrote "
                       f"into {run_dir.absolute()}; every rank writes its part of each checkpoint there, so the run "
                       f"directory must be on a filesystem that every machine shares: give --output-dir a path on "
                       f"one (NFS, Lustre, ...) that names the same folder on every machine")
        failed += 1 if message else 0
    elif not seen and token is not None:
        message = (f"rank {world.rank} on {socket.gethostname()}: --output-dir = '{run_dir}' "
                   f"({run_dir.absolute()}) is not the folder rank 0 writes into (rank 0 names the ranks and the "
                   f"fix)")
    world.max(failed, tag="run_dir")
    return bool(failed.item()), message
