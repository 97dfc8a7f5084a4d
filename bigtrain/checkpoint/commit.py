"""The commit protocol: a checkpoint counts only once its manifest is written, fsynced and checksummed.

A checkpoint is a directory ``step_00000010/``. Its files are written into ``step_00000010.tmp``
(by one process, or by every rank in parallel for the sharded format), flushed to disk; then one
process writes ``meta.json``, the manifest (step, config, and a SHA-256 of every file), fsyncs it
and the directory, and renames the directory into place in one step. A crash leaves at worst a
``.tmp`` directory that loading ignores. Loading verifies the checksums and falls back to the
next-newest checkpoint, with a warning, when one is corrupt. Rotation keeps the newest K.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

PREFIX = "step_"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and ".tmp" not in p.name]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def temp_dir(root: Path, step: int) -> Path:
    """Where checkpoint ``step`` is written before it is committed: one name every rank agrees on."""
    return root / f"{PREFIX}{step:08d}.tmp"


def fresh_temp_dir(root: Path, step: int) -> Path:
    """:func:`temp_dir`, emptied of what an earlier crashed save may have left there."""
    tmp = temp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(root: Path, step: int, tmp: Path, meta: dict[str, Any], keep: int) -> Path:
    """Checksum every file under ``tmp``, write and fsync the manifest ``meta.json``, rename ``tmp``
    to ``step_<step>`` and keep the newest ``keep`` checkpoints. Call once every file is written."""
    checksums = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:  # written by other processes: make sure they are on disk
                os.fsync(f.fileno())
            checksums[str(path.relative_to(tmp))] = _sha256(path)
    with open(tmp / "meta.json", "w") as f:
        json.dump({**meta, "step": step, "sha256": checksums}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / f"{PREFIX}{step:08d}"
    if final.exists():  # re-saving the same step (e.g. a resumed run ending where it started)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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


class CorruptCheckpoint(RuntimeError):
    pass


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's meta after checking every file's checksum; raises CorruptCheckpoint."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path}: unreadable meta.json ({e})") from None
    for name, expected in meta.get("sha256", {}).items():
        file = path / name
        if not file.exists():
            raise CorruptCheckpoint(f"{path}: missing {name}")
        if _sha256(file) != expected:
            raise CorruptCheckpoint(f"{path}: checksum mismatch in {name}")
    return meta


def newest_valid_checkpoint(root_or_path: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (a path to one checkpoint is checked as it is)."""
    candidates = [root_or_path] if (root_or_path / "meta.json").exists() else list_checkpoints(root_or_path)
    for path in candidates:
        try:
            return path, verify_checkpoint(path)
        except CorruptCheckpoint as e:
            warnings.warn(f"skipping corrupt checkpoint: {e}", stacklevel=2)
    return None


def load_file(path: Path, name: str) -> Any:
    return torch.load(path / name, map_location="cpu", weights_only=True)
