"""Block-wise 8-bit quantization of optimizer state with logarithmic ("dynamic") code maps.

A tensor is cut into blocks of ``block`` consecutive elements of its flattened form (the last one
may be shorter); each block keeps one fp32 scale, its largest magnitude, and each element one byte:
the code of ``x / scale`` in a map whose non-zero values are spaced evenly in log space, so small
values keep their relative precision as bitsandbytes' and torchao's dynamic maps do (a linear map
would round most of Adam's second moment, spread over orders of magnitude, to zero).

- signed map (first moment), int8: 0 and +-min * r**k for k = 0..126, with min * r**126 = 1;
- unsigned map (second moment), uint8: 0 and min * r**k for k = 0..254, with min * r**254 = 1.

A value is coded by rounding its log to the nearest step (and to 0 below min / 2): no search, a few
elementwise ops. Quantization is elementwise given the block's scale, so a piece of a tensor that
starts at a block boundary quantizes exactly as the same elements of the whole tensor do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CodeMap:
    signed: bool
    smallest: float  # the smallest non-zero magnitude, relative to the block's scale
    steps: int  # non-zero magnitudes: smallest * ratio**k, k < steps, the last one 1

    @property
    def log_ratio(self) -> float:
        return -math.log(self.smallest) / (self.steps - 1)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self.signed else torch.uint8

    def table(self, device) -> torch.Tensor:
        """Code -> value (relative to the scale), indexed by the code as an unsigned byte."""
        k = torch.arange(self.steps, dtype=torch.float64)
        mags = (math.log(self.smallest) + k * self.log_ratio).exp().float()
        mags[-1] = 1.0
        table = torch.zeros(256, dtype=torch.float32)
        table[1:1 + self.steps] = mags
        if self.signed:  # int8 codes -k are bytes 256 - k
            table[256 - self.steps:] = -mags.flip(0)
        return table.to(device)


SIGNED = CodeMap(signed=True, smallest=1e-5, steps=127)
UNSIGNED = CodeMap(signed=False, smallest=1e-8, steps=255)


def blocks_of(numel: int, block: int) -> int:
    return -(-numel // block)


def _blocked(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole blocks of flat ``t`` as a (blocks, block) view, the short last block's elements)."""
    full = t.numel() // block * block
    return t[:full].view(-1, block), t[full:]


def _per_block(t: torch.Tensor, per_block: torch.Tensor, block: int, op) -> torch.Tensor:
    """``op(t, scale)`` in place for every element of flat ``t`` and its block's value, through a
    broadcast view (no per-element copy of the scales)."""
    whole, tail = _blocked(t, block)
    nb = whole.shape[0]
    op(whole, per_block[:nb, None])
    if tail.numel():
        op(tail, per_block[nb])
    return t


def block_absmax(magnitudes: torch.Tensor, block: int) -> torch.Tensor:
    """The largest of each block of flat, non-negative ``magnitudes`` (the last block may be short)."""
    whole, tail = _blocked(magnitudes, block)
    scales = magnitudes.new_empty(blocks_of(magnitudes.numel(), block))
    if whole.numel():
        torch.amax(whole, dim=1, out=scales[:whole.shape[0]])
    if tail.numel():
        scales[-1] = tail.max()
    return scales


def quantize(x: torch.Tensor, cmap: CodeMap, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes like flat ``x`` in ``cmap.dtype``, one fp32 scale per block)."""
    x = x.reshape(-1)
    rel = x.abs() if cmap.signed else x.clone()  # the second moment is >= 0 already
    scales = block_absmax(rel, block)
    _per_block(rel, torch.where(scales > 0, scales, torch.ones_like(scales)), block, torch.Tensor.div_)
    k = rel.div(cmap.smallest).log_().div_(cmap.log_ratio).round_().clamp_(0, cmap.steps - 1).add_(1)
    k.masked_fill_(rel < cmap.smallest / 2, 0)
    if cmap.signed:
        k.copysign_(x)
    return k.to(cmap.dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values of ``codes`` (flat), ``table`` from :meth:`CodeMap.table`."""
    values = table.index_select(0, codes.reshape(-1).view(torch.uint8).int())
    return _per_block(values, scales, block, torch.Tensor.mul_)
