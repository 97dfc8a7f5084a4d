"""Embedding tables sharded over the ranks, looked up through all-to-all (TorchRec's sharded
EmbeddingBagCollection, written on our collectives and placement record).

A :class:`~bigtrain.parallel.embedding_layout.EmbeddingLayout` says, per table, how it is placed
over the ``W`` ranks of the data axis (``table``, ``row``, ``column`` or ``data``), and gives the
first three their *pieces* (one, or one per rank). A step, on each rank of a local batch of ``B``
samples with ``L`` ids per table:

1. ids, forward: all-to-all; rank s sends each table or column piece's owner the ids of that
   piece's table for its ``B`` samples, and each row piece's owner only the ids in its row range
   (bucketized), each tagged ``sample * piece rows + local row``, after an all-to-all of their counts;
2. each rank pools its pieces over the ``W B`` samples of the global batch (a row piece's samples
   bring 0 to ``L`` ids each: bags with offsets);
3. pooled embeddings, forward: all-to-all back to the samples' ranks, which sum the row pieces and
   put the column pieces side by side;
4. backward: the pooled gradients travel the reverse all-to-all to the pieces' owners (started
   asynchronously: autograd goes on with the dense part meanwhile); the update waits in
   :attr:`ShardedEmbeddingBags.pending` (one record a micro-batch, inside
   :meth:`~ShardedEmbeddingBags.accumulating`) until the step decides it (the NaN policy: a step any rank
   finds non-finite updates nothing, tables included): :meth:`~ShardedEmbeddingBags.finish_update`
   then has the sparse optimizer (:mod:`bigtrain.optim.sparse`) update the rows the batch touched,
   each row's gradients summed over the step's micro-batches first (one update of the whole batch;
   row-wise Adagrad on a column piece first all-reduces its per-row squares over the ranks), or
   drops the gradients.

``data`` tables look up locally; backward all-gathers their ids and pooled gradients, so every
replica applies the same update of the global batch and no dense gradient is reduced.

The bytes each all-to-all moves: :func:`~bigtrain.parallel.embedding_layout.all_to_all_payload`.

The tables never enter the dense engine: their placement says so (no ``partial`` axis, hence no
data-parallel reduction), and the engine is handed only the dense modules.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.models.dlrm import pooled_lookup
from bigtrain.optim.sparse import SparseOptimizer, row_gradient
from bigtrain.parallel.embedding_layout import EmbeddingLayout


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
    """This rank's pieces of one width and one way of receiving ids, stacked in one ``store``
    (FBGEMM's table-batched embedding): one lookup, one gradient and one optimizer update for all of
    them. Row pieces receive bucketized ids (a variable number a sample), the others ``hotness`` ids
    a sample; column pieces form a group of their own (their row-wise state is combined over the ranks)."""

    members: list[int]  # positions in the rank's pieces
    sizes: list[int]  # each member's rows
    offsets: list[int]  # its first row in the store
    kind: str  # "row", "column" or "table"
    store: torch.Tensor
    state: dict[str, torch.Tensor]
    first_member: int | None  # members[0] when the members are consecutive positions, else None
    positions: list[int] = field(default_factory=list)  # each member's place among the ids it receives
    offsets_t: torch.Tensor | None = None  # ``offsets`` as a tensor
    positions_t: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.store.shape[1]


def _consecutive(members: list[int]) -> int | None:
    return members[0] if members == list(range(members[0], members[0] + len(members))) else None


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
        by_kind: dict[tuple[int, str], list[int]] = {}
        for k, piece in enumerate(self.local):
            by_kind.setdefault((piece.width, layout.kinds[piece.table]), []).append(k)
        self.groups, holders = [], {}
        for (width, kind), members in by_kind.items():
            sizes = [self.local[k].shape[0] for k in members]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            store = torch.empty((sum(sizes), width), device=device)
            self.groups.append(PieceGroup(members, sizes, offsets, kind, store, optimizer.new_state(store),
                                          _consecutive(members)))
            for k, first, size in zip(members, offsets, sizes):
                holders[self.local[k].table] = TablePiece(store[first:first + size])
        for t in layout.data_tables:
            holders[t] = TablePiece(torch.empty((layout.rows[t], layout.dim), device=device))
        self.tables = nn.ModuleDict({str(t): holders[t] for t in sorted(holders)})
        self.data_state = {t: optimizer.new_state(self.weight(t)) for t in layout.data_tables}
        # The step's backwards' table gradients, one record (ids, saved lookup, pooled gradients, the
        # all-to-all in flight) a micro-batch, until finish_update applies or drops them together.
        self.pending: list[tuple] = []
        self._micro_batches_open = False  # inside accumulating(): a forward may find records pending
        self._plan_exchanges(device)

    def _plan_exchanges(self, device) -> None:
        """The index tensors and sizes every step's packing reuses."""
        layout, kinds, world = self.layout, self.layout.kinds, self.layout.world
        pieces = layout.pieces
        tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        # ids: to each rank, its table and column pieces' ids (by table), then its row pieces' (bucketized)
        self.fixed_pieces = [p for p in pieces if kinds[p.table] != "row"]
        self.fixed_tables = tensor([p.table for p in self.fixed_pieces])
        self.fixed_per_rank = [sum(p.rank == r for p in self.fixed_pieces) for r in range(world)]
        self.row_tables = [t for t, k in enumerate(kinds) if k == "row"]
        self.row_tables_t = tensor(self.row_tables)
        self.row_steps = tensor([layout.rows[t] // world for t in self.row_tables]).view(-1, 1, 1)
        local_fixed = [k for k, p in enumerate(self.local) if kinds[p.table] != "row"]
        local_row = [k for k, p in enumerate(self.local) if kinds[p.table] == "row"]
        self.fixed_position = {k: i for i, k in enumerate(local_fixed)}  # local piece -> place in the id block
        self.row_position = {k: i for i, k in enumerate(local_row)}
        for g in self.groups:
            g.positions = [(self.row_position if g.kind == "row" else self.fixed_position)[k] for k in g.members]
            g.positions_t = tensor(g.positions)
            g.offsets_t = tensor(g.offsets)
        # pooled embeddings: each piece's place in the [tables, batch, dim] output
        self.piece_tables = tensor([p.table for p in pieces])
        self.full_width = all(p.width == layout.dim for p in pieces)
        once = sorted(p.table for p in pieces) == list(range(len(layout.rows)))
        self.piece_of_table = tensor(sorted(range(len(pieces)), key=lambda i: pieces[i].table)) if once else None
        widths = [p.width for p in self.local]
        self.local_width = sum(widths)
        self.local_start = [sum(widths[:k]) for k in range(len(widths))]  # per sample, within a rank's block

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

    @contextlib.contextmanager
    def accumulating(self):
        """The forwards and backwards of one step's micro-batches: each backward's table gradients
        join the pending ones, for one update of the whole batch at :meth:`finish_update` (a table
        must not change between the micro-batches of a step). Outside, a forward with an update still
        pending is refused: the previous step was not finished."""
        self._micro_batches_open = True
        try:
            yield
        finally:
            self._micro_batches_open = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pending and torch.is_grad_enabled() and not self._micro_batches_open:
            raise RuntimeError("the tables' update of the previous backward is still pending: call finish_update "
                               "(apply or drop it) after the step's decision, before the next forward")
        check_ids(ids, self.layout.rows)
        anchor = torch.empty(0, device=ids.device, requires_grad=torch.is_grad_enabled())
        return _ShardedLookup.apply(anchor, ids, self)

    # -- forward ------------------------------------------------------------------------------------
    def _exchange_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]], list[list[int]]]:
        """(the table and column pieces' ids over the global batch, [W, their count, B, L]; per source
        rank and local row piece, the ids it sent (``sample * piece rows + local row``); their counts)."""
        batch, _, hot = ids.shape
        world, fixed_here = self.layout.world, len(self.fixed_position)
        by_table = ids.transpose(0, 1)
        fixed = by_table.index_select(0, self.fixed_tables).view(-1)  # by rank, then table
        fixed_blocks = fixed.split([n * batch * hot for n in self.fixed_per_rank])
        if not self.row_tables:
            recv = ids.new_empty(world * fixed_here * batch * hot)
            self.comm.all_to_all(recv, fixed, tag="emb_ids", input_splits=[b.numel() for b in fixed_blocks])
            return recv.view(world, fixed_here, batch, hot), [], []
        # bucketize the row-wise tables' ids by row range: each row piece gets only its own rows' ids,
        # each tagged with its sample (a variable number of ids per sample and piece)
        row_ids = by_table.index_select(0, self.row_tables_t)  # [R, B, L]
        owner = row_ids.div(self.row_steps, rounding_mode="floor")
        sample = torch.arange(batch, device=ids.device).view(1, -1, 1)
        tagged = row_ids - owner * self.row_steps + sample * self.row_steps
        to_rank = [owner == r for r in range(world)]
        counts = torch.stack([m.sum((1, 2)) for m in to_rank])  # [W, R]: by table within each destination
        recv_counts = torch.empty_like(counts)
        self.comm.all_to_all(recv_counts, counts, tag="emb_id_counts")
        send = torch.cat([part for r in range(world) for part in (fixed_blocks[r], tagged.masked_select(to_rank[r]))])
        sent, received = counts.sum(1).tolist(), recv_counts.tolist()
        output_splits = [fixed_here * batch * hot + sum(c) for c in received]
        recv = ids.new_empty(sum(output_splits))
        self.comm.all_to_all(recv, send, tag="emb_ids", output_splits=output_splits,
                             input_splits=[b.numel() + n for b, n in zip(fixed_blocks, sent)])
        blocks = recv.split(output_splits)
        fixed_recv = torch.stack([b[:fixed_here * batch * hot] for b in blocks]).view(world, fixed_here, batch, hot)
        row_recv = [list(b[fixed_here * batch * hot:].split(c)) for b, c in zip(blocks, received)]
        return fixed_recv, row_recv, received

    def _group_rows(self, g: PieceGroup, fixed_recv, row_recv, received, batch: int):
        """(store rows, the bag of each: None when every bag holds ``hotness`` ids, offsets of the bags)
        of group ``g`` over the global batch, bags in the order (member, source rank, sample)."""
        world = self.layout.world
        if g.kind != "row":
            rows = fixed_recv.transpose(0, 1).index_select(0, g.positions_t)  # [m, W, B, L]
            rows += g.offsets_t.view(-1, 1, 1, 1)
            return rows.view(-1, rows.shape[-1]), None, None
        tagged = torch.cat([row_recv[s][j] for j in g.positions for s in range(world)])
        lengths = torch.tensor([received[s][j] for j in g.positions for s in range(world)],
                               device=tagged.device)
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=tagged.device), lengths)
        size = torch.tensor(g.sizes, device=tagged.device).repeat_interleave(world)[segment]
        sample = tagged.div(size, rounding_mode="floor")
        rows = tagged - sample * size + g.offsets_t.repeat_interleave(world)[segment]
        bags = segment * batch + sample
        per_bag = torch.bincount(bags, minlength=len(g.members) * world * batch)
        return rows, bags, per_bag.cumsum(0) - per_bag

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        """(pooled [B, T, D] of this rank's samples, what backward needs: each group's store rows)."""
        batch, tables, hot = ids.shape
        world, pieces, dim = self.layout.world, self.layout.pieces, self.layout.dim
        if not pieces:
            out = ids.new_zeros((tables, batch, dim), dtype=torch.float32)
            for t in self.layout.data_tables:
                out[t] = pooled_lookup(self.weight(t), ids[:, t])
            return out.transpose(0, 1), []
        fixed_recv, row_recv, received = self._exchange_ids(ids)
        saved = []
        send = torch.empty((world, batch * self.local_width), device=ids.device)  # per rank: its samples' rows
        for g in self.groups:
            rows, bags, offsets = self._group_rows(g, fixed_recv, row_recv, received, batch)
            saved.append((rows, bags))
            pooled = torch.nn.functional.embedding_bag(rows, g.store, offsets, mode="sum")
            pooled = pooled.view(len(g.members), world, batch * g.width)
            if g.first_member is not None:  # consecutive pieces: one copy
                start = batch * self.local_start[g.first_member]
                send[:, start:start + pooled.numel() // world].view(world, len(g.members), -1).copy_(
                    pooled.transpose(0, 1))
            else:
                for k, part in zip(g.members, pooled):
                    start = batch * self.local_start[k]
                    send[:, start:start + batch * g.width].copy_(part)
        widths = [batch * p.width for p in pieces]
        recv = send.new_empty(sum(widths))
        self.comm.all_to_all(recv, send.view(-1), tag="emb_pooled", output_splits=self._splits(widths))
        return self._assemble(recv, ids), saved

    def _splits(self, per_piece: list[int]) -> list[int]:
        """Per rank: the sum of ``per_piece`` (one value per piece, in the exchange order) over its pieces."""
        out = [0] * self.layout.world
        for piece, n in zip(self.layout.pieces, per_piece):
            out[piece.rank] += n
        return out

    def _assemble(self, recv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[B, T, D] (a view of [T, B, D]) from the pieces' pooled rows: row pieces' partial sums
        added, column pieces side by side, data tables looked up here."""
        batch, tables, _ = ids.shape
        pieces, dim = self.layout.pieces, self.layout.dim
        if self.full_width and self.piece_of_table is not None:  # table-wise: each table one piece
            return recv.view(len(pieces), batch, dim).index_select(0, self.piece_of_table).transpose(0, 1)
        out = recv.new_zeros((tables, batch, dim))
        if self.full_width:
            out.index_add_(0, self.piece_tables, recv.view(len(pieces), batch, dim))
        else:
            for piece, part in zip(pieces, recv.split([batch * p.width for p in pieces])):
                out[piece.table, :, piece.cols[0]:piece.cols[1]] += part.view(batch, piece.width)
        for t in self.layout.data_tables:
            out[t] = pooled_lookup(self.weight(t), ids[:, t])
        return out.transpose(0, 1)

    # -- backward: the sparse update ------------------------------------------------------------------
    def apply_gradient(self, ids: torch.Tensor, saved: list, grad: torch.Tensor) -> None:
        """Send the pooled gradients to the pieces' owners and update the tables, at once."""
        self.update_tables([(ids, saved, grad, self.send_gradient(grad))])

    def pending_nonfinite(self) -> torch.Tensor:
        """1.0 when the pooled gradients this rank sent in the step's backwards hold a NaN or inf, else
        0.0 (a flag the step sums over the ranks: what any rank sent reaches some table's owner)."""
        flag = torch.zeros((), device=self.piece_tables.device)
        for _, _, grad, _ in self.pending:
            flag = torch.maximum(flag, (~torch.isfinite(grad).all()).float().to(flag.device))
        return flag

    def finish_update(self, apply: bool) -> None:
        """Apply the step's pending updates to the tables as one (``apply``; every rank decides alike:
        the data tables' and column pieces' updates are collectives) or drop them, waiting for their
        all-to-alls either way."""
        records, self.pending = self.pending, []
        if not records:
            return
        if apply:
            self.update_tables(records)
            return
        for *_, sent in records:
            if sent is not None and sent[0] is not None:
                sent[0].wait()  # the buffers live until the exchange is done

    def send_gradient(self, grad: torch.Tensor):
        """Start the all-to-all of the pooled gradients ``grad`` [B, T, D] to the pieces' owners:
        (its work handle, the buffer it fills [W, B x local width], the buffer it sends: kept alive
        until the wait), or None without pieces."""
        batch, pieces = grad.shape[0], self.layout.pieces
        if not pieces:
            return None
        by_table = grad.transpose(0, 1)  # [T, B, D]
        if self.full_width:
            send = by_table.index_select(0, self.piece_tables).view(-1)
        else:
            send = torch.cat([by_table[p.table, :, p.cols[0]:p.cols[1]].reshape(-1) for p in pieces])
        recv = grad.new_empty((self.layout.world, batch * self.local_width))
        work = self.comm.all_to_all(recv.view(-1), send, tag="emb_pooled_backward", async_op=True,
                                    input_splits=self._splits([batch * p.width for p in pieces]))
        return work, recv, send

    def update_tables(self, records: list[tuple]) -> None:
        """The sparse update of every local piece from the gradients the records' all-to-alls brought
        (waiting for them), then the data tables' (gathered here). ``records``: one (ids, saved lookup,
        pooled gradients, the exchange) per micro-batch of the step; each row's gradients are summed
        over all of them before the optimizer sees it, as one lookup of the whole batch gives."""
        per_group: list[list] = [[] for _ in self.groups]  # per group, per record: (rows, bags, grads)
        for ids, saved, _, sent in records:
            if sent is not None:
                for g, parts, got in zip(self.groups, per_group, self._received_grads(ids, saved, sent)):
                    parts.append(got)
        for g, parts in zip(self.groups, per_group):
            if parts:
                rows, bags, grad = _concat_bags(parts)
                self._update(g.store, g.state, rows, grad, g.kind == "column", bags)
        data = self.layout.data_tables
        if data:  # every replica applies the global batch's update
            gathered = [self._gathered_data(ids, grad) for ids, _, grad, _ in records]
            all_ids = torch.cat([i for i, _ in gathered])
            all_grads = torch.cat([gr for _, gr in gathered])
            for k, t in enumerate(data):
                self._update(self.weight(t), self.data_state[t], all_ids[:, k], all_grads[:, k], False)

    def _received_grads(self, ids: torch.Tensor, saved: list, sent) -> list[tuple]:
        """Per group: (its store rows, their bags, the pooled gradients ``sent`` brought for them, in
        the order (member, source, sample)), once the exchange is done."""
        batch, world = ids.shape[0], self.layout.world
        work, recv, _ = sent
        if work is not None:
            work.wait()
        out = []
        for g, (rows, bags) in zip(self.groups, saved):
            if g.first_member is not None:
                start = batch * self.local_start[g.first_member]
                part = recv[:, start:start + batch * g.width * len(g.members)].view(world, len(g.members), -1)
                group_grad = part.transpose(0, 1).reshape(-1, g.width)
            else:
                starts = [batch * self.local_start[k] for k in g.members]
                group_grad = torch.stack([recv[:, s:s + batch * g.width] for s in starts]).view(-1, g.width)
            out.append((rows, bags, group_grad))
        return out

    def _gathered_data(self, ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The data tables' ids and pooled gradients of every rank's samples (all-gathered)."""
        batch, _, hot = ids.shape
        data, world = self.layout.data_tables, self.layout.world
        all_ids = ids.new_empty((world * batch, len(data), hot))
        self.comm.all_gather(all_ids, ids[:, data].contiguous(), tag="emb_data_ids")
        all_grads = grad.new_empty((world * batch, len(data), self.layout.dim))
        self.comm.all_gather(all_grads, grad[:, data].contiguous(), tag="emb_data_grads")
        return all_ids, all_grads

    def _update(self, weight: torch.Tensor, state: dict, rows: torch.Tensor, pooled_grad: torch.Tensor,
                column: bool, bags: torch.Tensor | None = None) -> None:
        touched, grad = row_gradient(rows, pooled_grad, bags)
        combine = None
        if column:  # every rank holds the same rows of each column-wise table: the same touched rows
            def combine(squares: torch.Tensor) -> torch.Tensor:
                self.comm.all_reduce(squares, tag="emb_column_squares")
                return squares
        self.optimizer.update(weight, state, touched, grad, self.layout.dim, combine)


def _concat_bags(parts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One group's (rows, bags, pooled gradients) of several micro-batches as one lookup's: the rows
    and gradients one after the other, each micro-batch's bags shifted past the earlier ones'."""
    if len(parts) == 1:
        return parts[0]
    rows = torch.cat([r.reshape(-1, r.shape[-1]) if b is None else r for r, b, _ in parts])
    bags, shift = [], 0
    for _, b, grad in parts:
        if b is not None:
            bags.append(b + shift)
        shift += grad.shape[0]
    return rows, (torch.cat(bags) if bags else None), torch.cat([grad for _, _, grad in parts])


class _ShardedLookup(torch.autograd.Function):
    """Pooled embeddings out of the sharded tables; backward updates the tables (no weight gradient)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, ids: torch.Tensor, module: ShardedEmbeddingBags) -> torch.Tensor:
        out, saved = module.lookup(ids)
        ctx.module, ctx.ids, ctx.saved = module, ids, saved
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gradients' all-to-all runs while autograd goes on with the dense part (the bottom MLP);
        # the update waits for the step's decision (finish_update), which knows whether any rank's
        # loss or gradients were non-finite.
        module = ctx.module
        module.pending.append((ctx.ids, ctx.saved, grad, module.send_gradient(grad)))
        return None, None, None
