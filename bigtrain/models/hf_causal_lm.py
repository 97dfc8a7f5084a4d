"""A Hugging Face ``*ForCausalLM`` (built by transformers) as bigtrain's trainer calls a decoder:
tokens (batch, seq) -> logits (batch, seq, vocab).

:class:`CausalLM` holds the transformers model's own ``model`` (embedding, blocks, final norm,
rotary tables) and ``lm_head`` under the same names, so every parameter keeps its Hugging Face name
(``model.layers.0.self_attn.q_proj.weight``): checkpoints, tensor-parallel plans and the exported
safetensors use them as they are. No transformers import here: the family builds the model.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from bigtrain.core.documents import DocumentIds, document_bias

# The keyword each decoder layer's attention function receives the window's documents under, as
# one additive mask for every layer (block-causal attention, bigtrain.core.documents.document_bias),
# or as their ids under ring context parallelism (families/hf_context.py): transformers hands a
# layer's extra keywords on to it.
DOCUMENTS = "bigtrain_documents"


def documents_keyword(documents: torch.Tensor | DocumentIds | None, dtype: torch.dtype) -> dict:
    """The layers' keyword for ``documents`` (None: causal): the whole sequence's additive mask,
    or the ring's :class:`~bigtrain.core.documents.DocumentIds` as they are."""
    if documents is None:
        return {}
    return {DOCUMENTS: documents if isinstance(documents, DocumentIds) else document_bias(documents, dtype)}


class CausalLM(nn.Module):
    """``forward(tokens, start_pos, with_head, positions, documents)`` as
    :class:`bigtrain.models.llama.Llama`'s: ``start_pos`` is the first token's position, ``positions``
    (a LongTensor, one per token: context parallelism's two chunks; or one per row and token,
    restarting at each document) each token's instead, ``with_head=False`` ends at the final norm,
    ``documents`` (batch, whole seq) each token's document for block-causal attention (passed to
    the family's attention function as the keyword :data:`DOCUMENTS`)."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.model = causal_lm.model  # the decoder: embed_tokens, layers, norm, rotary_emb
        self.lm_head = causal_lm.lm_head
        self.config = causal_lm.config  # plain data (a PretrainedConfig), not a module

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, with_head: bool = True,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        positions = token_positions(tokens.shape[1], start_pos, positions, tokens.device)
        extra = documents_keyword(documents, self.model.embed_tokens.weight.dtype)
        hidden = self.model(input_ids=tokens, position_ids=positions, use_cache=False, **extra).last_hidden_state
        return self.lm_head(hidden) if with_head else hidden

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        init_rotary_buffers(self, device)


def token_positions(seq: int, start_pos: int, positions: torch.Tensor | None, device) -> torch.Tensor:
    """transformers' ``position_ids`` (1, seq), or (batch, seq) given per-row ``positions``:
    ``positions`` when given, else ``start_pos`` onwards."""
    if positions is not None:
        if positions.shape[-1] != seq:
            raise ValueError(f"{positions.shape[-1]} positions for {seq} tokens")
        return positions.to(device).reshape(-1, seq)
    return torch.arange(start_pos, start_pos + seq, device=device).unsqueeze(0)


@torch.no_grad()
def init_rotary_buffers(module: nn.Module, device: torch.device | str | None = None) -> None:
    """The rotary inverse frequencies of every Hugging Face rotary embedding in ``module`` (buffers
    derived from the config, left on the meta device by a meta build and unset by ``to_empty``),
    computed again on ``device`` as transformers computes them: by a new rotary module of the same
    class built from the same config on the CPU (its constructor computes them, in transformers 4
    and 5 alike, whose functions for it differ in name and signature)."""
    for rotary in module.modules():
        if isinstance(getattr(rotary, "inv_freq", None), torch.Tensor) and hasattr(rotary, "config"):
            where = rotary.inv_freq.device if device is None else torch.device(device)
            fresh = type(rotary)(rotary.config)
            rotary.inv_freq = fresh.inv_freq.float().to(where)
            rotary.original_inv_freq = rotary.inv_freq
            rotary.attention_scaling = fresh.attention_scaling


def init_value(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """Parameter ``name``'s full initial value, on the CPU in fp32, from (seed, name) only: norms
    one, biases zero (as transformers initializes them), every other weight normal with ``std``
    (the config's initializer_range)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * std
