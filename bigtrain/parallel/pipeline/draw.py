"""Gantt chart of pipeline timelines (simulated or measured) written to a PNG."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from bigtrain.parallel.pipeline.schedules import Action

TimelineLabel = Action | str
Timelines = Sequence[Sequence[tuple[TimelineLabel, float, float]]]

_OP_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3"}
_OTHER_COLOR = "#999999"
_OP_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
# Measured timelines may label boxes with the text of an Action, e.g. "F3.s1" or "B0".
_LABEL = re.compile(r"^(?P<op>[FBIW])(?P<mb>\d+)(?:\.s(?P<stage>\d+))?$")


def _parse(label: TimelineLabel) -> tuple[str, str, int | None]:
    """(op letter or "?", text to print in the box, stage or None)."""
    if isinstance(label, Action):
        if label.kind.is_compute:
            return label.kind.value, str(label.microbatch), label.stage
        return "?", "", label.stage
    match = _LABEL.match(str(label))
    if match is None:
        return "?", "", None
    stage = match["stage"]
    return match["op"], match["mb"], int(stage) if stage is not None else None


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Lighter colors for later model chunks, so interleaved stages are told apart."""
    from matplotlib.colors import to_rgb

    mix = 0.5 * chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(c + (1.0 - c) * mix for c in to_rgb(color))


def draw_timeline(timelines: Timelines, path: str | Path, title: str = "pipeline schedule") -> Path:
    """Draw one row per rank with a box per compute action, labelled by micro-batch.

    ``timelines[rank]`` is a list of ``(label, start, end)`` where ``label`` is an
    ``Action`` (as in ``SimResult.timelines``) or its text such as ``"F3.s1"`` (for
    measured timelines). Boxes are colored by F/B/I/W; later model chunks of an
    interleaved schedule are lighter. Zero-length boxes are skipped.
    Returns the path of the written PNG.
    """
    # Imported here so that training processes importing the package never load matplotlib;
    # Figure + Agg canvas avoids pyplot's global figure registry and backend switching.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    num_ranks = max(len(timelines), 1)
    parsed = [[(*_parse(label), start, end) for label, start, end in row] for row in timelines]
    stages = [stage for row in parsed for _, _, stage, _, _ in row if stage is not None]
    chunks = max(stages) // num_ranks + 1 if stages else 1
    makespan = max((end for row in parsed for *_, end in row), default=1.0) or 1.0

    figure = Figure(figsize=(min(max(8.0, makespan / 2), 24.0), 1.0 + 0.6 * num_ranks))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for rank, row in enumerate(parsed):
        for op, text, stage, start, end in row:
            if end <= start:
                continue
            chunk = stage // num_ranks if stage is not None else 0
            color = _shade(_OP_COLORS.get(op, _OTHER_COLOR), chunk, chunks)
            axes.broken_barh(
                [(start, end - start)], (rank - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.5
            )
            if text and (end - start) > makespan / 150:
                axes.text((start + end) / 2, rank, text, ha="center", va="center", fontsize=7)

    used_ops = sorted({op for row in parsed for op, *_ in row if op in _OP_COLORS}, key="FBIW".index)
    axes.legend(
        handles=[Patch(facecolor=_OP_COLORS[op], edgecolor="black", label=_OP_NAMES[op]) for op in used_ops],
        loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=max(len(used_ops), 1),
        fontsize=8, frameon=False,
    )
    axes.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    axes.set_ylim(num_ranks - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(0, makespan)
    axes.set_xlabel("time" if chunks == 1 else "time (lighter boxes: later model chunks of the rank)")
    axes.set_title(title)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path
