"""Telling fp32's own rounding from a layout bug, with a float64 twin of the reference.

The fp32 bound on single tensors (1e-4 relative, :mod:`bigtrain.check.compare`) assumes a tensor
that fp32 computes to about that accuracy. Some it does not: a top-2 router's gradient sums terms
that nearly cancel (the two chosen probabilities are renormalized to one), so the fp32 reference
itself lands 1.0e-4 from the exact value at step 1 of the fuzzer's seed 20261303 sample 118 (MoE,
4 experts, tp = 4), and a layout that adds the same terms in another order lands as far on the
other side. Another fp32 order cannot be held closer to the reference than the reference is to the
truth.

So when a single tensor (a module output, a gradient, an updated weight) is over the bound, the
same reference loop is run in float64 from the same initial values and data
(the reference class's ``exact``: ``ReferenceRun(exact=True)``, the Hugging Face family's
in float64) and the tensor is judged against the exact value instead: the
layout's distance from it may be at most ``ROUNDING_FACTOR`` times the fp32 reference's own
distance from it (or the fixed bound, where that is larger). Both are one fp32 evaluation of the
same function in a different order; the factor leaves room for the layout's extra partial sums
(tensor-parallel shards, all-reduces). A missing or doubled reduction moves a tensor by tens of
percent, far beyond any tensor's rounding. The loss and the gradient norm keep their fixed bounds,
and the twin is built only when needed (for the first such finding), then stepped alongside.

Not for a config whose reference rounds on purpose (:func:`~bigtrain.check.reference.exact_problem`):
there the float64 loop would be another function, not the same one without rounding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from bigtrain.check.compare import relative_error
from bigtrain.check.reference import ReferenceStep, replay_to_checkpoint
from bigtrain.config import Config

# The layout may land this many times as far from the exact value as the fp32 reference does. The
# Hugging Face family's tests hold weights to the same 3x of the fp32 reference's distance from a
# float64 run (tests/test_hf_family.py), where the layouts measured within 1.5x.
ROUNDING_FACTOR = 3.0
SINGLE_TENSORS = ("forward", "gradient", "weight")
# A tensor the fp32 reference lands at least its own size away from the exact one (relative distance
# >= 1) has no correct digit in fp32: its exact value is below the rounding of its own sums (a softmax
# over equal scores, whose gradient is zero: the fuzzer's seed 20261454 sample 8), and both the
# reference and the layout hold rounding noise alone. How large one summation order's noise is
# against another's is no property of a layout (measured on the same sample: the layout's 1.5x the
# reference's on an AVX-512 Xeon, 4.8x on an AVX2 EPYC, whose kernels block their sums otherwise); a
# term a layout adds or drops (a lost partial sum of terms that cancel) is the size of the terms,
# about 1/eps = 1.7e7 times their rounding. Such a tensor may be ROUNDING_ALONE_FACTOR times as far
# from the exact value as the reference, which leaves five orders of magnitude below a lost term.
NO_CORRECT_DIGIT = 1.0
ROUNDING_ALONE_FACTOR = 100.0


class ExactTwin:
    """A family reference's loop in float64, built and stepped only when a finding asks for it.

    ``build``: makes the float64 reference (the reference class's ``exact(cfg, device)``; :meth:`of`
    gives no twin where the class's ``exact_problem`` names one). ``start``: the first compared step (a resumed
    check's reference replayed the steps before it); ``restart_delays``: that replay restarted an
    asynchronous pipeline's delays at ``start``, so the twin does too; ``saved_delay``: it replayed
    them with the delay of the run that saved the checkpoint (:func:`replay_to_checkpoint`)."""

    def __init__(self, build: Callable[[], object], start: int = 0, restart_delays: bool = False,
                 saved_delay: int | None = None):
        self.build, self.start, self.restart_delays = build, start, restart_delays
        self.saved_delay = saved_delay
        self.run = None
        self.captured: tuple[int, ReferenceStep] | None = None  # the last step asked for

    @staticmethod
    def of(reference_class, cfg: Config, device: torch.device | str, start: int = 0,
           restart_delays: bool = False, saved_delay: int | None = None) -> "ExactTwin | None":
        """The twin of ``reference_class``'s run of ``cfg``, or None where it has none."""
        exact = getattr(reference_class, "exact", None)
        problem = getattr(reference_class, "exact_problem", lambda _: None)
        if exact is None or problem(cfg) is not None:
            return None
        return ExactTwin(lambda: exact(cfg, device), start, restart_delays, saved_delay)

    def step(self, step: int) -> ReferenceStep:
        """The exact reference's capture of ``step`` (the steps before it are run uncaptured)."""
        if self.captured is not None and self.captured[0] == step:
            return self.captured[1]
        if self.run is None:
            self.run = self.build()
            replay_to_checkpoint(self.run, self.start, self.saved_delay, self.restart_delays)
        while self.run.step < step:
            self.run.train_step()
        self.captured = (step, self.run.train_step(capture=True))
        return self.captured[1]


def rounding_distance(kind: str, name: str, fp32: ReferenceStep, exact: ReferenceStep) -> float:
    """How far the fp32 reference's ``kind`` tensor ``name`` is from the exact one (inf: not held)."""
    held = {"forward": (fp32.outputs, exact.outputs), "gradient": (fp32.grads, exact.grads),
            "weight": (fp32.weights, exact.weights)}[kind]
    if name not in held[0] or name not in held[1]:
        return float("inf")
    return relative_error(held[0][name], held[1][name])


def judge_against_exact(findings: list, against_exact: list, fp32: ReferenceStep, exact: ReferenceStep,
                        aliases: dict[str, str], bound: float) -> tuple[list, list]:
    """(the findings that stand, those within fp32's rounding), each of the latter with a detail
    naming both distances. ``against_exact``: the same comparisons of the layout with the exact
    step; ``aliases``: the layout's copies of a weight under another name."""
    layout_error = {(m.kind, m.name): m.error for m in against_exact}
    stand, rounding = [], []
    for f in findings:
        if f.kind not in SINGLE_TENSORS or (f.kind, f.name) not in layout_error:
            stand.append(f)
            continue
        name = aliases.get(f.name, f.name)
        own = rounding_distance(f.kind, name, fp32, exact)
        mine = layout_error[(f.kind, f.name)]
        # A tensor the fp32 reference computes with no correct digit is rounding alone on both sides.
        factor = ROUNDING_ALONE_FACTOR if NO_CORRECT_DIGIT <= own < float("inf") else ROUNDING_FACTOR
        detail = (f"from the float64 reference: layout {mine:.2e}, fp32 reference {own:.2e}"
                  f"{' (no correct digit: rounding alone)' if factor == ROUNDING_ALONE_FACTOR else ''}; "
                  f"bound max({bound:.0e}, {factor:g} x {own:.2e})")
        allowed = max(bound, factor * own) if own != float("inf") else bound
        (rounding if mine <= allowed else stand).append(replace(f, detail=detail))
    return stand, rounding

