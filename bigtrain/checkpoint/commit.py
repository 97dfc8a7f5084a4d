"""The commit protocol: a checkpoint counts only once its manifest is written, fsynced and checksummed.

A checkpoint is a directory ``step_00000010/``. Its files are written into ``step_00000010.tmp``
(by one process, or by every rank in parallel for the sharded format), flushed to disk; then one
process writes ``meta.json``, the manifest (step, config, the run's id, and a SHA-256 of every
file), fsyncs it and the directory, and renames the directory into place in one step. A crash
leaves at worst a ``.tmp`` directory that loading ignores and the next run removes
(:func:`remove_temp_dirs`). Rotation keeps the newest K up to the step committed.

The manifest is trusted no more than the files: it carries a checksum of itself (so an edited step
or a deleted checksum map is found), may name only the files this code writes (no ``..``, no
absolute path, no subfolder), and every file is opened as a regular file, never through a link, a
FIFO or a device (``/dev/zero`` listed in it would be read forever). Only ``step_<digits>``
folders are checkpoints: a stray ``step_latest``, and a link or a file under a checkpoint's name, are
ignored by listing and by rotation (a save replaces a file or link in its way).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

PREFIX = "step_"
MANIFEST = "meta.json"
_CHECKPOINT_NAME = re.compile(r"step_(\d+)")
_TEMP_NAME = re.compile(r"step_\d+\.tmp.*")
# What a checkpoint may hold: DCP's metadata and per-rank files, and the small torch.save files of
# :func:`save_checkpoint`. One path component each: nothing outside the checkpoint can be named.
_KNOWN_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp|[A-Za-z0-9_-]+\.pt")
_MANIFEST_MAX_BYTES = 64 << 20  # a manifest is config + checksums: kilobytes; refuse a runaway file


class CorruptCheckpoint(RuntimeError):
    pass


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the partial one was removed (exit 1)."""


def _open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file, without following a link and
    without blocking on a FIFO (``O_NONBLOCK``); raises CorruptCheckpoint otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path.parent}: missing {path.name}") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise CorruptCheckpoint(f"{path.parent}: {path.name} cannot be opened as a plain file ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpoint(f"{path.parent}: {path.name} is not a regular file (a FIFO, device or socket)")
    return fd


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with os.fdopen(_open_regular(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_digest(meta: dict[str, Any]) -> str:
    """The checksum of a manifest's content (everything but the checksum itself)."""
    body = {k: v for k, v in meta.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint folder's name says (None for any other name)."""
    match = _CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root`` (folders named ``step_<digits>``, not links: a save never
    makes one, and rotation must not delete what one points to), newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=checkpoint_step, reverse=True)


def _remove(path: Path) -> None:
    """Whatever is at ``path`` (a folder, a file, a link: never what a link points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def temp_dir(root: Path, step: int) -> Path:
    """Where checkpoint ``step`` is written before it is committed: one name every rank agrees on."""
    return root / f"{PREFIX}{step:08d}.tmp"


def fresh_temp_dir(root: Path, step: int) -> Path:
    """:func:`temp_dir`, emptied of what an earlier crashed save may have left there."""
    tmp = temp_dir(root, step)
    _remove(tmp)
    tmp.mkdir(parents=True)
    return tmp


def remove_temp_dirs(root: Path) -> list[str]:
    """Remove the ``step_*.tmp*`` folders that crashed or interrupted saves left under ``root``
    (they can hold a whole checkpoint's bytes, and after a full disk keep it full); their names."""
    if not root.is_dir():
        return []
    removed = []
    for path in root.iterdir():
        if _TEMP_NAME.fullmatch(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it, or a rank's failure inside DCP's CheckpointException)
    is an OSError for a full disk or quota."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


def checkpoint_files(tmp: Path, step: int) -> list[str]:
    """The names of the files under ``tmp`` (a checkpoint being written), sorted; raises ValueError
    for a file the manifest cannot list."""
    names = []
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(tmp))
            if not _KNOWN_FILE.fullmatch(name):
                raise ValueError(f"checkpoint {step}: unexpected file {name!r} in {tmp}; the manifest lists "
                                 f"only DCP's files and *.pt")
            names.append(name)
    return names


def file_checksums(tmp: Path, step: int, share: tuple[int, int] = (0, 1)) -> dict[str, str]:
    """Each file's SHA-256 under ``tmp``, once it is on disk (fsynced: other processes wrote it);
    with ``share = (i, n)`` the i-th of every n files in name order only (the ranks of a save
    checksum it together, as they verify it on resume: :func:`verify_files`)."""
    index, count = share
    checksums = {}
    for name in checkpoint_files(tmp, step)[index::count]:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
        checksums[name] = _sha256(tmp / name)
    return checksums


def commit_checkpoint(root: Path, step: int, tmp: Path, meta: dict[str, Any], keep: int,
                      checksums: dict[str, str] | None = None) -> Path:
    """Write and fsync the manifest ``meta.json`` of the files under ``tmp`` (itself checksummed)
    with their ``checksums`` (None: computed here, every file: :func:`file_checksums`), rename
    ``tmp`` to ``step_<step>`` and keep the newest ``keep`` checkpoints. Call once every file is
    written."""
    missing = _missing_parts(tmp)
    if missing:
        raise ValueError(f"checkpoint {step}: {tmp} lacks {', '.join(missing[:4])}"
                         f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}, which its .metadata "
                         f"says other ranks wrote: the ranks wrote into different folders (a run directory that is "
                         f"not on a filesystem every machine shares?)")
    if checksums is None:
        checksums = file_checksums(tmp, step)
    elif sorted(checksums) != (held := checkpoint_files(tmp, step)):
        raise ValueError(f"checkpoint {step}: the ranks checksummed {len(checksums)} files and {tmp} holds "
                         f"{len(held)}: the ranks listed different folders")
    manifest = {**meta, "step": step, "sha256": dict(sorted(checksums.items()))}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / f"{PREFIX}{step:08d}"
    # Re-saving the same step (a resumed run ending where it started), or a stray file or link under
    # its name, which nothing lists as a checkpoint: replaced, or every resume would die here.
    _remove(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    # The newest ``keep`` up to this step: later ones (a resumed run's fall-back past newer checkpoints
    # that did not verify or load) are not counted, or they would rotate the run's new saves away.
    for old in [p for p in list_checkpoints(root) if checkpoint_step(p) <= step][keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _missing_parts(tmp: Path) -> list[str]:
    """The files that DCP's ``.metadata`` in ``tmp`` names and ``tmp`` does not hold: every rank
    wrote its file, but into a folder that is not this one (ranks on machines that do not share
    the run directory). A checkpoint committed without them verifies and never loads."""
    if not (tmp / ".metadata").is_file():  # a single-process checkpoint (*.pt): nothing names other files
        return []
    from torch.distributed.checkpoint import FileSystemReader

    named = {info.relative_path for info in FileSystemReader(tmp).read_metadata().storage_data.values()}
    return sorted(name for name in named if not (tmp / name).is_file())


def is_checkpoint_of(root: Path, path: Path) -> bool:
    """Whether the checkpoint ``path`` is one of ``root``'s (the run's own, not another folder's)."""
    try:
        return Path(path).resolve().parent == Path(root).resolve()
    except OSError:
        return False


ROLLBACK_RECORD = "rolled_back.json"  # under checkpoints/: the run's last roll-back (not a step_* name: never listed)


def record_rollback(root: Path, resumed: Path) -> None:
    """Note that the run rolled back to its own checkpoint ``resumed`` (:func:`repeated_rollback`)."""
    tmp = root / f".{ROLLBACK_RECORD}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"checkpoint": resumed.name, "step": checkpoint_step(resumed)}))
    os.replace(tmp, root / ROLLBACK_RECORD)


def repeated_rollback(root: Path, resumed: Path) -> tuple[int, str] | None:
    """(step, newest checkpoint's name) when ``resumed`` is the checkpoint the run already rolled back to
    and went on from (a checkpoint of a later step exists): a job script with the roll-back in it,
    requeued, would roll it back again and remove what it trained since. None otherwise."""
    try:
        record = json.loads((root / ROLLBACK_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("checkpoint") != Path(resumed).name:
        return None
    later = [p for p in list_checkpoints(root) if checkpoint_step(p) > checkpoint_step(Path(resumed))]
    return (checkpoint_step(Path(resumed)), later[0].name) if later else None


def remove_later_checkpoints(root: Path, step: int) -> list[str]:
    """Remove the checkpoints under ``root`` of steps after ``step`` (a timeline a run rolled back to
    ``step`` left: the next 'auto' resume would load them); their names."""
    later = [p for p in list_checkpoints(root) if checkpoint_step(p) > step]
    for path in later:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in later]


def save_checkpoint(root: Path, step: int, files: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Atomically write small objects ``files`` ({'extra.pt': obj, ...}) with ``torch.save`` as
    checkpoint ``step``, through the same commit as the sharded format; keep the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = fresh_temp_dir(root, step)
    for name, obj in files.items():
        with open(tmp / name, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    return commit_checkpoint(root, step, tmp, meta, keep)


def read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json`` after checking it: a regular file, its own checksum, a checksum
    map naming only files a checkpoint holds, and the step its folder's name says."""
    fd = _open_regular(path / MANIFEST)
    with os.fdopen(fd, "rb") as f:
        text = f.read(_MANIFEST_MAX_BYTES + 1)
    if len(text) > _MANIFEST_MAX_BYTES:
        raise CorruptCheckpoint(f"{path}: {MANIFEST} is larger than {_MANIFEST_MAX_BYTES >> 20} MiB")
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise CorruptCheckpoint(f"{path}: unreadable {MANIFEST} ({e})") from None
    if not isinstance(meta, dict) or "manifest_sha256" not in meta:
        raise CorruptCheckpoint(f"{path}: {MANIFEST} has no manifest checksum (edited, or written by an older "
                                f"bigtrain)")
    if meta["manifest_sha256"] != _manifest_digest(meta):
        raise CorruptCheckpoint(f"{path}: {MANIFEST} was modified after it was written (its checksum does not match)")
    checksums = meta.get("sha256")
    if not isinstance(checksums, dict) or not checksums:
        raise CorruptCheckpoint(f"{path}: {MANIFEST} lists no file checksums")
    for name, digest in checksums.items():
        if not isinstance(name, str) or not _KNOWN_FILE.fullmatch(name) or not isinstance(digest, str):
            raise CorruptCheckpoint(f"{path}: {MANIFEST} lists {name!r}, which is not a checkpoint file's name")
    named = checkpoint_step(path)
    if not isinstance(meta.get("step"), int) or (named is not None and meta["step"] != named):
        raise CorruptCheckpoint(f"{path}: {MANIFEST} says step {meta.get('step')!r} but the folder is step {named}")
    return meta


def verify_checkpoint(path: Path, files: bool = True) -> dict[str, Any]:
    """The checkpoint's manifest after checking it and (``files``) every file's checksum; raises
    CorruptCheckpoint."""
    meta = read_manifest(path)
    if files:
        verify_files(path, meta)
    return meta


def verify_files(path: Path, meta: dict[str, Any], share: tuple[int, int] = (0, 1)) -> None:
    """Check the files of the checkpoint at ``path`` against its (read) manifest ``meta``: with
    ``share = (i, n)`` only the i-th of every n of its files in name order (n ranks verify a
    checkpoint together, each reading its share once). Raises CorruptCheckpoint."""
    index, count = share
    for name in sorted(meta["sha256"])[index::count]:
        if _sha256(path / name) != meta["sha256"][name]:
            raise CorruptCheckpoint(f"{path}: checksum mismatch in {name}")


def valid_checkpoints(root_or_path: Path, run_id: str | None = None, files: bool = True
                      ) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The checkpoints that verify, newest first (a path to one checkpoint is checked as it is),
    each with its manifest; corrupt ones, and ones another run wrote (``run_id`` given, and their
    manifest names another), are skipped with a warning."""
    root_or_path = Path(root_or_path)
    one = os.path.lexists(root_or_path / MANIFEST)
    for path in [root_or_path] if one else list_checkpoints(root_or_path):
        try:
            meta = verify_checkpoint(path, files)
        except CorruptCheckpoint as e:
            warnings.warn(f"skipping corrupt checkpoint: {e}", stacklevel=2)
            continue
        if run_id is not None and meta.get("run_id") not in (None, run_id):
            warnings.warn(f"skipping checkpoint {path}: written by another run (run id {meta['run_id']}, "
                          f"this run is {run_id})", stacklevel=2)
            continue
        yield path, meta


def newest_valid_checkpoint(root_or_path: Path, run_id: str | None = None,
                            files: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (see :func:`valid_checkpoints`)."""
    return next(valid_checkpoints(root_or_path, run_id, files), None)


def load_file(path: Path, name: str) -> Any:
    return torch.load(path / name, map_location="cpu", weights_only=True)
