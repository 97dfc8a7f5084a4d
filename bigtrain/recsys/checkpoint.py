"""Sharded checkpoints of a DLRM run through torch.distributed.checkpoint (``bigtrain.checkpoint.sharded``).

Every table is saved as one entry of its full shape, ``embeddings.tables.T.weight`` [rows, dim], and
its row-wise Adagrad accumulators as ``optim/embeddings.tables.T.weight/sum`` [rows]: each rank
writes the rectangles it holds (a whole table, a row range, a column range), so DCP's metadata
describes whole tables whatever the layout, and a run on another layout (another sharding, another
number of ranks) reads back the rectangles it holds now. A column-wise table's accumulators are the
same on every rank (combined over the ranks each step): the rank of its first columns writes them;
a data table (a replica on every rank) and the dense part (replicated: the bottom and top MLPs with
their optimizer state, ``dense/NAME`` and ``optim/dense/NAME/KEY``) are written by rank 0. The step
is the manifest's, and the commit (every rank writes, then they agree, rank 0 commits) is
:class:`bigtrain.train.Trainer`'s, as for every family. The data is a function of the step, so
nothing else is needed to resume: the resumed run draws the batches the uninterrupted one would have
drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bigtrain.parallel.chunks import SavedChunk

if TYPE_CHECKING:  # the reader is handed in; importing DCP costs a process that never loads ~1 s
    from bigtrain.checkpoint.sharded import ChunkReader

FORMAT = "dcp-dlrm/1"  # meta.json "format": the entries above, not a language model's


def _table(t: int) -> str:
    return f"embeddings.tables.{t}.weight"


def _local_parts(emb) -> list[tuple[int, tuple[int, int], tuple[int, int], torch.Tensor, torch.Tensor | None]]:
    """(table, (first row, first column), the full shape, this rank's weight part, its accumulators
    or None) for every table part this rank holds; views of the live stores."""
    layout, out = emb.layout, []
    for g in emb.groups:
        for k, offset, size in zip(g.members, g.offsets, g.sizes):
            piece = emb.local[k]
            state = g.state["sum"][offset:offset + size] if "sum" in g.state else None
            out.append((piece.table, (piece.rows[0], piece.cols[0]), (layout.rows[piece.table], layout.dim),
                        emb.weight(piece.table), state))
    for t in layout.data_tables:
        state = emb.data_state[t].get("sum")
        out.append((t, (0, 0), (layout.rows[t], layout.dim), emb.weight(t), state))
    return out


def dlrm_chunks(parallel, copy: bool = False) -> list[SavedChunk]:
    """The chunks this rank writes: views of its live tables and state (``copy``: snapshots, for a
    write in the background while training goes on), the dense part's full state on rank 0."""
    emb, rank = parallel.embeddings, parallel.embeddings.rank
    own = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
    out = []
    for t, (row, col), shape, weight, state in _local_parts(emb):
        replica = emb.layout.kinds[t] == "data"
        if replica and rank != 0:
            continue
        out.append(SavedChunk(_table(t), shape, (row, col), own(weight)))
        if state is not None and col == 0:
            out.append(SavedChunk(f"optim/{_table(t)}/sum", shape[:1], (row,), own(state)))
    if rank == 0:
        weights, optim = parallel.engine.full_state()  # copies
        for name, w in weights.items():
            out.append(SavedChunk(f"dense/{name}", tuple(w.shape), (0,) * w.dim(), w))
        for name, entry in optim["state"].items():
            for key, value in entry.items():
                value = value if torch.is_tensor(value) else torch.tensor(value)
                out.append(SavedChunk(f"optim/dense/{name}/{key}", tuple(value.shape), (0,) * value.dim(), value))
    return out


def load_dlrm(parallel, reader: ChunkReader) -> None:
    """Fill ``parallel``'s tables (its current layout's pieces), their state and the dense part
    from the checkpoint ``reader`` reads, whatever layout wrote it. No collectives. (The step is the
    manifest's; checkpoints before the shared trainer also hold it as ``trainer/step``.)"""
    emb, engine = parallel.embeddings, parallel.engine
    requests = []
    for t, (row, col), _, weight, state in _local_parts(emb):
        requests.append((_table(t), (row, col), weight.detach()))
        if state is not None:
            fqn = f"optim/{_table(t)}/sum"
            if not reader.has(fqn):
                raise ValueError(f"checkpoint {reader.path} has no {fqn}: saved with embedding.optimizer = 'sgd'?")
            requests.append((fqn, (row,), state))
    dense_names = [n for n, _ in engine.model.named_parameters()]
    weights = {n: reader.empty(f"dense/{n}") for n in dense_names}
    requests += [(f"dense/{n}", (0,) * w.dim(), w) for n, w in weights.items()]
    state: dict[str, dict[str, torch.Tensor]] = {}
    for fqn in reader.entries:
        if fqn.startswith("optim/dense/"):
            name, key = fqn[len("optim/dense/"):].rsplit("/", 1)
            value = state.setdefault(name, {})[key] = reader.empty(fqn)
            requests.append((fqn, (0,) * value.dim(), value))
    reader.read(requests)
    engine.load_full_state(weights, {"optimizer": engine.optim_spec.name, "state": state})
