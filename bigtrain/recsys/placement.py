"""The embedding sharding planner: where each table goes, balancing memory and all-to-all volume.

Per table (``embedding.sharding = 'auto'``):

1. a table larger than an even share of all the tables (their bytes / W) cannot be balanced whole:
   it is cut column-wise when W divides the dimension (each rank pools D/W of every lookup and sends
   back only that: B D per table, as a whole table), else row-wise when W divides its rows (each
   rank sends back a partial sum of the whole width: W B D), else it stays whole;
2. the other tables are placed whole (table-wise), largest first, each on the rank where the larger
   of its two normalized loads stays smallest: memory (bytes held / all bytes) and traffic (the
   pooled embeddings it sends back, 4 W B D per table per step / all of them);
3. if a rank still holds more than ``budget`` bytes, or more than 1.25 times the mean, the largest
   whole table that divides is cut (column-wise, else row-wise) and placement runs again, until
   every rank fits and the ranks are balanced, or nothing more can be cut.

An explicit ``embedding.sharding`` (one kind, or one per table) is kept; only the owners of
table-wise tables are chosen, by step 2. Bytes: fp32 weights plus the sparse optimizer's state
(4 bytes a row for row-wise Adagrad).
"""

from __future__ import annotations

import json

from bigtrain.core.tables import KINDS, check_layout, parse_sizes, requested_kinds
from bigtrain.parallel.embedding_layout import VALUE_BYTES, EmbeddingLayout, all_to_all_payload


def table_bytes(rows: int, dim: int, state_bytes_per_row: int) -> int:
    return rows * (dim * VALUE_BYTES + state_bytes_per_row)


def plan_embedding(rows: list[int], dim: int, world: int, sharding: str = "auto", state_bytes_per_row: int = 4,
                   budget_bytes: int = 0) -> EmbeddingLayout:
    """The layout of ``rows`` (one table each) over ``world`` ranks; raises ValueError naming the field
    when a requested sharding cannot divide or (with ``budget_bytes``) the tables do not fit."""
    kinds = requested_kinds(sharding, len(rows))
    if "auto" in kinds:
        kinds = _auto_kinds(rows, dim, world, kinds, state_bytes_per_row)
    problems = check_layout(rows, dim, world, kinds)
    if problems:
        raise ValueError("; ".join(problems))
    auto = sharding == "auto"
    while True:
        layout = EmbeddingLayout(tuple(rows), dim, world, tuple(kinds), _owners(rows, dim, world, kinds,
                                                                               state_bytes_per_row))
        per_rank = [layout.rank_bytes(r, state_bytes_per_row) for r in range(world)]
        worst, fits = max(per_rank), not budget_bytes or max(per_rank) <= budget_bytes
        balanced = worst <= IMBALANCE * sum(per_rank) / world
        # over the budget: cut row-wise first (it splits the optimizer state too); unbalanced: column-wise
        whole = [t for t, k in enumerate(kinds) if k == "table" and _cut_kind(rows[t], dim, world, not fits)]
        if fits and (balanced or not auto or not whole):
            return layout
        if not auto or not whole:
            raise ValueError(f"embedding.budget_gb: a rank needs {worst:,} bytes ({worst / 2**30:.3f} GiB) for its "
                             f"tables, over the budget of {budget_bytes:,} bytes on {world} ranks; use more ranks, a "
                             f"larger budget, or row- or column-wise sharding")
        largest = max(whole, key=lambda t: rows[t])
        kinds[largest] = _cut_kind(rows[largest], dim, world, not fits)


IMBALANCE = 1.25  # 'auto' cuts whole tables until no rank holds more than this times the mean


def _cut_kind(rows: int, dim: int, world: int, rows_first: bool = False) -> str | None:
    """How 'auto' cuts a table: column-wise (less pooled traffic) when the ranks divide the dimension,
    row-wise otherwise; with ``rows_first`` (memory is short) the other way round: a row cut splits the
    per-row optimizer state, which each column piece holds whole."""
    order = [("row", rows), ("column", dim)] if rows_first else [("column", dim), ("row", rows)]
    return next((kind for kind, size in order if world > 1 and size % world == 0), None)


def _auto_kinds(rows: list[int], dim: int, world: int, kinds: list[str], state_bytes_per_row: int) -> list[str]:
    share = sum(table_bytes(r, dim, state_bytes_per_row) for r in rows) / world
    return [k if k != "auto" else (_cut_kind(r, dim, world) if table_bytes(r, dim, state_bytes_per_row) > share
                                   else None) or "table" for r, k in zip(rows, kinds)]


def _owners(rows: list[int], dim: int, world: int, kinds: list[str], state_bytes_per_row: int) -> tuple[int, ...]:
    """Greedy: whole tables, largest first, each where max(memory share, traffic share) grows least."""
    memory, traffic = [0.0] * world, [0.0] * world
    total_memory = sum(table_bytes(r, dim, state_bytes_per_row) for r in rows) or 1
    whole = [t for t, k in enumerate(kinds) if k == "table"]
    total_traffic = len(whole) or 1
    for t, kind in enumerate(kinds):  # what the cut and replicated tables put on every rank
        if kind in ("row", "column", "data"):
            per_rank = table_bytes(rows[t], dim, state_bytes_per_row) / (1 if kind == "data" else world)
            for r in range(world):
                memory[r] += per_rank / total_memory
    owners = [-1] * len(rows)
    for t in sorted(whole, key=lambda t: (-rows[t], t)):
        m = table_bytes(rows[t], dim, state_bytes_per_row) / total_memory
        best = min(range(world), key=lambda r: (max(memory[r] + m, traffic[r] + 1 / total_traffic), r))
        owners[t] = best
        memory[best] += m
        traffic[best] += 1 / total_traffic
    return tuple(owners)


def micro_batch_sizes(batch: int, micro_batch: int) -> list[int]:
    """The forwards a rank takes on its ``batch`` samples of a step: micro-batches of
    ``train.micro_batch`` (clamped to 1..batch), the last one smaller when it does not divide
    (:class:`bigtrain.recsys.train.DlrmStep`)."""
    micro = max(1, min(micro_batch, batch))
    return [min(micro, batch - first) for first in range(0, batch, micro)]


def step_payload(layout: EmbeddingLayout, rank: int, batch: int, hotness: int, micro_batch: int) -> dict[str, int]:
    """Bytes ``rank`` hands each all-to-all over one step, by tag: every micro-batch of its ``batch``
    (:func:`micro_batch_sizes`) exchanges its own ids and pooled embeddings, forward and backward, so
    the sizes add up to the whole batch's, and what each exchange pays whatever its size (the id
    counts of row-wise tables) is paid once a micro-batch."""
    out: dict[str, int] = {}
    for size in micro_batch_sizes(batch, micro_batch):
        for tag, n in all_to_all_payload(layout, rank, size, hotness).items():
            out[tag] = out.get(tag, 0) + n
    return out


def step_calls(layout: EmbeddingLayout, batch: int, micro_batch: int) -> dict[str, int]:
    """All-to-all calls each rank makes over one step, by tag: the count a collective's latency is
    paid for (as the dense planner's ``UnitCollective.calls``, each priced by ``Link.collective``),
    which the bytes of :func:`step_payload` do not show. Every micro-batch of the rank's ``batch``
    posts its own: the ids (after their counts when a table is row-wise), the pooled embeddings and,
    backward, their gradients. None on one rank (the exchange is a copy) or without pieces."""
    if layout.world == 1 or not layout.pieces:
        return {}
    tags = ["emb_ids", *(["emb_id_counts"] if "row" in layout.kinds else []), "emb_pooled", "emb_pooled_backward"]
    return dict.fromkeys(tags, len(micro_batch_sizes(batch, micro_batch)))


def describe_plan(layout: EmbeddingLayout, batch: int, hotness: int, state_bytes_per_row: int = 4,
                  micro_batch: int | None = None) -> str:
    """The table placement and, per rank, its bytes and its all-to-all payload per step (its batch in
    micro-batches of ``micro_batch``; None: one)."""
    micro = batch if micro_batch is None else micro_batch
    sizes = micro_batch_sizes(batch, micro)
    micro_text = (f", {len(sizes)} micro-batches of {sizes[0]}, each exchanging its own" if len(sizes) > 1
                  else "")
    lines = [f"embedding tables over {layout.world} ranks (batch {batch} per rank{micro_text}, {hotness} ids per "
             f"feature):", layout.describe(), "", f"{'rank':>4}  {'tables GiB':>11}  {'all-to-all MiB/step':>20}"]
    for r in range(layout.world):
        payload = sum(step_payload(layout, r, batch, hotness, micro).values())
        lines.append(f"{r:>4}  {layout.rank_bytes(r, state_bytes_per_row) / 2**30:>11.3f}  {payload / 2**20:>20.2f}")
    counts = {k: layout.kinds.count(k) for k in KINDS if k in layout.kinds}
    lines.append("kinds: " + ", ".join(f"{n} {k}-wise" for k, n in counts.items()))
    calls = step_calls(layout, batch, micro)
    if calls:
        lines.append(f"all-to-all calls per step on each rank: {sum(calls.values())} ("
                     + ", ".join(f"{n} {tag}" for tag, n in calls.items()) + "), each paying the link's latency")
    return "\n".join(lines)


def cmd_plan_embedding(cfg, gpus: int, as_json: bool = False) -> int:
    """``bigtrain plan --preset dlrm-... --gpus N``: the tables' placement on N ranks, or why none fits
    (the batch: train.global_batch, which ``--global-batch`` sets; its micro-batches: train.micro_batch,
    which ``--micro-batch`` sets)."""
    from bigtrain.config import ConfigError
    from bigtrain.optim.sparse import SparseOptimizer

    e = cfg.embedding
    state = SparseOptimizer(e.optimizer, e.lr).state_bytes_per_row()
    if gpus < 1:  # was a ZeroDivisionError (0) or "min() arg is an empty sequence" (-1)
        raise ConfigError(f"--gpus = {gpus}: must be a positive integer")
    if cfg.train.global_batch % gpus:  # a run refuses it: the payload of a floored batch is no run's
        raise ConfigError(f"train.global_batch = {cfg.train.global_batch} is not divisible by --gpus = {gpus} (each "
                          f"rank takes global_batch / gpus samples); use --gpus dividing it, or --global-batch (or a "
                          f"config's train.global_batch) a multiple of {gpus}")
    batch = cfg.train.global_batch // gpus
    try:
        layout = plan_embedding(parse_sizes(e.tables), e.dim, gpus, e.sharding, state, int(e.budget_gb * 2**30))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    micro = cfg.train.micro_batch
    if as_json:
        print(json.dumps({"kinds": layout.kinds, "owners": layout.owners, "batch_per_rank": batch,
                          "micro_batches": micro_batch_sizes(batch, micro),
                          "rank_bytes": [layout.rank_bytes(r, state) for r in range(gpus)],
                          "all_to_all_payload": [step_payload(layout, r, batch, e.hotness, micro)
                                                 for r in range(gpus)],
                          "all_to_all_calls": step_calls(layout, batch, micro)},
                         indent=1))
    else:
        print(describe_plan(layout, batch, e.hotness, state, micro))
    return 0
