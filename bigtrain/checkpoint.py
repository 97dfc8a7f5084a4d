"""Checkpoints that survive crashes and load into any layout.

A checkpoint is a directory ``step_00000010/`` holding ``model.pt`` (full tensors by parameter
name), ``optimizer.pt`` (per-parameter state by name) and ``meta.json`` (step, config, and a SHA-256
of every file). Tensors are stored unsharded and keyed by name, so a later run with another layout
can load them. A save is written into a temporary directory, flushed to disk, and renamed into place
in one step; a crash leaves at worst a ``.tmp`` directory that loading ignores. Loading verifies the
checksums and falls back to the next-newest checkpoint, with a warning, when one is corrupt.
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
from torch import nn

from bigtrain.optim import OptimizerSpec, load_state

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


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> dict[str, Any]:
    """Optimizer state keyed by parameter name instead of position, so it survives re-layouts;
    each entry holds exactly the state ``spec`` declares (checked)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for p, s in optimizer.state.items():
        if not s:  # an entry torch's defaultdict made on a look-up: no state yet
            continue
        spec.check_state(s, f"the optimizer's state of {names[id(p)]}")
        state[names[id(p)]] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
    return {"optimizer": spec.name, "state": state}


def load_optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, spec: OptimizerSpec,
                                 saved: dict[str, Any]) -> None:
    params = dict(model.named_parameters())
    entries = spec.saved_state(saved)
    # Another pipeline stage's weights are not this model's: skipped. Copies: no two parameters, nor the
    # caller's dict, may share a state tensor that the optimizer updates in place.
    load_state(optimizer, {params[name]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                           for name, s in entries.items() if name in params})


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and ".tmp" not in p.name]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def save_checkpoint(root: Path, step: int, files: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Atomically write ``files`` ({'model.pt': obj, ...}) as checkpoint ``step``; keep the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    checksums = {}
    for name, obj in files.items():
        path = tmp / name
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        checksums[name] = _sha256(path)
    with open(tmp / "meta.json", "w") as f:
        json.dump({**meta, "step": step, "sha256": checksums}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. a resumed run ending where it started)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
