"""The whole-number arguments of ``bigtrain check`` and of its layout fuzzer
(``python -m bigtrain.check.fuzz``, ``scripts/fuzz-layouts.sh``), and the fuzzer's shares, each read
as text and held to a range, so that a bad value is one line naming the argument and its range:
argparse's ``int()`` took ``10**20`` (a check that never ends) and answered ``1e20`` or ``2.5`` with
its usage block, and its ``float()`` took a share of 1.5 or nan."""

from __future__ import annotations

STEPS_MAX = 10_000  # each compared step runs the layout and the single-process reference: hours at most
COUNT_MAX = 100_000  # layouts a fuzzer run samples: each starts its ranks and a reference (seconds to minutes)
SEED_MAX = 2**63 - 1  # a seed names its samples (same seed, same layouts): any whole number a log can carry
WORLD_MAX = 64  # the fuzzer starts every rank of a layout as a process on this machine


def whole_number(text: str, name: str, low: int, high: int, what: str = "") -> int:
    """``text`` as an int from ``low`` to ``high``; else a ValueError naming ``name`` (the argument)
    and the range of ``what`` it takes: not a whole number (1e20, 2.5, x), or out of the range."""
    try:
        value = int(str(text).strip().replace("_", ""))
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name} = {text!r}: give a whole number{' of ' + what if what else ''} from {low:,} to "
                         f"{high:,}")
    return value


def check_steps(text: str | None, name: str = "--steps") -> int | None:
    """``--steps`` (steps compared) as an int from 1 to :data:`STEPS_MAX`, None when not given;
    a ValueError naming the flag and its range for anything else."""
    return None if text is None else whole_number(text, name, 1, STEPS_MAX, "steps")


def share(text: str, name: str) -> float:
    """``text`` as a share from 0 to 1 (the probability a fuzzer's sample takes a choice); else a
    ValueError naming ``name`` (the argument): a share past 1 or below 0 is drawn always or never,
    and nan never, with no word said."""
    try:
        value = float(str(text).strip())
    except ValueError:
        value = None
    if value is None or not 0.0 <= value <= 1.0:  # nan fails both comparisons
        raise ValueError(f"{name} = {text!r}: give a share from 0 to 1 (the probability a sample takes it)")
    return value
