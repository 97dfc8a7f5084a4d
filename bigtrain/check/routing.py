"""MoE routing in bf16/fp16: where a correct layout's gradient norm parts from the reference's.

A router picks each token's top-k experts (and the capacity rule which routings it keeps): a
discontinuous function of the token's hidden state. In bf16 a layout's hidden states differ from
the reference's by bf16 rounding (a tensor-parallel linear sums its parts rounded to bf16, the
reference sums in fp32 and rounds once), and a token whose router scores lie within that rounding
of a tie goes to another expert: its share of the gradient changes by a whole expert's
contribution, not by rounding. The reference's own step at the layout's weights (and router
biases) routes a few tokens otherwise, and how much that moves the gradient norm depends on how
many scores sit near a tie, a property of the router's state, not of the layout: measured on fuzz
seed 20261470 sample 5 (tiny, 6 blocks of 4 experts, top-3, sigmoid-bias router, tp 4): 1 to 6 of
768 routings per block flipped at step 1 with the norm 1.5e-3 off, and after the routers saturate
(one expert left with 1 of 256 routings by step 5) the reference recomputed at the layout's own
weights and biases 2.5e-2 from the layout's norm, while the same sample in fp32 stays within
1e-5 of the reference at every step, and its loss in bf16 within 2e-4.

How far rounding alone moves that norm is measured, not assumed (:func:`rounding_sensitivity`): the
reference recomputes the step at the layout's weights each multiplied by 1 + N(0, eps / 8) (eps of
the compute dtype: about one bf16 weight in seven moves to its neighbouring value), a few times. On
the sample above that moved the reference's own norm by 1e-4 to 2.8e-3 at steps 1 to 4 (each time
routing some tokens otherwise) and by 1.4e-3, 2.3e-2, 5.0e-2 and 1.0e-1 at step 5.

So in bf16/fp16 a gradient norm over its bound, recomputed at the layout's weights (check/run.py's
``_norm_recomputed``), is no divergence where that recomputation's routing differs from the
layout's (:func:`routing_parted`) and the layout's norm is within ``SENSITIVITY_FACTOR`` times the
largest of those moves: reported with the blocks that routed otherwise, while the loss keeps
deciding. Where the routing is the same, or the norm is further than rounding moves it, the norm
decides at its bound; and the fp32 layouts the fuzzer draws hold the same routing code to 1e-5.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from bigtrain.check.compare import scalar_error
from bigtrain.parallel.parallel_model import persistent_buffers

# Perturbed recomputations, and how far beyond the largest of their moves a layout's norm may be:
# the layout's own rounding is one more such draw, and three draws can miss the largest move.
SENSITIVITY_SAMPLES = 3
SENSITIVITY_FACTOR = 2.0


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's model state outside the parameters that a step moves (a sigmoid-bias router's
    bias), on the CPU by name: what the reference needs, besides the weights, to recompute a step
    at a layout's state (the names of the pipeline stage's model are the whole model's)."""
    return {name: b.detach().cpu().clone() for name, b in persistent_buffers(model).items()}


def routing_parted(layout: dict[str, dict], reference: dict[str, list[int]]) -> str | None:
    """The blocks whose routings per expert differ between a layout's step (``StepResult.moe``) and
    the reference's at the same weights (``ReferenceStep.routing``), said; None where every block
    the reference counted routed alike, or where the two do not name the same blocks (nothing then
    shows a flip)."""
    if not reference or set(reference) != set(layout):
        return None
    parted = [f"{name} {layout[name]['load']} against {load}" for name, load in reference.items()
              if list(layout[name]["load"]) != list(load)]
    return "; ".join(parted) or None


def rounding_sensitivity(reference, weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor], norm: float,
                         compute_dtype: torch.dtype) -> float:
    """The largest relative move of the gradient norm ``norm`` (the ``reference``'s step at the
    layout's ``weights`` and ``state``) over :data:`SENSITIVITY_SAMPLES` recomputations at those
    weights, each multiplied by 1 + N(0, eps / 8) of ``compute_dtype`` (seeded: the same every
    check). ``reference``: as it was before the step (copied, left unchanged)."""
    sigma = torch.finfo(compute_dtype).eps / 8
    largest = 0.0
    for seed in range(SENSITIVITY_SAMPLES):
        g = torch.Generator().manual_seed(seed)
        moved = {n: t * (1 + sigma * torch.randn(t.shape, generator=g, dtype=t.dtype)) if t.is_floating_point() else t
                 for n, t in weights.items()}
        again = copy.deepcopy(reference)
        if not again.at_weights(moved, state):
            return 0.0
        largest = max(largest, scalar_error(again.train_step().grad_norm, norm))
    return largest
