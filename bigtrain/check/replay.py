"""Each AdamW step of a layout (8-bit or not, in any compute precision: the step itself is fp32),
replayed by the reference from the layout's own inputs.

Run freely, a layout and the reference part ways in 8-bit state: a gradient a rounding error away
from the reference's can put a moment on the other side of a code boundary, one code step (up to
10% of that element) away, and from then on the two runs carry different states (measured: 2 to 30
of 131,392 codes after 1 to 6 steps of the tiny model, at one process and at tp=2 alike). So the
free run compares loss and gradient norm at fp32's 1e-5 but single tensors loosely, and this module
gives the state its fp32 bound: at every step the reference's 8-bit AdamW
(:func:`~bigtrain.check.reference_optim.replay_adamw8bit`) takes the step from the layout's full
weights and state before it and the layout's reduced gradient, and what the layout holds after it
must equal what the replay made, within 1e-5:

- every weight (relative difference of the tensor): the update reads the fp32 moments, not the codes,
  so the two differ by the rounding of a few fp32 operations;
- the per-block scales (each block's largest fp32 moment), likewise;
- every code: one the reference gives to a value within 1e-5 of the replay's fp32 moment, where
  1e-5 is relative to the terms the moment was summed from (``b1 m + (1 - b1) g`` cancels: its
  rounding is relative to the terms, not the sum). A code outside that band counts as the distance
  of its value from the band's nearest code, relative to the tensor's moments: one code step on one
  element of the tiny model is ~1e-3, a hundred times the bound.
"""

from __future__ import annotations

import torch

from bigtrain.check.compare import relative_error
from bigtrain.check.reference_optim import code_values, codes_at, replay_adamw, replay_adamw8bit

BOUND = 1e-5  # relative, fp32: a few roundings of one step, far below one code step
# bigtrain's state names -> (the replay's codes, scales, fp32 moment, its terms, signed)
MOMENTS = {"exp_avg": ("m", "ms", "m32", "m_terms", True), "exp_avg_sq": ("v", "vs", "v32", "v_terms", False)}
SCALES = {"exp_avg_scale": "ms", "exp_avg_sq_scale": "vs"}


def code_error(codes: torch.Tensor, replay: dict, moment: str, block: int) -> tuple[float, int]:
    """(relative distance of ``codes`` from the codes the replay allows, number of codes outside)."""
    key, scale_key, value_key, terms_key, signed = MOMENTS[moment]
    value, slack, scale = replay[value_key], BOUND * replay[terms_key], replay[scale_key]
    low, high = codes_at(value - slack, scale, signed, block), codes_at(value + slack, scale, signed, block)
    codes = codes.reshape(-1).float()
    nearest = torch.minimum(torch.maximum(codes, low), high)
    outside = int((nearest != codes).sum())
    if not outside:
        return 0.0, 0
    distance = code_values(codes, scale, signed, block) - code_values(nearest, scale, signed, block)
    return float(distance.double().norm() / value.double().norm().clamp_min(1e-30)), outside


def replayed_step(before: tuple[dict, dict], grads: dict[str, torch.Tensor], after: tuple[dict, dict],
                  lr: float, optim) -> list[tuple[str, float, str]]:
    """(what, relative difference, detail) of every weight and state tensor the layout holds
    ``after`` a step from ``before`` (its full weights and optimizer state, ``full_state()``'s)
    with its reduced ``grads``, against the reference's replay of that step (8-bit or fp32 AdamW)."""
    max_norm = optim.grad_clip if optim.grad_clip > 0 else float("inf")
    if optim.name == "adamw":
        return _replayed_adamw(before, grads, after, lr, max_norm, optim)
    weights, state = replay_adamw8bit(before[0], before[1].get("state", {}), grads, lr, max_norm, optim)
    out = []
    for name, held, replay in _held_against_replay(weights, state, after, out, step_key="t"):
        for key, replay_key in SCALES.items():
            out.append((f"{name} {key}", relative_error(held[key].reshape(-1).float(), replay[replay_key]), ""))
        for key in MOMENTS:
            error, outside = code_error(held[key], replay, key, optim.block_size)
            out.append((f"{name} {key}", error, f"{outside} codes outside the rounding band" if outside else ""))
    return out


def _held_against_replay(weights: dict, state: dict, after: tuple[dict, dict], out: list, step_key: str):
    """For each replayed parameter the layout holds: append its weight's and step count's findings
    to ``out`` and yield (name, the layout's state, the replay's state) for the moments."""
    held_weights, held_state = after[0], after[1].get("state", {})
    for name, expected in weights.items():
        if name not in held_weights or name not in held_state:
            out.append((f"parameter {name}", float("inf"), "the layout holds no such weight or state"))
            continue
        out.append((f"parameter {name}", relative_error(held_weights[name].reshape(expected.shape), expected), ""))
        held, replay = held_state[name], state[name]
        t, r = float(held["step"]), float(replay[step_key])
        out.append((f"{name} step", 0.0 if t == r else float("inf"), f"layout {t:g}, replay {r:g}"))
        yield name, held, replay


def _replayed_adamw(before: tuple[dict, dict], grads: dict[str, torch.Tensor], after: tuple[dict, dict], lr: float,
                    max_norm: float, optim) -> list[tuple[str, float, str]]:
    """fp32 AdamW: the weights and both moments the layout holds after the step, against torch's
    AdamW stepping from the layout's own weights, moments and gradient: the same inputs, so they
    differ by the rounding of a few fp32 operations (one run's fused kernel, the other's loop)."""
    weights, state = replay_adamw(before[0], before[1].get("state", {}), grads, lr, max_norm, optim)
    out = []
    for name, held, replay in _held_against_replay(weights, state, after, out, step_key="step"):
        for key in ("exp_avg", "exp_avg_sq"):
            out.append((f"{name} {key}", relative_error(held[key].reshape(-1).float(), replay[key].reshape(-1)), ""))
    return out


def starts_fresh(state: dict) -> bool:
    """Whether a layout's AdamW state (``full_state()``'s) is what torch's first step starts from:
    none, or zero step counts and moments (an offloaded engine allocates them ahead of the step)."""
    return all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
               for s in state.get("state", {}).values())


def stepped_parameters(before: tuple[dict, dict], grads: dict[str, torch.Tensor], held: dict[str, torch.Tensor],
                       copies: dict[str, str]) -> set[str]:
    """The parameters a replay steps: those whose full weight the layout's state holds and whose
    reduced gradient it gathered (:func:`~bigtrain.check.reference_optim.replay_adamw`'s); and each
    copy of a tied weight (``copies``: {name: the weight it copies}; ``full_state`` holds the
    canonical name only) that the layout ``held`` after the step equal, within :data:`BOUND`, to
    the replayed weight it copies: a stale or wrongly updated copy is not among them, nor is a
    parameter without a gradient."""
    stepped = {n for n in before[0] if n in grads}
    return stepped | {n for n, c in copies.items() if c in stepped and n in held and c in held
                      and relative_error(held[n], held[c]) <= BOUND}


def updates_explained(findings: list, replayed: set[str], gradients: set[str]) -> tuple[list, list]:
    """(the findings that stand, the updated weights that the replay explains). Where every step so
    far replayed within its bound (the layout's optimizer is the reference's, applied to the
    layout's own gradient, weights and moments), a weight whose gradient was within its bound at
    every step can differ from the reference's only by the optimizer amplifying that gradient's
    rounding: Adam divides by sqrt(v) + eps, so an element whose gradient is near eps moves a
    sizeable part of the learning rate for a rounding error (the Hugging Face family's key biases:
    the softmax cancels them but through the rotary rotation, their gradient near 1e-8).

    Only a weight this step's replay stepped (``replayed``: :func:`stepped_parameters`) and whose
    gradient was compared (``gradients``: the names of this step's gradient measurements) is
    explained: a tied weight's copy, or a parameter the layout gathered no gradient for, was
    neither replayed nor compared, so nothing says its value is the optimizer's doing. A skipped
    step replays nothing and explains nothing."""
    if any(f.kind == "replayed" for f in findings):
        return findings, []
    off_gradients = {f.name for f in findings if f.kind == "gradient"}
    explained = [f for f in findings if f.kind == "weight" and f.name in replayed and f.name in gradients
                 and f.name not in off_gradients]
    return [f for f in findings if f not in explained], explained
