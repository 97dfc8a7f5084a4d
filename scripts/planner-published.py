"""The published-runs table of docs/planner.md, each run with its whole layout given.

    PYTHONPATH=. python scripts/planner-published.py            # the table (markdown)
    PYTHONPATH=. python scripts/planner-published.py --fit      # also the grid the GEMM parameters came from

Unlike ``python -m bigtrain.plan.published`` (the planner searches the keys a source leaves out),
every layout key is fixed here (``published.full_layout``), so the figure compares the time model
alone. ``--fit`` scans the shape-aware model's free parameters on a coarse grid (gemm_fraction per
accelerator, gemm_half_dim shared) and prints the worst |ratio - 1| of each; nothing else is fitted.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

from bigtrain.plan import published


def rows(overrides: dict[str, dict] | None = None) -> list[dict]:
    return [published.evaluate_published(run, (overrides or {}).get(run.hardware[:4])) for run in published.RUNS]


def held_within(table: list[dict]) -> int:
    """How many of the 19 Megatron rows (2021 Table 1 and Megatron-Core's H100 table) are within 15%."""
    return sum(r["source"] in (published.NARAYANAN, published.MCORE) and abs(r["ratio"] - 1) <= 0.15 for r in table)


def main() -> int:
    table = rows()
    print(published.markdown_table(table))
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in table)
    print(f"\n{within} of {len(table)} rows within 15%, {held_within(table)} of the 19 Megatron rows; "
          f"worst {max(abs(r['ratio'] - 1) for r in table):.1%}")
    if "--fit" in sys.argv:
        for a100, h100, half in itertools.product((0.65, 0.7, 0.75), (0.55, 0.58, 0.6, 0.65), (64, 128)):
            grid = rows({"a100": dict(gemm_fraction=a100, gemm_half_dim=half),
                         "h100": dict(gemm_fraction=h100, gemm_half_dim=half)})
            worst = max(abs(r["ratio"] - 1) for r in grid)
            print(f"a100 {a100} h100 {h100} half_dim {half}: worst {worst:.3f}, "
                  f"within 15%: {sum(abs(r['ratio'] - 1) <= 0.15 for r in grid)}, of the 19: {held_within(grid)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
