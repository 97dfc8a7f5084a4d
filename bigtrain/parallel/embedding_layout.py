"""Where each embedding table lives over the ``W`` ranks of the data axis (TorchRec's sharding plan,
as plain data). A :class:`EmbeddingLayout` says, per table:

- ``table``: whole on one rank (its ``owner``);
- ``row``: rows cut in ``W`` equal ranges, one per rank (rank r holds rows [r R/W, (r+1) R/W));
- ``column``: columns cut in ``W`` equal ranges, one per rank;
- ``data``: a replica on every rank.

The first three give each table its *pieces* (:class:`Piece`: one, or one per rank), which
:class:`bigtrain.parallel.embedding.ShardedEmbeddingBags` looks up through all-to-all.

Payload bytes per step and rank (what :class:`AxisComm` records; :func:`all_to_all_payload`):
ids ``8 B L (P' + R)`` (P': the table and column pieces of all tables, R: the row-wise tables,
whose ``B L`` ids go out once, whatever their rows), id counts ``8 W R`` (with row-wise tables),
pooled forward ``4 W B w_r`` (w_r: the widths of this rank's pieces summed), pooled backward
``4 B w`` (w: the widths of all pieces summed; D per table for table-wise and column-wise tables,
W D for row-wise ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from bigtrain.core.tables import check_layout
from bigtrain.parallel.placement import Placement, ShardSpec

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

    # Computed once (a frozen layout): W x T pieces for row- or column-wise tables, asked for per rank
    # by the planner and every step by the lookup; rebuilt and sorted each time, planning 26 row-wise
    # tables took 54 s on 200 ranks and ~20 min on 1000 (quadratic in the ranks).
    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """Every piece, by rank then table: the order of every exchange."""
        return tuple(sorted((p for t in range(len(self.rows)) for p in self.pieces_of(t)),
                            key=lambda p: (p.rank, p.table)))

    @cached_property
    def _pieces_by_rank(self) -> dict[int, tuple[Piece, ...]]:
        by_rank: dict[int, list[Piece]] = {}
        for p in self.pieces:
            by_rank.setdefault(p.rank, []).append(p)
        return {r: tuple(ps) for r, ps in by_rank.items()}

    def pieces_on(self, rank: int) -> list[Piece]:
        return list(self._pieces_by_rank.get(rank, ()))

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
    """Bytes this rank hands each all-to-all of one step (per-rank ``batch``), by tag. A row-wise
    table's ids are bucketized: each goes to the one piece holding its row, so the table sends
    ``batch x hotness`` ids in all whatever their rows, after a count per (rank, row-wise table)."""
    kinds, world, dim = layout.kinds, layout.world, layout.dim
    if not layout.pieces:
        return {}
    # per table, not per piece (W x T of them): the planner asks for every rank
    row_tables = kinds.count("row")
    fixed = kinds.count("table") + world * kinds.count("column")  # table and column pieces
    local = sum(p.width for p in layout.pieces_on(rank))
    widths = dim * (kinds.count("table") + kinds.count("column") + world * row_tables)  # all pieces'
    out = {"emb_ids": ID_BYTES * batch * hotness * (fixed + row_tables),
           "emb_pooled": VALUE_BYTES * world * batch * local,
           "emb_pooled_backward": VALUE_BYTES * batch * widths}
    if row_tables:
        out["emb_id_counts"] = ID_BYTES * layout.world * row_tables
    return out
