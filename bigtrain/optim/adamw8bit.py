"""AdamW with both moments stored block-wise in 8 bits (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"): 2 bytes per parameter plus two fp32 scales per block of
``optim.block_size`` elements (2.03 bytes at 256), against AdamW's 8.

Each step dequantizes a tensor's moments to fp32, applies AdamW's rule exactly as
``torch.optim.AdamW`` does (decoupled decay, bias correction), updates the parameter with the
fp32 moments and stores them requantized (:mod:`bigtrain.optim.quantize`). Blocks are counted from
each parameter's first element, so a ZeRO shard or tensor-parallel part that starts at a block
boundary (the engines align their cuts: ``needs = "blocks"``) keeps, bit for bit, the state the
single-process optimizer keeps for the same elements. Large tensors are processed in slices of
whole blocks, so the fp32 temporaries stay small.
"""

from __future__ import annotations

import math
import torch

from bigtrain.optim.quantize import SIGNED, UNSIGNED, blocks_of, dequantize, quantize


SLICE_BLOCKS = 4096  # blocks per slice of work: 1M elements at block 256


class AdamW8bit(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], lr: float, beta1: float, beta2: float, eps: float, block_size: int):
        super().__init__(groups, {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": 0.0})
        self.block_size = block_size
        self._tables: dict = {}

    def _table(self, cmap, device) -> torch.Tensor:
        key = (cmap.signed, str(device))
        if key not in self._tables:
            self._tables[key] = cmap.table(device)
        return self._tables[key]

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            n, nb = p.numel(), blocks_of(p.numel(), self.block_size)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.int8, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            state["exp_avg_scale"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
            state["exp_avg_sq_scale"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        block = self.block_size
        for group in self.param_groups:
            lr, b1, b2, eps, decay = group["lr"], group["beta1"], group["beta2"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                t = state["step"].item()
                step_size = lr / (1 - b1 ** t)
                bias2_sqrt = math.sqrt(1 - b2 ** t)
                if decay:
                    p.mul_(1 - lr * decay)
                flat, grad = p.view(-1), p.grad.reshape(-1)
                m_codes, v_codes = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                span = SLICE_BLOCKS * block
                for lo in range(0, flat.numel(), span):
                    hi = min(lo + span, flat.numel())
                    blo, bhi = lo // block, blocks_of(hi, block)
                    g = grad[lo:hi].float()
                    m = dequantize(m_codes[lo:hi], state["exp_avg_scale"][blo:bhi],
                                   self._table(SIGNED, p.device), block)
                    v = dequantize(v_codes[lo:hi], state["exp_avg_sq_scale"][blo:bhi],
                                   self._table(UNSIGNED, p.device), block)
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v.sqrt() / bias2_sqrt).add_(eps)
                    flat[lo:hi].addcdiv_(m, denom, value=-step_size)
                    codes, scales = quantize(m, SIGNED, block)
                    m_codes[lo:hi].copy_(codes)
                    state["exp_avg_scale"][blo:bhi].copy_(scales)
                    codes, scales = quantize(v, UNSIGNED, block)
                    v_codes[lo:hi].copy_(codes)
                    state["exp_avg_sq_scale"][blo:bhi].copy_(scales)
