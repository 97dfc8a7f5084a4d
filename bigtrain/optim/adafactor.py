"""Adafactor (Shazeer & Stern 2018) as ``torch.optim.Adafactor`` defines it, on pieces of parameters.

A matrix (or the last two dims of a stack of them) keeps only the running means of its squared
gradient over rows and over columns (R + C values instead of R x C) and estimates the second
moment as their outer product over the mean row statistic; a vector keeps the full second moment.
No first moment. The step size is relative (``min(lr, 1/sqrt(t))`` times the parameter's RMS, at
least ``optim.adafactor_eps``), the update is clipped to RMS ``optim.adafactor_clip``, and
``1 - beta2_t = t ** optim.adafactor_decay``. Defaults match ``torch.optim.Adafactor``.

Under tensor parallelism or ZeRO a rank holds a piece of a parameter (:mod:`bigtrain.optim.pieces`):
the row and column sums, the parameter's and the update's squared norms are this piece's partial
sums added over the groups holding the rest (one all-reduce per group for all parameters, twice a
step), so every rank keeps the statistics of the whole parameter and updates its own elements with
exactly the whole-parameter rule. The statistics are per-tensor state, alike on every such rank.
"""

from __future__ import annotations

import math
import torch

from bigtrain.optim.factored import stat_sizes
from bigtrain.optim.pieces import ParamPiece, sum_over, whole



class Adafactor(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], lr: float, beta2_decay: float = -0.8, d: float = 1.0,
                 eps2: float = 1e-3, eps1: float | None = None):
        super().__init__(groups, {"lr": lr, "beta2_decay": beta2_decay, "d": d, "eps2": eps2, "eps1": eps1,
                                  "weight_decay": 0.0})
        self.pieces: dict[int, ParamPiece] = {}

    def attach_pieces(self, pieces: dict[int, ParamPiece]) -> None:
        """Where each parameter given to this optimizer sits in its whole parameter, by ``id``
        (the engines call this; a parameter not named is whole)."""
        self.pieces = dict(pieces)

    def _piece(self, p: torch.Tensor) -> ParamPiece:
        return self.pieces.get(id(p)) or whole(p)

    def _state(self, p: torch.Tensor, piece: ParamPiece) -> dict:
        state = self.state[p]
        rows, cols = stat_sizes(piece.grid_shape)
        if not state:
            state["step"] = torch.tensor(0.0)
            state["row_var"] = torch.zeros(rows, dtype=torch.float32, device=p.device)
            state["col_var"] = torch.zeros(cols, dtype=torch.float32, device=p.device)
        elif state["row_var"].numel() != rows:
            state["row_var"] = _padding_rows_conformed(state["row_var"], rows, piece, cols, state["col_var"])
        return state

    @torch.no_grad()
    def step(self, closure=None):
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not work:
            return
        pieces = [self._piece(p) for _, p in work]
        # Pass 1: this piece's sums (squared parameter, squared gradient by row and by column),
        # completed over the groups holding the rest of each parameter.
        sums = [self._partial_sums(p, piece) for (_, p), piece in zip(work, pieces)]
        sum_over(sums, [piece.comms for piece in pieces], tag="optimizer")
        # Pass 2: statistics and the update; its squared norm, again summed over the pieces.
        updates, norms = [], []
        for (group, p), piece, s in zip(work, pieces, sums):
            update, alpha = self._update(group, p, piece, s)
            updates.append((update, alpha))
            norms.append(update.pow(2).sum().reshape(1))
        sum_over(norms, [piece.comms for piece in pieces], tag="optimizer")
        for (group, p), piece, (update, alpha), norm in zip(work, pieces, updates, norms):
            rms = norm.sqrt().item() / math.sqrt(math.prod(piece.full_shape))
            p.add_(update.view_as(p), alpha=-alpha / max(1.0, rms / group["d"]))

    def _partial_sums(self, p: torch.Tensor, piece: ParamPiece) -> torch.Tensor:
        """[sum p^2, row sums of g^2, column sums of g^2] of this piece, laid out over the whole
        parameter's rows and columns (zeros where other ranks hold the elements)."""
        rows, cols = stat_sizes(piece.grid_shape)
        g2 = p.grad.float().pow(2).reshape(-1)
        out = torch.zeros(1 + rows + cols, dtype=torch.float32, device=p.device)
        out[0] = p.float().pow(2).sum()
        if piece.whole:
            if cols == 0:
                out[1:].copy_(g2)
            else:
                grid = g2.view(-1, piece.grid_shape[-2], piece.grid_shape[-1])
                out[1:1 + rows].copy_(grid.sum(-1).reshape(-1))
                out[1 + rows:].copy_(grid.sum(-2).reshape(-1))
        elif cols == 0:
            out[1:].index_add_(0, piece.flat_index().to(p.device), g2)
        else:
            row, col = piece.row_col_index()
            out[1:1 + rows].index_add_(0, row.to(p.device), g2)
            out[1 + rows:].index_add_(0, col.to(p.device), g2)
        return out

    def _update(self, group: dict, p: torch.Tensor, piece: ParamPiece, sums: torch.Tensor):
        state = self._state(p, piece)
        state["step"] += 1
        t = state["step"].item()
        lr, eps1 = group["lr"], group["eps1"] if group["eps1"] is not None else torch.finfo(torch.float32).eps
        full = piece.full_shape
        numel = math.prod(full)
        alpha = max(group["eps2"], math.sqrt(sums[0].item() / numel)) * min(lr, 1 / math.sqrt(t))
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        one_minus_beta2 = t ** group["beta2_decay"]
        row_var, col_var = state["row_var"], state["col_var"]
        rows = row_var.numel()
        grad = p.grad.float().reshape(-1)
        if col_var.numel() == 0:  # a vector: the full second moment
            row_var.lerp_(sums[1:1 + rows], one_minus_beta2)
            var = row_var.clone() if piece.whole else row_var[piece.flat_index().to(p.device)]
        else:
            row_var.lerp_(sums[1:1 + rows] / full[-1], one_minus_beta2)
            col_var.lerp_(sums[1 + rows:] / full[-2], one_minus_beta2)
            grid = piece.grid_shape
            # Mean of the row statistic over the true rows of each matrix (padding rows hold 0).
            row_mean = (row_var.view(-1, grid[-2]).sum(-1) / full[-2]).clamp_(min=eps1)
            if piece.whole:
                var = (row_var.view(-1, grid[-2], 1) @ col_var.view(-1, 1, grid[-1])).div_(row_mean.view(-1, 1, 1))
                var = var.reshape(-1)
            else:
                row, col = (i.to(p.device) for i in piece.row_col_index())
                var = row_var[row] * col_var[col] / row_mean[row // grid[-2]]
        update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
        return update, alpha


def _padding_rows_conformed(row_var: torch.Tensor, rows: int, piece: ParamPiece, cols: int,
                            col_var: torch.Tensor) -> torch.Tensor:
    """A row statistic saved by a layout that padded this matrix's rows differently (a vocabulary
    padded to a multiple of tp: the padding rows come last and have no gradient, so their statistic
    is 0), cut or zero-extended to this layout's ``rows``. Anything else is not padding: refused."""
    extra = row_var[rows:]
    if len(piece.grid_shape) != 2 or col_var.numel() != cols or (extra.numel() and bool(extra.any())):
        raise ValueError(f"adafactor: a row statistic of {row_var.numel()} rows for a parameter whose layout has "
                         f"{rows} (grid {tuple(piece.grid_shape)}): not the same parameter's state; resume from a "
                         f"checkpoint of this model")
    out = torch.zeros(rows, dtype=row_var.dtype, device=row_var.device)
    kept = min(rows, row_var.numel())
    out[:kept].copy_(row_var[:kept])
    return out
