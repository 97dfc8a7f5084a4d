"""The one cast the models make for numerical safety: up to fp32, never down.

Norms, rotary positions, routers and the loss compute in fp32 whatever the compute dtype (bf16
underflows and ties). A float64 model (``bigtrain check``'s exact reference, which measures how far
fp32's own rounding moves each tensor) must stay float64 through the same places, so the cast
widens and never narrows.
"""

from __future__ import annotations

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or unchanged where it is already wider (float64)."""
    return x if x.dtype == torch.float64 else x.float()
