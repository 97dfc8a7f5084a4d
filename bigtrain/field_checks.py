"""Checks of one field's value that the validation rules share: > 0, >= 0, one of a set, a path that
exists, a directory this user can write. Each returns the problems it finds (dotted field, value, fix).

Imports no torch (as :mod:`bigtrain.validation`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from bigtrain.config import Config


def positive(cfg: Config, names: list[str]) -> list[str]:
    problems = []
    for dotted in names:
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if not (value > 0 and math.isfinite(value)):  # NaN fails every comparison: test the good case
            problems.append(f"{dotted} = {value}: must be > 0")
    return problems


def non_negative(cfg: Config, names: list[str]) -> list[str]:
    problems = []
    for dotted in names:
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if not (value >= 0 and math.isfinite(value)):
            problems.append(f"{dotted} = {value}: must be >= 0")
    return problems


def one_of(dotted: str, value: str, choices: tuple[str, ...]) -> list[str]:
    if value in choices:
        return []
    return [f"{dotted} = '{value}': must be one of {', '.join(repr(c) for c in choices)}"]


def path_exists(path: str, expand: bool = True) -> bool:
    """Like Path.exists, but False for names no file can have (too long, NUL) instead of raising."""
    try:
        return Path(os.path.expanduser(path) if expand else path).exists()
    except (OSError, ValueError):
        return False


def looked_in(path: str) -> str:
    """Where a relative ``path`` that was not found was looked for: the current folder. A run's
    config.toml keeps paths as they were given, so ``--resume`` (or ``--config``) from another
    folder looks for them there, and "no such file" named a file the user could see."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (a relative path, looked for in the current folder {os.getcwd()}: run from the folder it is relative to, or give it absolute)"


def writable_dir(field: str, path: str) -> list[str]:
    target = Path(os.path.expanduser(path))
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        return [f"{field} = '{path}': {probe} is not a directory this user can write; give a writable local "
                f"directory (a fast NVMe disk)"]
    return []



def step_window(text: str) -> tuple[int, int] | None:
    """'A-B' or 'A' -> the steps (A, B), inclusive, counted from 1 as the console counts them; '' ->
    None. ValueError on anything else."""
    text = text.strip()
    if not text:
        return None
    first, dash, last = text.partition("-")
    if dash and not last.strip():  # '5-': an end left out is no step
        raise ValueError(text)
    a, b = int(first), int(last) if last else int(first)
    if a < 1 or b < a:
        raise ValueError(text)
    return a, b


def step_window_problems(dotted: str, text: str, steps: int) -> list[str]:
    """What is wrong with a window of steps (:func:`step_window`) for a run of ``steps`` steps."""
    try:
        window = step_window(text)
    except ValueError:
        return [f"{dotted} = '{text}': give the steps as 'A-B' or 'A', counted from 1 as the console counts "
                f"them, e.g. '5-6' (not the first: it compiles and warms up)"]
    if window is not None and window[1] > steps:
        return [f"{dotted} = '{text}' goes past train.steps = {steps}: give steps up to {steps}"]
    return []
