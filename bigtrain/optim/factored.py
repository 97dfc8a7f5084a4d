"""The sizes of Adafactor's factored second moment, without torch: read by its spec (the planner's
bytes) and by the optimizer itself."""

from __future__ import annotations

import math


def stat_sizes(shape: tuple[int, ...]) -> tuple[int, int]:
    """Adafactor's (row statistics, column statistics) for a parameter of ``shape``: a matrix, or a
    stack of them, factored over its last two dims; a vector keeps its full second moment as the
    "rows" and no columns."""
    if len(shape) < 2:
        return math.prod(shape), 0
    lead = math.prod(shape[:-2])
    return lead * shape[-2], lead * shape[-1]
