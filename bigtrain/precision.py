"""Numeric formats: compute dtype, reduction dtype, and fp16's dynamic loss scaling.

bf16 and fp16 compute with fp32 master weights kept by the ZeRO engine (partitioned when the
stage says so). Norms, softmax and the loss run in fp32 inside the model and the loss function.
fp16 has too little range for small gradients, so the loss is multiplied by a scale before
backward and the gradients divided by it before the step; a step whose gradients overflowed is
skipped on every rank and the scale lowered, and after ``growth_interval`` clean steps it grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a section of the config, read here; the config module is the caller's
    from bigtrain.config import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype
    reduce: torch.dtype
    master: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "Precision":
        compute = DTYPES[cfg.mode]
        # fp16 gradients carry the loss scale: their sum over N ranks overflows fp16's range where
        # each rank's part and an fp32 sum do not, and would skip steps one process takes.
        reduce = torch.float32 if cfg.reduce_dtype == "fp32" or compute == torch.float16 else compute
        return cls(compute=compute, reduce=reduce)

    @property
    def mixed(self) -> bool:
        """Whether master weights are a separate fp32 copy of the compute weights."""
        return self.compute != self.master


class DynamicLossScaler:
    """The loss scale of fp16 training; ``update`` after every step with whether it overflowed."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000, backoff: float = 0.5,
                 growth: float = 2.0, min_scale: float = 1.0):
        self.scale, self.growth_interval, self.backoff, self.growth = init_scale, growth_interval, backoff, growth
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "DynamicLossScaler | None":
        if cfg.mode != "fp16":
            return None
        return cls(cfg.loss_scale, cfg.scale_growth_interval, cfg.scale_backoff)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.skipped_steps = state.get("skipped_steps", 0)
