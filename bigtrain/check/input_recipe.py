"""What one hostile input is: a :class:`Case`, the recipe :mod:`bigtrain.check.input_cases` draws and
:mod:`bigtrain.check.fuzz_inputs` runs, and the tiny preset's facts the recipes build on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Build = Callable[[Path], tuple[list[str], dict[str, str | None]]]
NEED = 34  # the tiny preset's data.seq_len (32) + 2: the shortest corpus the sampler takes
SEED_MAX = (2**64 - 2**32) // 1_000_003
INT64 = 2**63


@dataclass
class Case:
    """One invocation that must be rejected: ``build`` writes what it needs into its folder and returns
    the command line and the environment changes; the rejection must name one of ``names``."""

    kind: str
    name: str
    names: tuple[str, ...]  # the message must contain one of these
    build: Build
    command: str = "train"
    uses_preset: bool = True

    def label(self) -> str:
        return f"{self.command}:{self.kind}:{self.name}"


def fixed_args(*overrides: str, env: dict[str, str | None] | None = None) -> Build:
    """A build that writes nothing: these command-line arguments and environment changes."""
    return lambda folder: (list(overrides), dict(env or {}))
