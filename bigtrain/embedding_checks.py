"""The recommender's [embedding] section, before any process starts: the fields' own domains, for any
model (whether a recommender's tables can be placed is its family's rule, bigtrain/families/dlrm.py).

Imports no torch (as :mod:`bigtrain.validation`). What is built: docs/recommenders.md.
"""

from __future__ import annotations

from bigtrain.config import Config
from bigtrain.core.tables import SHARDINGS, SPARSE_OPTIMIZERS, parse_sizes
from bigtrain.field_checks import non_negative, one_of, positive


def check_embedding(cfg: Config) -> list[str]:
    """The [embedding] fields' own domains, for any model (a value no model accepts is a typo,
    whether this one reads it or not); whether a recommender's tables can be placed is its family's
    rule."""
    e, m = cfg.embedding, cfg.model
    problems = positive(cfg, ["embedding.dim", "embedding.hotness", "embedding.lr", "embedding.eps",
                              "model.dlrm_dense_features"])
    problems += non_negative(cfg, ["embedding.budget_gb"])
    problems += one_of("embedding.optimizer", e.optimizer, SPARSE_OPTIMIZERS)
    sizes = {}
    for dotted, text in (("embedding.tables", e.tables), ("model.dlrm_bottom_mlp", m.dlrm_bottom_mlp),
                         ("model.dlrm_top_mlp", m.dlrm_top_mlp)):
        try:
            sizes[dotted] = parse_sizes(text)
        except ValueError:
            problems.append(f"{dotted} = '{text}': use comma-separated sizes, 'NxR' for N of size R (e.g. '26x1000')")
            continue
        if any(n < 1 for n in sizes[dotted]):
            what = "a table with no rows" if dotted == "embedding.tables" else "a layer of size 0"
            problems.append(f"{dotted} = '{text}': {what}; every size must be >= 1")
    if "embedding.tables" in sizes and not sizes["embedding.tables"]:
        problems.append("embedding.tables is empty; give the rows of each table, e.g. '26x1000'")
    unknown = sorted({k.strip() for k in e.sharding.split(",")} - set(SHARDINGS))
    if unknown:  # for any model: a value no model accepts is a typo, whether this one reads it or not
        problems.append(f"embedding.sharding = '{e.sharding}': {', '.join(repr(k) for k in unknown)} is not one of "
                        f"{', '.join(SHARDINGS)} (one for every table, or one per table, comma-separated)")
    return problems
