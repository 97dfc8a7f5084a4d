"""When a time-based checkpoint is due (``checkpoint.every_minutes``), as a step every rank agrees on.

Ranks cannot each read their own clock at a step boundary and decide: two clocks a moment apart
would disagree at the boundary, and a save is collective. So the interval is turned into steps: at
a planning step every rank measures its pace since the last plan, the slowest pace is agreed (one
all-reduce of one number), and the next save is that many minutes of such steps later. A plan is
made once the first steps are done (the first step's allocation and warm-up are not the pace), and
again after each save, so a run whose steps slow down or speed up follows them.
"""

from __future__ import annotations

import time

import torch

FIRST_PLAN_AFTER = 3  # steps: the pace is measured from the end of step 1 to the end of step 3


class SaveInterval:
    def __init__(self, minutes: float, comm, device: torch.device | str = "cpu"):
        self.minutes, self.comm, self.device = minutes, comm, device
        self.next_step: int | None = None
        self._since: tuple[int, float] | None = None  # (step, time) the pace is measured from

    def due(self, step: int) -> bool:
        """Whether the save planned for ``step`` (updates done) is now; every rank answers alike.
        Collective at a planning step."""
        if not self.minutes:
            return False
        if self._since is None:
            self._since = (step, time.perf_counter())
        elif self.next_step is None and step >= FIRST_PLAN_AFTER:
            self.replan(step)
        return self.next_step is not None and step >= self.next_step

    def replan(self, step: int) -> None:
        """Plan the next save ``minutes`` from ``step`` (after a save of any kind); collective."""
        if not self.minutes or self._since is None:
            return
        first, then = self._since
        now = time.perf_counter()
        pace = torch.tensor([(now - then) / max(1, step - first)], dtype=torch.float64, device=self.device)
        self.comm.max(pace, tag="checkpoint")
        self.next_step = step + max(1, round(self.minutes * 60 / max(float(pace), 1e-9)))
        self._since = (step, now)
