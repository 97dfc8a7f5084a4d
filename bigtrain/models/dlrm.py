"""A DLRM-style recommender (Naumov et al. 2019): the plain, single-process model.

- bottom MLP (ReLU) on the dense features, ending at the embedding dimension;
- one embedding-bag table per sparse feature: each sample brings ``hotness`` ids per feature, whose
  rows are summed (sum pooling, multi-hot);
- dot-product interaction: the pairwise dots of the bottom output and the pooled embeddings (the
  strictly lower triangle), concatenated with the bottom output;
- top MLP (ReLU between layers) to one logit; binary cross-entropy on it.

The tables sit in :class:`EmbeddingBags` (``embeddings.tables.T.weight``), the one module
``bigtrain.parallel.embedding`` replaces by its sharded lookup; everything else is the dense part,
which trains data parallel like any model. Initial values depend on (seed, parameter name) only, so
every layout starts from the same weights.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.core.tables import parse_sizes


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def pooled_lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sum of the rows ``ids`` ([samples, hotness]) of ``weight`` per sample."""
    return F.embedding_bag(ids, weight, mode="sum")


class EmbeddingBags(nn.Module):
    """One sum-pooled table per sparse feature: ids [batch, tables, hotness] -> [batch, tables, dim]."""

    def __init__(self, rows: list[int], dim: int):
        super().__init__()
        self.rows, self.dim = list(rows), dim
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="sum") for r in rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([pooled_lookup(t.weight, ids[:, i]) for i, t in enumerate(self.tables)], dim=1)


def interaction(bottom: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """[bottom output, the pairwise dots of (bottom output, pooled embeddings)], strictly lower triangle."""
    features = torch.cat([bottom.unsqueeze(1), pooled], dim=1)  # [B, F, D]
    return torch.cat([bottom, _LowerDots.apply(features)], dim=1)


def _lower_triangle(count: int, device) -> torch.Tensor:
    """Flat positions (i * count + j, i > j) of a [count, count] matrix's strict lower triangle, row by row."""
    i, j = torch.tril_indices(count, count, offset=-1, device=device)
    return i * count + j


class _LowerDots(torch.autograd.Function):
    """features [B, F, D] -> the dots <f_i, f_j> for i > j, [B, F (F - 1) / 2].

    Autograd of ``bmm(x, x^T)[:, i, j]`` runs two bmms and an accumulating scatter in backward; the
    Gram matrix is symmetric, so the gradient is one bmm: (G + G^T) x, with G the dots' gradient
    put back in the lower triangle (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, features: torch.Tensor) -> torch.Tensor:
        count = features.shape[1]
        flat = _lower_triangle(count, features.device)
        ctx.save_for_backward(features, flat)
        return torch.bmm(features, features.transpose(1, 2)).view(-1, count * count).index_select(1, flat)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        features, flat = ctx.saved_tensors
        count = features.shape[1]
        full = grad.new_zeros((grad.shape[0], count * count)).index_copy_(1, flat, grad).view(-1, count, count)
        return torch.bmm(full + full.transpose(1, 2), features)


class DLRM(nn.Module):
    def __init__(self, dense_features: int, table_rows: list[int], dim: int, bottom_hidden: list[int],
                 top_hidden: list[int]):
        super().__init__()
        self.dense_features, self.table_rows, self.dim = dense_features, list(table_rows), dim
        self.bottom = mlp([dense_features, *bottom_hidden, dim], last_relu=True)
        self.embeddings = EmbeddingBags(table_rows, dim)
        features = len(table_rows) + 1
        self.top = mlp([dim + features * (features - 1) // 2, *top_hidden, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch] for dense [batch, dense_features] and ids [batch, tables, hotness]."""
        return self.top(interaction(self.bottom(dense), self.embeddings(ids))).squeeze(1)

    def initial_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return init_value(name, shape, seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, param in self.named_parameters():
            param.copy_(init_value(name, tuple(param.shape), seed))


def init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """DLRM's initialization: tables uniform in +-sqrt(1/rows), linear weights normal with
    std sqrt(2 / (fan_in + fan_out)), biases normal with std sqrt(1 / fan_out); full, on the CPU."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.startswith("embeddings."):
        bound = (1.0 / shape[0]) ** 0.5
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound
    if name.endswith("bias"):
        return torch.randn(shape, generator=gen) * (1.0 / shape[0]) ** 0.5
    return torch.randn(shape, generator=gen) * (2.0 / (shape[0] + shape[1])) ** 0.5


def bce_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")


def build_dlrm(cfg, device: str | torch.device = "cpu") -> DLRM:
    """The model a Config describes (``cfg.model.dlrm_*``, ``cfg.embedding``)."""
    m, e = cfg.model, cfg.embedding
    with torch.device(device):
        return DLRM(m.dlrm_dense_features, parse_sizes(e.tables), e.dim, parse_sizes(m.dlrm_bottom_mlp),
                    parse_sizes(m.dlrm_top_mlp))
