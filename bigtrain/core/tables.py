"""The embedding tables' configuration, checked without torch (config validation imports this)."""

from __future__ import annotations

KINDS = ("table", "row", "column", "data")
SHARDINGS = ("auto", *KINDS)
SPARSE_OPTIMIZERS = ("rowwise_adagrad", "sgd")
ROW_STATE_OPTIMIZERS = ("rowwise_adagrad",)  # those that keep state per row (an accumulator: optim/sparse.py)


def parse_sizes(text: str) -> list[int]:
    """'64,32' -> [64, 32]; '26x1000' -> [1000] * 26 (mixed: '2x10,500'); '' -> []. ValueError on bad text."""
    sizes: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        count, _, size = part.rpartition("x")
        sizes += [int(size)] * (int(count) if count else 1)
    return sizes


def requested_kinds(sharding: str, tables: int) -> list[str]:
    """'row' -> ['row'] * tables; 'table,row,...' -> per table (its length must be ``tables``)."""
    kinds = [k.strip() for k in sharding.split(",")]
    if len(kinds) == 1:
        return kinds * tables
    if len(kinds) != tables:
        raise ValueError(f"embedding.sharding lists {len(kinds)} kinds for {tables} tables; give one kind, or one "
                         f"per table")
    return kinds


def check_layout(rows: list[int], dim: int, world: int, kinds: list[str]) -> list[str]:
    """What stops tables being placed as ``kinds`` says on ``world`` ranks (field names as in the config)."""
    empty = [t for t, r in enumerate(rows) if r < 1]
    unknown = sorted({k for k in kinds if k not in SHARDINGS})
    rows_cut = [t for t, (r, k) in enumerate(zip(rows, kinds)) if k == "row" and r >= 1 and r % world]
    columns_cut = [t for t, k in enumerate(kinds) if k == "column"]
    problems = []
    if empty:
        problems.append(f"embedding.tables: table(s) {_listed(empty)} have no rows; every table needs at least one")
    if unknown:
        problems.append(f"embedding.sharding: {', '.join(repr(k) for k in unknown)} is not one of "
                        f"{', '.join(SHARDINGS)}")
    if rows_cut:
        problems.append(f"embedding.sharding: table(s) {_listed(rows_cut)} (rows {_listed([rows[t] for t in rows_cut])})"
                        f" cannot be cut row-wise over {world} ranks; give them a multiple of {world} rows in "
                        f"embedding.tables or shard them 'table'")
    if columns_cut and dim % world:
        problems.append(f"embedding.sharding: table(s) {_listed(columns_cut)} cannot be cut column-wise over {world} "
                        f"ranks: embedding.dim = {dim} is not a multiple of {world}")
    return problems


def _listed(items: list[int], most: int = 6) -> str:
    shown = ", ".join(str(i) for i in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
