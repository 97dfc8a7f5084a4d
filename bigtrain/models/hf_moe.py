"""A transformers sparse-MoE block's place in its decoder layer, held by bigtrain's own MoE block.

The family (bigtrain/families/hf_moe.py) swaps each ``MixtralSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock`` or ``Qwen3MoeSparseMoeBlock`` of a built model for a :class:`SparseMoE`: a child swap, as tensor and
expert parallelism make theirs. Inside is a :class:`~bigtrain.models.moe.MoEFeedForward` (its
router, its experts stacked 2-D, its dispatcher), which expert parallelism, the tp plan, ZeRO,
checkpoints and the planner already know; this module only returns what the decoder layer
takes: the hidden states (transformers 5), or ``(hidden_states, router_logits)`` (transformers 4:
Mixtral's layer unpacks two; Qwen3-MoE's takes a tuple or a tensor). The router logits are not
kept (``None``): transformers reads them only for its batch-wide load-balancing loss
(``output_router_logits``), which the family refuses.
No transformers import here.
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.models.moe import MoEFeedForward


class SparseMoE(nn.Module):
    """(batch, seq, hidden) -> (batch, seq, hidden), or with ``with_router_logits`` the pair
    ((batch, seq, hidden), None): the tokens through ``moe``."""

    def __init__(self, moe: MoEFeedForward, with_router_logits: bool):
        super().__init__()
        self.moe = moe
        self.with_router_logits = with_router_logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        out = self.moe(hidden_states)
        return (out, None) if self.with_router_logits else out
