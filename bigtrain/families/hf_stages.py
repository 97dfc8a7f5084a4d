"""Pipeline stages of a Hugging Face decoder (:class:`~bigtrain.models.hf_causal_lm.CausalLM`):
the embedding on the first stage, a run of blocks on each, the final norm and head on the last,
under the model's own names (``model.layers.3...`` stays ``model.layers.3...``), so initialization
by name, checkpoints and the comparison with one process work unchanged.

Each stage holds the rotary embedding (a buffer, no weights) and makes the rotary tables for its
own blocks; blocks are called as transformers' decoder calls them, with no mask (causal attention:
``sdpa`` then runs with ``is_causal``, as the whole model does for an unpadded batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bigtrain.models.hf_causal_lm import CausalLM, documents_keyword, init_rotary_buffers, token_positions
from bigtrain.parallel.pipeline.partition import PipelineStage, _split_points, stage_ranges


class CausalLMStage(PipelineStage):
    def __init__(self, model: CausalLM, index: int, num_stages: int, layer_ids: range):
        super().__init__(index, num_stages)
        decoder = nn.Module()  # the plain model's ``model`` prefix, holding only this stage's part
        if self.is_first:
            decoder.embed_tokens = model.model.embed_tokens
        decoder.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        if self.is_last:
            decoder.norm = model.model.norm
        decoder.rotary_emb = model.model.rotary_emb
        self.model = decoder
        if self.is_last:
            self.lm_head = model.lm_head

    def blocks(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def forward(self, x: torch.Tensor, start_pos: int = 0, with_head: bool = True,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: tokens on the first stage, hidden states (this rank's sequence) after; ``positions``
        and ``documents`` as in ``CausalLM.forward`` (context parallelism's chunks; block-causal attention)."""
        h = self.model.embed_tokens(x) if self.is_first else x
        positions = token_positions(h.shape[1], start_pos, positions, h.device)
        rotary = self.model.rotary_emb(h, positions)
        extra = documents_keyword(documents, h.dtype)  # one for the layers
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary, **extra)
        if not self.is_last:
            return h
        h = self.model.norm(h)
        return self.lm_head(h) if with_head else h

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        init_rotary_buffers(self, device)


def split_causal_lm(model: CausalLM, num_stages: int, balance: str = "layers",
                    split_points: Sequence[int] | None = None) -> list[CausalLMStage]:
    """All ``num_stages`` stages of ``model`` (sharing its modules), its blocks divided by count, by
    parameter count (embedding and head included) or at ``split_points``."""
    layers = list(model.model.layers)
    head = sum(p.numel() for m in (model.model.norm, model.lm_head) for p in m.parameters())
    embedding = sum(p.numel() for p in model.model.embed_tokens.parameters())
    points = _split_points(layers, num_stages, balance, split_points, embedding, head)
    return [CausalLMStage(model, s, num_stages, ids)
            for s, ids in enumerate(stage_ranges(len(layers), num_stages, points))]
