"""Putting a layout's pieces back together and measuring how far they are from the reference.

A rank holds its part of a module's output: its data-parallel slice of the batch, its sequence
chunk (Ulysses over sp, Megatron sequence parallel over tp), or its vocabulary slice (the
tensor-parallel output head). :func:`assemble` rebuilds the global-batch tensor from every rank's
part and its mesh coordinates; a part it cannot place makes it return None (reported as "not
comparable", never as agreement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bigtrain.parallel.context import chunks_of


@dataclass(frozen=True)
class Tolerance:
    """Relative bounds, by what is compared.

    ``loss`` and ``grad_norm``: the per-step global loss and gradient norm. ``tensor``: each updated
    weight, each reduced gradient, each module's output. In fp32 the loss and gradient norm get 1e-5
    and single tensors 1e-4: Adam divides g by |g| + eps, so where |g| is near eps (1e-8) reduction
    order alone (1e-12 absolute) moves an element's update by a sizeable part of the learning rate;
    measured: every gradient within 1e-5 at step 0, one weight 3.4e-5 off after it, and the next
    step's activations 4.6e-5 off, the loss within 1e-7. In bf16/fp16 the loss over 20 steps stays
    within ~1e-4 of the bf16 reference (measured), so 1e-3 can still fail; the gradient norm and single
    tensors carry the rounding of bf16 reductions and of bf16 copies of drifting weights: the norm
    up to 2.3e-3, but single gradients of small tensors deep in the model up to 6.5e-2 and their
    weights, through Adam's sign-like first steps, up to 2.4e-2 after 3 steps (layer 7 of 12, tp=2 x
    pp=3, the loss within 9e-5), which no fixed bound separates from a bug. So in bf16/fp16 single
    tensors are ``diagnostic``: reported beyond 5e-2 once the loss or the gradient norm shows a
    divergence, but not deciding one. A missing or doubled reduction moves the gradient norm by ~50%.
    Per tensor they are judged by ``replayed`` where the optimizer is AdamW (8-bit or not): each step
    replayed from the layout's own fp32 masters, moments and gradient (:func:`bigtrain.check.run.replays_steps`).
    """

    loss: float
    grad_norm: float
    tensor: float
    diagnostic: tuple[str, ...] = ()  # kinds reported beyond the bound but not deciding a divergence
    # An optimizer step replayed by the reference from the layout's own fp32 masters, state and
    # gradient (bigtrain/check/replay.py): fp32 arithmetic whatever the compute precision.
    replayed: float = 1e-5
    # Whether the gradient norm keeps ``grad_norm`` only before the first update: from then on
    # single tensors legitimately drift (int8 code flips carried by Adam), the gradients with them,
    # and the norm is held to how far its own gradients are from the reference's (grad_norm_bound).
    norm_follows_gradients: bool = False
    # Whether a gradient norm over ``grad_norm`` after an update is judged again, at ``grad_norm``,
    # against the reference's recomputation of the step at the layout's own weights before it
    # (check/run.py's _norm_recomputed): fp32, whose weights part from the reference's by rounding
    # that Adam amplifies, by 8-bit codes or Lion's sign ties, or by int8 code flips, all of which the
    # recomputation at the layout's own weights leaves out (an int8 input still rounds its own way
    # there, a rounding error from a code boundary: measured 1e-7 to 5e-7 on the norm, fuzz seed
    # 20261417 sample 16). Where it applies, the norm keeps ``grad_norm`` at every step, and
    # ``norm_follows_gradients`` only where the reference cannot compute at those weights.
    norm_recomputed: bool = False
    # Whether a recomputed norm still over ``grad_norm`` is reported, not a divergence, where the
    # recomputation routed MoE tokens otherwise than the layout (bf16/fp16: bigtrain/check/routing.py).
    routing_flips: bool = False

    def of(self, kind: str) -> float:
        return {"loss": self.loss, "grad_norm": self.grad_norm, "replayed": self.replayed}.get(kind, self.tensor)

    def grad_norm_bound(self, before_any_update: bool, gradients_apart: float | None) -> float:
        """The gradient norm's bound at a step: ``grad_norm``, or where the norm follows the
        gradients and weights were updated already, ``grad_norm`` plus ``gradients_apart`` (the
        step's gradients' distance from the reference's, :func:`gradients_difference`; capped at
        the tensor bound). By the triangle inequality | |a| - |b| | <= |a - b|: a norm that agrees
        with the gradients it is the norm of passes, one computed otherwise (a dropped or doubled
        reduction in it, a scaled gradient clipped by it) does not. None (the layout's gradients
        not at hand: 2BW's deferred steps) keeps ``grad_norm``: nothing compared bounds the drift
        then, and a false alarm is better than a bound nothing backs."""
        if not self.norm_follows_gradients or before_any_update or gradients_apart is None:
            return self.grad_norm
        return self.grad_norm + min(gradients_apart, self.tensor)

    def decides(self, kind: str) -> bool:
        return kind not in self.diagnostic

    def text(self) -> str:
        # whether norm_recomputed applies depends on the reference (a DLRM's has no at_weights):
        # said only beside the drift it replaces; where a norm was recomputed, the report says so
        drift = " (after the first update: + its gradients' difference"
        drift += ", where not recomputed at the layout's weights)" if self.norm_recomputed else ")"
        norm = f"{self.grad_norm:.0e}" + (drift if self.norm_follows_gradients else "")
        return (f"loss {self.loss:.0e}, gradient norm {norm}, tensors {self.tensor:.0e} relative"
                + (f" ({', '.join(self.diagnostic)} diagnostic only)" if self.diagnostic else ""))


# After an update the weights part by bf16 rounding that Adam amplifies (a gradient norm 14.6% off by
# step 5 on fuzz seed 20261470 sample 5, a tp 4 MoE); recomputed at the layout's own weights the norm
# is held to the bound as at a fresh run's first step, MoE routing flips aside (check/routing.py).
_LOW_PRECISION = Tolerance(1e-3, 2e-2, 5e-2, diagnostic=("gradient", "forward", "weight"), norm_recomputed=True,
                           routing_flips=True)
TOLERANCES = {"fp32": Tolerance(1e-5, 1e-5, 1e-4, norm_recomputed=True), "bf16": _LOW_PRECISION,
              "fp16": _LOW_PRECISION}
# 8-bit optimizer state in fp32: a gradient a rounding error away from the reference's can land a
# moment on the other side of a code boundary, 4.7% of that element's moment away, so a layout's
# single tensors drift by up to ~1e-3 relative after a few steps (measured: 1.9e-4 after one step,
# each layout and the one-process run alike). Bit-for-bit state equality is proved where the
# gradients are equal (tests/test_optimizer_layouts.py). The loss keeps the fp32 bound, and so does
# the gradient norm at a fresh run's first step; after an update the weights differ by those flips,
# the gradients downstream with them, and the norm is held to 1e-5 plus its own gradients' distance
# from the reference's, as under int8 below (found by the layout fuzzer, seed 20261428 sample 2: dp 2
# resumed at pp 4, the gradients 1.7e-7, 4.0e-5 and 2.2e-4 apart at the three steps compared, a
# weight 3.6e-3, the norm 3.1e-5 off at the third; every update replayed within 1.2e-7).
_QUANTIZED_STATE = Tolerance(1e-5, 1e-5, 5e-3, norm_follows_gradients=True, norm_recomputed=True)
# Lion's update is lr x sign(c) per element: an element whose c is a rounding error from 0 moves by
# +lr in one run and -lr in the other (found by the layout fuzzer, seed 20261131 sample 9: one
# element of 12,288 at step 2, 3.3e-4 relative on its tensor, gradients equal within 4e-7). The same
# bounds as the quantized state's: a few such elements pass, a wrong update does not.
_DISCONTINUOUS_UPDATE = {"adamw8bit": _QUANTIZED_STATE, "lion": _QUANTIZED_STATE}
# int8 activation compression in fp32 (the reference quantizes the same inputs by the same rule): a
# linear input that agrees with the reference's to rounding, relative e ~ 1e-6, still rounds to the
# other int8 code where it lies within e * 127 codes of a boundary, at most 127 e of its elements, and
# each such flip moves its weight gradient by a whole step s = max|row| / 127. Against int8's own
# gradient error (uniform within s / 2, under 1e-2 relative) that is sqrt(12 * 127 e) = 3.9% of it: up to
# ~4e-4 on one gradient, which Adam, dividing by |g|, carries into the weights (measured: two
# one-process references that differ only by accumulation 1 vs 2 move gradients 3.4e-4 and weights
# 1.7e-4 apart by step 2 at lr 0.01, the loss within 1e-7). Single tensors get 5e-3; the loss keeps
# the fp32 bound. So does the gradient norm at a fresh run's first step, where the weights are the
# reference's and a flip moves one gradient alone (the norm stays at reduction rounding: 9e-8 with a
# flip, 2.7e-7 without int8, at tp = 4); tensor parallelism scaling each rank's part of a row alone
# exceeds it at once (gradient norm 7.9e-5 at step 0, tp=2). After an update it cannot: the weights
# then differ by Adam's share of the flips (up to the tensor bound), every gradient downstream of
# them with them, and the norm as far as its gradients do, | |a| - |b| | <= |a - b|. So from then on
# the norm is held to 1e-5 plus its own gradients' relative distance from the reference's (found by
# the layout fuzzer, seed 20261417 sample 16, Mistral tp = 4 + SP: one code of 4,096 in the last
# block's down_proj input flipped at step 1 (x / s 4.50000 against 4.49999), that gradient 3.7e-4
# off and its weight 1.6e-3 after the update; at step 3 the norm 2.1e-5 off with its gradients
# 2.3e-4 apart; tp = 2 at lr 0.01, step 5: norm 4.8e-5, gradients 5.1e-5, the bound near tight).
# A norm not computed from the gradients compared (a reduction dropped or doubled in it) still
# fails, and so does any defect of the gradients themselves at the first step (tests/test_int8_norm.py).
# Flips feed on themselves: the bounds hold for the fuzzer's 3 steps and for 6 steps at lr 0.01 on
# the tiny preset, not for long runs at a large learning rate (docs/activations.md).
_INT8_ACTIVATIONS = Tolerance(1e-5, 1e-5, 5e-3, norm_follows_gradients=True, norm_recomputed=True)


# Float8 linears (precision.fp8): a layout whose GEMMs see exactly the reference's operands (ZeRO
# over the same micro-batches) stays bit-identical, but one that reassociates a sum (tp, sp, pp)
# starts ~1e-7 (fp32) or ~2^-8 (bf16) away, and float8 rounding turns such a difference into jumps of
# a whole float8 step (2^-4..2^-3 of an element) where a value sits that close to a rounding
# boundary; the more elements differ, the more cross one, so single tensors reach float8 noise in a
# few steps (measured on tiny over 5 steps: up to 1.2e-1 for a gradient, 4.9e-2 for a block's output,
# 2.1e-2 for a weight at tp = 2; the loss within 8e-5 and the gradient norm within 1.0e-3, fp32 or
# bf16). So the loss and the gradient norm decide at the bf16 bounds, single tensors are reported.
_FLOAT8 = Tolerance(1e-3, 2e-2, 2.5e-1, diagnostic=("gradient", "forward", "weight"))


def tolerance_for(precision: str, optimizer: str, activation_compression: str = "none",
                  fp8: str = "none") -> Tolerance:
    if fp8 != "none":
        return _FLOAT8
    if precision == "fp32" and optimizer in _DISCONTINUOUS_UPDATE:
        # with int8 compression too: the same bounds, its flips move the norm as the optimizer's do
        return _DISCONTINUOUS_UPDATE[optimizer]
    if precision == "fp32" and activation_compression == "int8":
        return _INT8_ACTIVATIONS
    return TOLERANCES[precision]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (the absolute error when expected is 0)."""
    if actual.shape != expected.shape:
        return float("inf")
    diff = float(torch.linalg.vector_norm((actual.double() - expected.double())))
    scale = float(torch.linalg.vector_norm(expected.double()))
    return diff / scale if scale > 0 else diff


def gradients_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float | None:
    """|actual - expected| / |expected| over all of ``expected``'s gradients together (float64): the
    most a norm of ``actual`` can differ from the same norm of ``expected``, relatively. None where
    ``actual`` lacks one of them (2BW's deferred steps compare no gradients) or a shape differs."""
    if not expected or any(name not in actual or actual[name].shape != g.shape for name, g in expected.items()):
        return None
    diff = sum(float((actual[name].double() - g.double()).pow(2).sum()) for name, g in expected.items())
    scale = sum(float(g.double().pow(2).sum()) for g in expected.values())
    return (diff / scale) ** 0.5 if scale > 0 else diff ** 0.5


def scalar_error(actual: float, expected: float) -> float:
    if actual == expected:  # also inf == inf: both skipped on overflow
        return 0.0
    return abs(actual - expected) / max(abs(expected), 1e-30)


def _sequence_index(coords: dict[str, int], parts: int, sizes: dict[str, int]) -> int | None:
    """Which sequence chunk a rank holds when a tensor's sequence is cut in ``parts``: Ulysses cuts
    it over sp first, then Megatron sequence parallelism cuts each chunk over tp."""
    sp, tp = sizes.get("sp", 1), sizes.get("tp", 1)
    if parts == 1:
        return 0
    if parts == sp * tp:
        return coords["sp"] * tp + coords["tp"]
    if parts == sp:
        return coords["sp"]
    if parts == tp:
        return coords["tp"]
    return None


def _assemble_replica(pieces: list[tuple[dict[str, int], torch.Tensor]], full_shape: torch.Size,
                      sizes: dict[str, int]) -> torch.Tensor | None:
    """One data-parallel replica's batch slice from its ranks' pieces (over tp and sp, and cp)."""
    if sizes.get("cp", 1) > 1:
        return _assemble_context(pieces, full_shape, sizes)
    local = pieces[0][1]
    if local.dim() < 2 or full_shape[1] % local.shape[1]:
        return None
    parts = full_shape[1] // local.shape[1]
    vocab_split = local.shape[-1] < full_shape[-1]  # the output head's logits, cut over tp
    chunks = []
    for index in range(parts):
        here = sorted(((c["tp"], t) for c, t in pieces if _sequence_index(c, parts, sizes) == index),
                      key=lambda item: item[0])
        if not here:
            return None
        if vocab_split:
            unique = dict(here)  # the same slice may come from several sp ranks
            if len(unique) != sizes.get("tp", 1):
                return None
            chunks.append(torch.cat([unique[tp] for tp in sorted(unique)], dim=-1).narrow(-1, 0, full_shape[-1]))
        else:
            chunks.append(here[0][1])
    return torch.cat(chunks, dim=1)


def _assemble_context(pieces: list[tuple[dict[str, int], torch.Tensor]], full_shape: torch.Size,
                      sizes: dict[str, int]) -> torch.Tensor | None:
    """A replica's slice when its sequence is cut over cp: each cp rank's part (itself put together
    over tp and sp) is its two chunks of 2 x cp, which go back to their places."""
    cp = sizes["cp"]
    if len(full_shape) < 2 or full_shape[1] % (2 * cp):
        return None
    local_shape = torch.Size((full_shape[0], full_shape[1] // cp, *full_shape[2:]))
    inner, chunks = {**sizes, "cp": 1}, [None] * (2 * cp)
    for rank in range(cp):
        held = [(c, t) for c, t in pieces if c.get("cp", 0) == rank]
        part = _assemble_replica(held, local_shape, inner) if held else None
        if part is None or part.shape[1] != local_shape[1]:
            return None
        for index, chunk in zip(chunks_of(cp, rank), part.chunk(2, dim=1)):
            chunks[index] = chunk
    return torch.cat(chunks, dim=1)


def assemble(pieces: list[tuple[dict[str, int], torch.Tensor]], full_shape: torch.Size,
             sizes: dict[str, int]) -> torch.Tensor | None:
    """The global-batch tensor from every rank's (coordinates, local tensor), or None."""
    replicas = {}
    for coords, tensor in pieces:
        replicas.setdefault(coords["dp"], []).append((coords, tensor))
    if sorted(replicas) != list(range(sizes.get("dp", 1))):
        return None
    rows = [_assemble_replica(replicas[dp], full_shape, sizes) for dp in sorted(replicas)]
    if any(r is None for r in rows):
        return None
    out = torch.cat(rows, dim=0)
    return out if out.shape == full_shape else None
