"""Measure how the zero-bubble split divides a stage's backward: F, B, I and W on this machine.

The planner times zb-h1 with W = ``weight_grad_fraction`` x the backward of the layers whose
weight gradients are deferred (see ``cost.stage_costs``). That fraction is measured here, not
assumed: on a middle pipeline stage of ``layers`` Llama blocks (no embedding, no output layer:
what most stages of a deep pipeline hold), the fastest of ``repeats`` rounds of

* F: the stage's forward; B: a plain ``autograd.backward`` from its output;
* I and W: ``split_backward.backward_input`` and ``WeightGrads.run`` on a fresh forward,

and ``weight_grad_fraction = W / (I + W)``. ``bigtrain bench --split-backward`` prints them;
``bigtrain bench --calibrate`` stores the fraction in the profile it writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class BackwardSplitTimes:
    forward_s: float
    backward_s: float
    input_s: float
    weight_s: float

    @property
    def weight_grad_fraction(self) -> float:
        return self.weight_s / (self.input_s + self.weight_s)

    @property
    def split_over_plain(self) -> float:
        """(I + W) / B: what splitting the backward costs (graph walk, two passes)."""
        return (self.input_s + self.weight_s) / self.backward_s

    def describe(self) -> str:
        ms = {k: 1e3 * v for k, v in (("F", self.forward_s), ("B", self.backward_s), ("I", self.input_s),
                                       ("W", self.weight_s))}
        return (", ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
                + f"; I + W = {self.split_over_plain:.2f} B, W = {self.weight_s / self.backward_s:.2f} B, "
                  f"weight_grad_fraction W / (I + W) = {self.weight_grad_fraction:.3f}")


def measure_backward_split(layers: int = 6, dim: int = 256, heads: int = 4, seq: int = 128, batch: int = 8,
                           repeats: int = 5, device: str | None = None) -> BackwardSplitTimes:
    """Fastest F, B, I, W times of a middle stage of ``layers`` blocks (fp32)."""
    import torch

    from bigtrain.config import ModelConfig
    from bigtrain.models.llama import build_model
    from bigtrain.parallel.pipeline import split_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(dim=dim, n_layers=layers + 2, n_heads=heads, max_seq_len=seq)
    stage = split_model(build_model(cfg), 3, split_points=[1, layers + 1])[1]  # blocks 1..layers only
    stage.to_empty(device=device)
    stage.init_weights(0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, seq, dim, generator=gen).to(device).requires_grad_()
    grad = torch.randn(batch, seq, dim, generator=gen).to(device)
    samples = [_one_round(stage, x, grad, device) for _ in range(repeats + 1)][1:]  # the first warms up
    # The fastest of each: on a shared machine the slower rounds measure the neighbours.
    return BackwardSplitTimes(*(min(s[i] for s in samples) for i in range(4)))


def _one_round(stage, x, grad, device: str) -> tuple[float, float, float, float]:
    """(F, B, I, W) seconds of one micro-batch through ``stage``."""
    import torch

    from bigtrain.parallel.pipeline.split_backward import backward_input

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - start

    params = list(stage.parameters())
    out, forward_s = timed(lambda: stage(x))
    _, backward_s = timed(lambda: torch.autograd.backward(out, grad))
    out = stage(x)
    (_, weight_grads), input_s = timed(lambda: backward_input([out], [grad], [x], params))
    _, weight_s = timed(weight_grads.run)
    stage.zero_grad(set_to_none=True)
    x.grad = None
    return forward_s, backward_s, input_s, weight_s
