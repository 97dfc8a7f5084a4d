"""Sparse optimizers for embedding tables: they read and write only the rows a batch looked up.

A table's gradient is a handful of rows (the ids of the batch, summed per distinct id): the
lookup's backward hands them here at once, as TorchRec's fused optimizers do, so no dense gradient
of the table is ever made and rows the batch did not touch (and their state) are left as they were.

- ``sgd``: ``w[r] -= lr g[r]``;
- ``rowwise_adagrad`` (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row,
  ``s[r] += mean_j g[r, j]^2``, then ``w[r] -= lr g[r] / (sqrt(s[r]) + eps)``. The mean runs over
  the whole row: a column-sharded table sums its piece's squares and lets ``combine`` add the other
  pieces' (an all-reduce over the ranks holding the table's columns) before dividing by the full
  dimension, so every layout updates as one process does.
"""

from __future__ import annotations

from typing import Callable

import torch

from bigtrain.core.tables import SPARSE_OPTIMIZERS


Combine = Callable[[torch.Tensor], torch.Tensor]  # per-row partial sums of squares -> whole-row sums


class SparseOptimizer:
    def __init__(self, name: str, lr: float, eps: float = 1e-8):
        if name not in SPARSE_OPTIMIZERS:
            raise ValueError(f"embedding.optimizer = '{name}': must be one of {', '.join(SPARSE_OPTIMIZERS)}")
        self.name, self.lr, self.eps = name, lr, eps

    def new_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of one table piece: an accumulator per row for row-wise Adagrad, nothing for SGD."""
        if self.name == "rowwise_adagrad":
            return {"sum": torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)}
        return {}

    def state_bytes_per_row(self) -> int:
        return 4 if self.name == "rowwise_adagrad" else 0

    @torch.no_grad()
    def update(self, weight: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor, grad: torch.Tensor,
               full_dim: int | None = None, combine: Combine | None = None) -> None:
        """Apply the gradient ``grad`` [len(rows), width] of the distinct local ``rows`` of ``weight``."""
        if self.name == "sgd":
            weight.index_add_(0, rows, grad * -self.lr)  # index_add_ with alpha is the slower kernel on CPU
            return
        squares = grad.float().pow(2).sum(1)
        if combine is not None:
            squares = combine(squares)
        acc = state["sum"]
        acc.index_add_(0, rows, squares / (full_dim or grad.shape[1]))
        step = grad * (-self.lr / (acc[rows].sqrt() + self.eps)).unsqueeze(1)
        weight.index_add_(0, rows, step.to(weight.dtype))


def row_gradient(ids: torch.Tensor, pooled_grad: torch.Tensor, bags: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse gradient of a sum-pooled lookup -> (distinct rows, their summed gradients).

    ``ids``: [samples, hotness] local row numbers, each sample's ids pooled into its row of
    ``pooled_grad`` [samples, width]; or, with ``bags`` (the row of ``pooled_grad`` each id was pooled
    into), any shape. The ids are sorted (stably: each row's gradients add up in the ids' order) and
    each distinct row's gradients summed by ``embedding_bag`` over the sorted positions: one fused
    gather-and-sum (FBGEMM's kernel on CPU) instead of a scatter-add of every id's gradient row."""
    flat_ids = ids.reshape(-1)
    sorted_ids, order = flat_ids.sort(stable=True)
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    source = bags.reshape(-1)[order] if bags is not None else order.div(ids.shape[1], rounding_mode="floor")
    grad = torch.nn.functional.embedding_bag(source, pooled_grad, counts.cumsum(0) - counts, mode="sum")
    return rows, grad
