"""fp16's overflow boundary: the one place where a correct layout and the reference part by design.

With a dynamic loss scale kept at fp16's overflow (a scaler grows it until a step overflows), the
reference sums each micro-batch's gradient of a weight over all its tokens in fp16, while a layout
that cuts a micro-batch's tokens across ranks (context parallelism, Ulysses sp, Megatron sequence
parallelism on tp) sums each rank's part in fp16 and adds the parts in fp32. The whole sum can pass
fp16's 65,504 where no part does: the reference overflows and skips the step, the layout steps with
a finite, correct gradient (fuzz seed 20261128, docs/correctness.md). From there the two runs are
different runs, so nothing after that step can be compared.

:func:`overflow_boundary` names that case instead of reporting a divergence, and only where
everything else of the step agrees: its loss, its module outputs, every gradient the reference has
finite, and the replay of the layout's own update. A layout that overflows *earlier* than the
reference, or whose finite gradients differ, or that does not cut tokens, stays a divergence; so
does a gradient the layout has non-finite where the reference's overflowed.
"""

from __future__ import annotations

import torch

from bigtrain.check.report import Finding
from bigtrain.config import Config

# What the step's first divergence may hold at the boundary: the skip decision itself, the norm
# (the reference's is inf), the overflowed gradients, and the weights the layout updated and the
# reference did not.
_PARTED = ("skipped", "grad_norm", "gradient", "weight")


def token_cuts(cfg: Config) -> list[str]:
    """The axes over which this layout sums a micro-batch's tokens in parts ([] when none)."""
    p = cfg.parallel
    cuts = [f"parallel.cp = {p.cp}"] if p.cp > 1 else []
    cuts += [f"parallel.sp = {p.sp}"] if p.sp > 1 else []
    cuts += [f"parallel.tp = {p.tp} with sequence_parallel"] if p.tp > 1 and p.sequence_parallel else []
    return cuts


def overflow_boundary(cfg: Config, layout_skipped: bool, reference_skipped: bool, grads: dict[str, torch.Tensor],
                      reference_grads: dict[str, torch.Tensor], aliases: dict[str, str],
                      findings: list[Finding]) -> str | None:
    """Why the step whose ``findings`` (those over their bounds) these are is fp16's overflow
    boundary and no divergence, or None when it is not. ``grads``: the layout's full gradients by its
    parameter names (``aliases`` maps a copy's name to the reference's); ``reference_grads``: the
    reference's."""
    cuts = token_cuts(cfg)
    if cfg.precision.mode != "fp16" or not cuts or layout_skipped or not reference_skipped:
        return None
    overflowed = sorted(n for n, g in reference_grads.items() if not bool(torch.isfinite(g).all()))
    if not overflowed:
        return None
    mine = {aliases.get(n, n): g for n, g in grads.items()}
    if any(n not in mine or not bool(torch.isfinite(mine[n]).all()) for n in overflowed):
        return None  # the layout overflowed too, or lacks the gradient: not a boundary it stayed under
    for f in findings:
        if f.kind not in _PARTED or (f.kind == "gradient" and aliases.get(f.name, f.name) not in overflowed):
            return None  # something the boundary does not explain differs
    return (f"fp16's overflow boundary: the reference's gradient of {', '.join(overflowed)} overflowed and it "
            f"skipped the step, while this layout, which sums a micro-batch's tokens in parts ({'; '.join(cuts)}) "
            f"added in fp32, stayed finite and stepped; the step's loss, outputs and every gradient finite in the "
            f"reference agree. The runs part here by design, so the check stops (docs/correctness.md)")
