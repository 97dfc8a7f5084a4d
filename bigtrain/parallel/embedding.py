"""Embedding tables sharded over the ranks, looked up through all-to-all (TorchRec's sharded
EmbeddingBagCollection, written on our collectives and placement record).

A :class:`EmbeddingLayout` says, per table, how it is placed over the ``W`` ranks of the data axis:

- ``table``: whole on one rank (its ``owner``);
- ``row``: rows cut in ``W`` equal ranges, one per rank (rank r holds rows [r R/W, (r+1) R/W));
- ``column``: columns cut in ``W`` equal ranges, one per rank;
- ``data``: a replica on every rank.

The first three give each table its *pieces* (one, or one per rank). A step, on each rank of a
local batch of ``B`` samples with ``L`` ids per table:

1. ids, forward: all-to-all; rank s sends each piece's owner the ids of that piece's table for its
   ``B`` samples (a row piece gets them all and keeps its own: the others weigh 0 in its sum);
2. each rank pools its pieces over the ``W B`` samples of the global batch;
3. pooled embeddings, forward: all-to-all back to the samples' ranks, which sum the row pieces and
   put the column pieces side by side;
4. backward: the pooled gradients travel the reverse all-to-all to the pieces' owners, whose sparse
   optimizer (:mod:`bigtrain.optim.sparse`) updates the rows the batch touched, there and then
   (row-wise Adagrad on a column piece first all-reduces its per-row squares over the ranks).

``data`` tables look up locally; backward all-gathers their ids and pooled gradients, so every
replica applies the same update of the global batch and no dense gradient is reduced.

Payload bytes per step and rank (what :class:`AxisComm` records; :func:`all_to_all_payload`):
ids ``8 B L P`` (P: the pieces of all tables), pooled forward ``4 W B w_r`` (w_r: the widths of
this rank's pieces summed), pooled backward ``4 B w`` (w: the widths of all pieces summed; D per
table for table-wise and column-wise tables, W D for row-wise ones).

The tables never enter the dense engine: their placement says so (no ``partial`` axis, hence no
data-parallel reduction), and the engine is handed only the dense modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.models.dlrm import pooled_lookup
from bigtrain.optim.sparse import SparseOptimizer, row_gradient
from bigtrain.parallel.placement import Placement, ShardSpec
from bigtrain.recsys.tables import KINDS, check_layout

ID_BYTES, VALUE_BYTES = 8, 4
AXIS = "dp_sp"  # the embedding tables are cut over the data-parallel ranks


@dataclass(frozen=True)
class Piece:
    table: int
    rank: int
    rows: tuple[int, int]  # [first, end) of the table's rows
    cols: tuple[int, int]

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows[1] - self.rows[0], self.width


@dataclass(frozen=True)
class EmbeddingLayout:
    rows: tuple[int, ...]
    dim: int
    world: int
    kinds: tuple[str, ...]  # per table, one of KINDS
    owners: tuple[int, ...]  # per table: the rank of a table-wise table, -1 otherwise

    def __post_init__(self):
        problems = check_layout(list(self.rows), self.dim, self.world, list(self.kinds))
        if problems:
            raise ValueError("; ".join(problems))

    def pieces_of(self, t: int) -> list[Piece]:
        rows, dim, world, kind = self.rows[t], self.dim, self.world, self.kinds[t]
        if kind == "table":
            return [Piece(t, self.owners[t], (0, rows), (0, dim))]
        if kind == "row":
            step = rows // world
            return [Piece(t, r, (r * step, (r + 1) * step), (0, dim)) for r in range(world)]
        if kind == "column":
            step = dim // world
            return [Piece(t, r, (0, rows), (r * step, (r + 1) * step)) for r in range(world)]
        return []

    @property
    def pieces(self) -> list[Piece]:
        """Every piece, by rank then table: the order of every exchange."""
        return sorted((p for t in range(len(self.rows)) for p in self.pieces_of(t)), key=lambda p: (p.rank, p.table))

    def pieces_on(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.rank == rank]

    @property
    def data_tables(self) -> list[int]:
        return [t for t, k in enumerate(self.kinds) if k == "data"]

    def local_shapes(self, rank: int) -> dict[int, tuple[int, int]]:
        """{table: the shape this rank holds of it}."""
        shapes = {p.table: p.shape for p in self.pieces_on(rank)}
        shapes.update({t: (self.rows[t], self.dim) for t in self.data_tables})
        return dict(sorted(shapes.items()))

    def rank_bytes(self, rank: int, state_bytes_per_row: int = 0) -> int:
        """The bytes of the weights (fp32) and the sparse optimizer's state this rank holds."""
        return sum(r * (w * VALUE_BYTES + state_bytes_per_row) for r, w in self.local_shapes(rank).values())

    def placement(self, t: int, rank: int) -> Placement:
        """Where this rank's part of table ``t`` lives: never partial over the data axis (no engine
        reduction; the sparse optimizer updates it from the global batch's gradient)."""
        kind = self.kinds[t]
        if kind == "data":
            return Placement(replicate=(AXIS,))
        if kind == "table":
            return Placement()  # whole, on this rank alone
        dim, full = (0, self.rows[t]) if kind == "row" else (1, self.dim)
        return Placement(shards=(ShardSpec(dim, rank, self.world, full, full, AXIS),))

    def describe(self) -> str:
        lines = []
        for t, (rows, kind) in enumerate(zip(self.rows, self.kinds)):
            where = f"rank {self.owners[t]}" if kind == "table" else "every rank"
            lines.append(f"table {t:>3}  {rows:>12,} x {self.dim}  {kind:<6}  {where}")
        return "\n".join(lines)


def all_to_all_payload(layout: EmbeddingLayout, rank: int, batch: int, hotness: int) -> dict[str, int]:
    """Bytes this rank hands each all-to-all of one step (per-rank ``batch``), by tag."""
    pieces = layout.pieces
    if not pieces:
        return {}
    local = sum(p.width for p in pieces if p.rank == rank)
    return {"emb_ids": ID_BYTES * batch * hotness * len(pieces),
            "emb_pooled": VALUE_BYTES * layout.world * batch * local,
            "emb_pooled_backward": VALUE_BYTES * batch * sum(p.width for p in pieces)}


def check_ids(ids: torch.Tensor, rows: tuple[int, ...]) -> None:
    """ids [batch, tables, hotness] each within its table's rows, else a ValueError naming the table."""
    if ids.dim() != 3 or ids.shape[1] != len(rows):
        raise ValueError(f"ids of shape {tuple(ids.shape)}: expected [batch, {len(rows)} tables (embedding.tables), "
                         f"hotness]")
    limit = torch.tensor(rows, device=ids.device).view(1, -1, 1)
    bad = ((ids < 0) | (ids >= limit)).any(2).any(0)
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        column = ids[:, t]
        wrong = int(column[(column < 0) | (column >= rows[t])][0])
        raise ValueError(f"embedding.tables: id {wrong} of sparse feature {t} is outside its table's "
                         f"{rows[t]} rows (0 .. {rows[t] - 1})")


class TablePiece(nn.Module):
    """This rank's part of one table (``weight``: a piece, a view of its group's store, or a replica)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # updated in backward, not by autograd


@dataclass
class PieceGroup:
    """This rank's pieces of one width, stacked in one ``store`` (FBGEMM's table-batched embedding):
    one lookup, one gradient and one optimizer update for all of them. Column pieces form a group of
    their own (their row-wise state is combined over the ranks)."""

    members: list[int]  # positions in the rank's pieces
    firsts: list[int]  # each member's first table row
    sizes: list[int]  # its rows
    offsets: list[int]  # its first row in the store
    column: bool
    store: torch.Tensor
    state: dict[str, torch.Tensor]


class ShardedEmbeddingBags(nn.Module):
    """:class:`~bigtrain.models.dlrm.EmbeddingBags` over ``comm``'s ranks, as ``layout`` says."""

    def __init__(self, layout: EmbeddingLayout, comm: AxisComm, optimizer: SparseOptimizer,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if comm.size != layout.world:
            raise ValueError(f"the layout is for {layout.world} ranks, the group has {comm.size}")
        self.layout, self.comm, self.optimizer = layout, comm, optimizer
        self.rank = comm.rank
        self.local = layout.pieces_on(self.rank)
        by_kind: dict[tuple[int, bool], list[int]] = {}
        for k, piece in enumerate(self.local):
            by_kind.setdefault((piece.width, layout.kinds[piece.table] == "column"), []).append(k)
        self.groups, holders = [], {}
        for (width, column), members in by_kind.items():
            sizes = [self.local[k].shape[0] for k in members]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            store = torch.empty((sum(sizes), width), device=device)
            self.groups.append(PieceGroup(members, [self.local[k].rows[0] for k in members], sizes, offsets, column,
                                          store, optimizer.new_state(store)))
            for k, first, size in zip(members, offsets, sizes):
                holders[self.local[k].table] = TablePiece(store[first:first + size])
        for t in layout.data_tables:
            holders[t] = TablePiece(torch.empty((layout.rows[t], layout.dim), device=device))
        self.tables = nn.ModuleDict({str(t): holders[t] for t in sorted(holders)})
        self.data_state = {t: optimizer.new_state(self.weight(t)) for t in layout.data_tables}

    def init_from(self, full_value) -> None:
        """Fill each local part from ``full_value(t)`` (the whole table t)."""
        with torch.no_grad():
            for key, holder in self.tables.items():
                t = int(key)
                full = full_value(t)
                piece = next((p for p in self.local if p.table == t), None)
                if piece is not None:
                    full = full[piece.rows[0]:piece.rows[1], piece.cols[0]:piece.cols[1]]
                holder.weight.copy_(full)

    def weight(self, t: int) -> torch.Tensor:
        return self.tables[str(t)].weight

    def state_tensors(self) -> list[torch.Tensor]:
        states = [g.state for g in self.groups] + list(self.data_state.values())
        return [s for state in states for s in state.values()]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.layout.rows)
        anchor = torch.empty(0, device=ids.device, requires_grad=torch.is_grad_enabled())
        return _ShardedLookup.apply(anchor, ids, self)

    # -- forward ------------------------------------------------------------------------------------
    def _splits(self, per_piece: list[int]) -> list[int]:
        """Per rank: the sum of ``per_piece`` (one value per piece, in the exchange order) over its pieces."""
        out = [0] * self.layout.world
        for piece, n in zip(self.layout.pieces, per_piece):
            out[piece.rank] += n
        return out

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        """(pooled [B, T, D] of this rank's samples, what backward needs: each group's store rows)."""
        batch, tables, hot = ids.shape
        world, pieces, local = self.layout.world, self.layout.pieces, self.local
        out = torch.zeros((batch, tables, self.layout.dim), device=ids.device)
        for t in self.layout.data_tables:
            out[:, t] = pooled_lookup(self.weight(t), ids[:, t])
        if not pieces:
            return out, []
        send = torch.cat([ids[:, p.table].reshape(-1) for p in pieces])
        recv = ids.new_empty(world * len(local) * batch * hot)
        self.comm.all_to_all(recv, send, tag="emb_ids", input_splits=self._splits([batch * hot] * len(pieces)),
                             output_splits=[len(local) * batch * hot] * world)
        recv = recv.view(world, len(local), batch, hot)
        saved, pooled = [], [None] * len(local)
        for g in self.groups:  # each member over the global batch: [W, B, L]
            table_ids = torch.stack([recv[:, k] for k in g.members])
            shape = (len(g.members), 1, 1, 1)
            first = torch.tensor(g.firsts, device=ids.device).view(shape)
            size = torch.tensor(g.sizes, device=ids.device).view(shape)
            local_ids = table_ids - first
            partial = any(size != self.layout.rows[local[k].table] for k, size in zip(g.members, g.sizes))
            mask = ((local_ids >= 0) & (local_ids < size)).float().view(-1, hot) if partial else None
            rows = (torch.minimum(local_ids.clamp_min(0), size - 1)
                    + torch.tensor(g.offsets, device=ids.device).view(shape)).view(-1, hot)
            saved.append((rows, mask))
            group_pooled = torch.nn.functional.embedding_bag(rows, g.store, mode="sum", per_sample_weights=mask)
            for i, k in enumerate(group_pooled.view(len(g.members), world, batch, -1)):
                pooled[g.members[i]] = k
        # to each sample's rank, its rows of every local piece
        send_pooled = torch.cat([torch.cat([p[s].reshape(-1) for p in pooled]) for s in range(world)]) if local \
            else out.new_empty(0)
        widths = [batch * p.width for p in pieces]
        recv_pooled = out.new_empty(sum(widths))
        self.comm.all_to_all(recv_pooled, send_pooled, tag="emb_pooled", output_splits=self._splits(widths),
                             input_splits=[batch * sum(p.width for p in local)] * world)
        for piece, part in zip(pieces, recv_pooled.split(widths)):
            out[:, piece.table, piece.cols[0]:piece.cols[1]] += part.view(batch, piece.width)
        return out, saved

    # -- backward: the sparse update ------------------------------------------------------------------
    def apply_gradient(self, ids: torch.Tensor, saved: list, grad: torch.Tensor) -> None:
        batch, _, hot = ids.shape
        world, pieces, local = self.layout.world, self.layout.pieces, self.local
        if pieces:
            send = torch.cat([grad[:, p.table, p.cols[0]:p.cols[1]].reshape(-1) for p in pieces])
            widths = [batch * p.width for p in pieces]
            local_width = sum(p.width for p in local)
            recv = grad.new_empty(world * batch * local_width)
            self.comm.all_to_all(recv, send.contiguous(), tag="emb_pooled_backward", input_splits=self._splits(widths),
                                 output_splits=[batch * local_width] * world)
            by_source = [part.split([batch * p.width for p in local]) for part in recv.split(batch * local_width)]
            for g, (rows, mask) in zip(self.groups, saved):  # rows in the order [member, source rank, sample]
                width = g.store.shape[1]
                group_grad = torch.cat([src[k].view(batch, width) for k in g.members for src in by_source])
                self._update(g.store, g.state, rows, group_grad, mask, g.column)
        data = self.layout.data_tables
        if data:  # every replica applies the global batch's update
            all_ids = ids.new_empty((world * batch, len(data), hot))
            self.comm.all_gather(all_ids, ids[:, data].contiguous(), tag="emb_data_ids")
            all_grads = grad.new_empty((world * batch, len(data), self.layout.dim))
            self.comm.all_gather(all_grads, grad[:, data].contiguous(), tag="emb_data_grads")
            for k, t in enumerate(data):
                self._update(self.weight(t), self.data_state[t], all_ids[:, k], all_grads[:, k], None, False)

    def _update(self, weight: torch.Tensor, state: dict, rows: torch.Tensor, pooled_grad: torch.Tensor, mask,
                column: bool) -> None:
        touched, grad = row_gradient(rows, pooled_grad, mask)
        combine = None
        if column:  # every rank holds the same rows of each column-wise table: the same touched rows
            def combine(squares: torch.Tensor) -> torch.Tensor:
                self.comm.all_reduce(squares, tag="emb_column_squares")
                return squares
        self.optimizer.update(weight, state, touched, grad, self.layout.dim, combine)


class _ShardedLookup(torch.autograd.Function):
    """Pooled embeddings out of the sharded tables; backward updates the tables (no weight gradient)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, ids: torch.Tensor, module: ShardedEmbeddingBags) -> torch.Tensor:
        out, saved = module.lookup(ids)
        ctx.module, ctx.ids, ctx.saved = module, ids, saved
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.module.apply_gradient(ctx.ids, ctx.saved, grad.contiguous())
        return None, None, None
