"""The memory-efficient optimizers' declarations (this module imports no torch: config validation
reads them); their steps live in :mod:`bigtrain.optim.adamw8bit`, :mod:`~bigtrain.optim.adafactor`
and :mod:`~bigtrain.optim.lion`, imported when an optimizer is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bigtrain.optim.factored import stat_sizes
from bigtrain.optim.spec import OptimizerSpec, StateTensor, register_optimizer

if TYPE_CHECKING:
    from bigtrain.config import OptimConfig


def _build_lion(groups: list[dict], cfg: "OptimConfig"):
    from bigtrain.optim.lion import Lion

    return Lion(groups, lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2)


def _build_adafactor(groups: list[dict], cfg: "OptimConfig"):
    from bigtrain.optim.adafactor import Adafactor

    return Adafactor(groups, lr=cfg.lr, beta2_decay=cfg.adafactor_decay, d=cfg.adafactor_clip,
                     eps2=cfg.adafactor_eps)


def _build_adamw8bit(groups: list[dict], cfg: "OptimConfig"):
    from bigtrain.optim.adamw8bit import AdamW8bit

    return AdamW8bit(groups, lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, block_size=cfg.block_size)


LION = register_optimizer(OptimizerSpec(
    name="lion", state=(StateTensor("exp_avg"),), build=_build_lion,
    summary="Lion (Chen et al. 2023): sign of interpolated momentum, one fp32 moment, 4 bytes per parameter"))

ADAFACTOR = register_optimizer(OptimizerSpec(
    name="adafactor",
    state=(StateTensor("step", per="tensor"), StateTensor("row_var", per="tensor", factored=True),
           StateTensor("col_var", per="tensor", factored=True)),
    build=_build_adafactor, needs="shapes", factored_bytes=lambda shape: 4 * sum(stat_sizes(tuple(shape))),
    summary="Adafactor (Shazeer & Stern 2018): factored second moment, O(rows + columns) fp32 per matrix"))

ADAMW8BIT = register_optimizer(OptimizerSpec(
    name="adamw8bit",
    state=(StateTensor("step", per="tensor"), StateTensor("exp_avg", "int8"), StateTensor("exp_avg_sq", "uint8"),
           StateTensor("exp_avg_scale", per="block"), StateTensor("exp_avg_sq_scale", per="block")),
    build=_build_adamw8bit, needs="blocks", block_size=lambda cfg: cfg.block_size,
    summary="AdamW with both moments block-wise 8-bit (Dettmers et al. 2022): 2 bytes per parameter "
            "+ 8 per block of optim.block_size"))
