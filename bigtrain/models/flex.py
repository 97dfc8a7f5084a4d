"""FlexAttention over a BlockMask of the documents (``model.attention = 'flex'``,
:func:`bigtrain.core.documents.document_block_mask`).

Called eagerly, ``flex_attention`` runs torch's reference implementation, which materializes every
score (O(seq^2) like a dense mask, and slower); its fused kernel exists only compiled. So on CUDA
an eager block calls one ``torch.compile`` of ``flex_attention`` itself (what torchtitan does),
made on first use and shared by every layer; inside a compiled region (``compile.enabled``) the
plain function is called and the region compiles it with the block (no compile wrapper, nor the
cache that holds it, is traced). On a CPU torch (2.13) has FlexAttention's forward only (validation
refuses training with it there): the eager call serves the forward-only uses and the tests that
compare it with sdpa's dense mask.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """q (batch, heads, seq, head_dim), k and v (batch, kv heads, seq, head_dim) -> (batch, heads,
    seq, head_dim), each query attending to the keys ``block_mask`` allows."""
    compiled_here = q.device.type == "cuda" and not torch.compiler.is_compiling()
    attend = _compiled_flex() if compiled_here else flex_attention
    return attend(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
