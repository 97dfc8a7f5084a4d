"""Python-side communication runs eagerly under ``torch.compile``: a compiled block's graph breaks
around it, and the pieces between compile (``bigtrain/parallel/compile.py``).

``torch.compiler.disable`` imports dynamo when it decorates, about 2 s of every process's start
(each rank, each CLI call), compiled or not. ``torch._disable_dynamo`` is the same decorator with
that import moved to the first call, which torch uses on its own functions for this reason; dynamo
skips its wrapper (``torch._compile`` is on its skip list), so under compile the call runs eagerly
exactly as ``torch.compiler.disable``'s would (tests/test_compile.py: compiled tp, sp, cp layouts
against the reference).
"""

from __future__ import annotations

import torch

eager_under_compile = torch._disable_dynamo
