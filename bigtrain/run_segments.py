"""A run's segments: each launch that trained part of it (the first, then every resume).

``segments.json`` in the run directory lists them, so the report can say what the whole run took,
not the last launch: the steps each segment trained, its wall time, tokens, layout and commit. Rank
0 opens a segment when ``fit`` starts (after the resume), and brings it up to date after each
checkpoint and when ``fit`` ends, however it ends. A resume from checkpoint ``step_k`` cuts every
earlier segment at step k: the steps after it are trained again and counted in the new segment
(their wall time stays with the segment that spent it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bigtrain.run_dir import SEGMENTS_FILE, write_atomic


def read_segments(run_dir: Path) -> list[dict]:
    try:
        value = json.loads((Path(run_dir) / SEGMENTS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) and all(isinstance(s, dict) for s in value) else []


def _write(run_dir: Path, segments: list[dict]) -> None:
    # Whole or not at all; a full disk is RunDirWriteError (exit 1, said in a line), not an OSError
    # traceback that a save's segment update raised before the checkpoint's own message could.
    write_atomic(Path(run_dir) / SEGMENTS_FILE, json.dumps(segments, indent=1) + "\n")


def open_segment(run_dir: Path, first_step: int, tokens_per_step: int, layout: str, git_commit: str | None) -> None:
    """A segment that starts after ``first_step`` updates (0: a fresh run)."""
    kept = []
    for s in read_segments(run_dir):
        if s.get("first_step", 0) >= first_step:
            continue  # rolled back whole: the run went on from an earlier checkpoint
        s["last_step"] = min(s.get("last_step", first_step), first_step)
        kept.append(s)
    kept.append({"first_step": first_step, "last_step": first_step, "wall_time_s": 0.0,
                 "tokens_per_step": tokens_per_step, "layout": layout, "git_commit": git_commit,
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    _write(run_dir, kept)


def update_segment(run_dir: Path, last_step: int, wall_time_s: float) -> None:
    """The newest segment has trained up to ``last_step`` in ``wall_time_s`` seconds."""
    segments = read_segments(run_dir)
    if segments:
        segments[-1].update(last_step=last_step, wall_time_s=wall_time_s)
        _write(run_dir, segments)


def totals(segments: list[dict]) -> dict:
    """Steps, tokens and wall time over every segment."""
    steps = sum(s["last_step"] - s["first_step"] for s in segments)
    return {"steps": steps, "tokens": sum((s["last_step"] - s["first_step"]) * s.get("tokens_per_step", 0)
                                          for s in segments),
            "wall_time_s": sum(s.get("wall_time_s", 0.0) for s in segments)}
