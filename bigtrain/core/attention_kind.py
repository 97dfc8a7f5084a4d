"""Which kernel computes block-causal attention (``model.attention``): sdpa with a dense mask, or
FlexAttention with a BlockMask. Imports no torch (validation and the planner read it).

- 'sdpa': one additive (batch, 1, seq, seq) mask in the compute dtype a forward
  (:func:`bigtrain.core.documents.document_bias`), shared by the layers and saved once for
  backward: O(seq^2) bytes a micro-batch in flight, and with a mask sdpa cannot use its flash
  kernel (it falls back to the memory-efficient or the math one).
- 'flex': a BlockMask of the documents (:func:`bigtrain.core.documents.document_block_mask`,
  torchtitan's block_causal): (seq / 128)^2 int32 block indices, and the kernel computes only
  the 128 x 128 tiles a document covers, skipping the rest.
- 'auto': flex where it is the better choice and can run: block-causal attention on a CUDA device.
  On a CPU torch (2.13) has FlexAttention's forward only, no backward (eager or compiled), so
  training there stays on sdpa; causal attention stays on sdpa's causal (flash) kernel, which
  needs no mask at all.
"""

from __future__ import annotations

ATTENTIONS = ("sdpa", "flex", "auto")


def attention_kind(setting: str, attn_mask: str, device_type: str) -> str:
    """'flex' or 'sdpa': what ``model.attention = setting`` computes ``attn_mask`` attention with on a
    ``device_type`` device ('cuda', 'cpu'). Causal attention is always sdpa's (no mask to give)."""
    if attn_mask != "block_causal":
        return "sdpa"
    if setting == "flex" or (setting == "auto" and device_type == "cuda"):
        return "flex"
    return "sdpa"
