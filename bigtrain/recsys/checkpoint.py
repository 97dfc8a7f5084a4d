"""Sharded checkpoints of a DLRM run through torch.distributed.checkpoint (``bigtrain.checkpoint.sharded``).

Every table is saved as one entry of its full shape, ``embeddings.tables.T.weight`` [rows, dim], and
its row-wise Adagrad accumulators as ``optim/embeddings.tables.T.weight/sum`` [rows]: each rank
writes the rectangles it holds (a whole table, a row range, a column range), so DCP's metadata
describes whole tables whatever the layout, and a run on another layout (another sharding, another
number of ranks) reads back the rectangles it holds now. A column-wise table's accumulators are the
same on every rank (combined over the ranks each step): the rank of its first columns writes them;
a data table (a replica on every rank) and the dense part (replicated: the bottom and top MLPs with
their optimizer state, ``dense/NAME`` and ``optim/dense/NAME/KEY``) are written by rank 0, as is the
step reached (``trainer/step``). The data is a function of the step, so nothing else is needed to
resume: the resumed run draws the batches the uninterrupted one would have drawn.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bigtrain import checkpoint as ckpt
from bigtrain.checkpoint.resume import check_same_model
from bigtrain.checkpoint.sharded import ChunkReader, save_chunks
from bigtrain.parallel.chunks import SavedChunk

STEP = "trainer/step"
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


def dlrm_chunks(trainer) -> list[SavedChunk]:
    """The chunks this rank writes (views of its live tables and state: write before the next step)."""
    emb, rank = trainer.parallel.embeddings, trainer.rank
    out = []
    for t, (row, col), shape, weight, state in _local_parts(emb):
        replica = emb.layout.kinds[t] == "data"
        if replica and rank != 0:
            continue
        out.append(SavedChunk(_table(t), shape, (row, col), weight.detach()))
        if state is not None and col == 0:
            out.append(SavedChunk(f"optim/{_table(t)}/sum", shape[:1], (row,), state))
    if rank == 0:
        weights, optim = trainer.engine.full_state()
        for name, w in weights.items():
            out.append(SavedChunk(f"dense/{name}", tuple(w.shape), (0,) * w.dim(), w))
        for name, entry in optim["state"].items():
            for key, value in entry.items():
                value = value if torch.is_tensor(value) else torch.tensor(value)
                out.append(SavedChunk(f"optim/dense/{name}/{key}", tuple(value.shape), (0,) * value.dim(), value))
        out.append(SavedChunk(STEP, (), (), torch.tensor(trainer.step, dtype=torch.int64)))
    return out


def save_dlrm(trainer, path: str | Path) -> Path:
    """Write ``trainer``'s tables, their optimizer state, the dense part and the step to ``path``;
    collective over the default group (every rank calls it)."""
    path = Path(path)
    save_chunks(path, dlrm_chunks(trainer))
    return path


def load_dlrm(trainer, path: str | Path) -> None:
    """Fill ``trainer``'s tables (its current layout's pieces), their state, the dense part and the
    step from the checkpoint at ``path``, whatever layout wrote it. No collectives."""
    reader = ChunkReader(Path(path))
    emb = trainer.parallel.embeddings
    requests = []
    for t, (row, col), _, weight, state in _local_parts(emb):
        requests.append((_table(t), (row, col), weight.detach()))
        if state is not None:
            fqn = f"optim/{_table(t)}/sum"
            if not reader.has(fqn):
                raise ValueError(f"checkpoint {path} has no {fqn}: saved with embedding.optimizer = 'sgd'?")
            requests.append((fqn, (row,), state))
    dense_names = [n for n, _ in trainer.engine.model.named_parameters()]
    weights = {n: reader.empty(f"dense/{n}") for n in dense_names}
    requests += [(f"dense/{n}", (0,) * w.dim(), w) for n, w in weights.items()]
    state: dict[str, dict[str, torch.Tensor]] = {}
    for fqn in reader.entries:
        if fqn.startswith("optim/dense/"):
            name, key = fqn[len("optim/dense/"):].rsplit("/", 1)
            value = state.setdefault(name, {})[key] = reader.empty(fqn)
            requests.append((fqn, (0,) * value.dim(), value))
    step = reader.empty(STEP)
    reader.read(requests + [(STEP, (), step)])
    trainer.engine.load_full_state(weights, {"optimizer": trainer.engine.optim_spec.name, "state": state})
    trainer.step = int(step)


def commit_dlrm(trainer, root: str | Path, keep: int) -> Path:
    """Checkpoint ``step_<step>`` under ``root`` with bigtrain's commit (rank 0 checksums the files,
    writes the manifest and renames the folder once every rank's files are written); collective."""
    root, comm = Path(root), trainer.comm
    tmp = ckpt.temp_dir(root, trainer.step)
    if trainer.rank == 0:
        ckpt.fresh_temp_dir(root, trainer.step)
    # On the tables' device: NCCL takes device tensors only.
    comm.all_reduce(torch.zeros(1, device=trainer.device), tag="checkpoint")  # DCP's writers need rank 0's folder
    save_dlrm(trainer, tmp)
    final = ckpt.temp_dir(root, trainer.step).with_suffix("")
    if trainer.rank == 0:
        meta = {"format": FORMAT, "config": trainer.cfg.to_dict(), "world_size": trainer.world,
                "optimizer": trainer.engine.optim_spec.name}
        final = ckpt.commit_checkpoint(root, trainer.step, tmp, meta, keep)
    comm.all_reduce(torch.zeros(1, device=trainer.device), tag="checkpoint")  # every rank returns once committed
    return final


def resume_dlrm(trainer, where: str | Path) -> Path | None:
    """Load the newest checkpoint that verifies under ``where`` (a checkpoints folder or one
    checkpoint), whatever layout wrote it; None (nothing loaded) when there is none."""
    found = ckpt.newest_valid_checkpoint(Path(where))
    if found is None:
        return None
    meta = found[1]
    if meta.get("format") != FORMAT:
        raise ValueError(f"{found[0]} is not a DLRM checkpoint (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    check_same_model(trainer.cfg, trainer.engine.optim_spec.name, found[0], meta, warn=trainer.rank == 0)
    load_dlrm(trainer, found[0])
    return found[0]
