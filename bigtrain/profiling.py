"""A window of steps traced by torch.profiler (``logging.profile_steps``), one trace per rank.

What torchtitan's ``[profiling]`` gives a user who asks why a step is slow: the operators, kernels
and collectives of a few steps on a timeline, in a Chrome trace per rank
(``RUN_DIR/profile/rank{R}_steps{A}-{B}.json``; https://ui.perfetto.dev opens it), and the operators
that took the most time as a table beside it (``.txt``). The step runner
marks its phases (``bigtrain: forward and backward``, ``bigtrain: gradient reduction``, ``bigtrain:
optimizer step``) with :func:`phase`, so the trace reads in the trainer's terms. With
``logging.profile_memory`` the trace records allocations too, and on a GPU the caching
allocator's history over the window is dumped beside it (``rank{R}_memory.pickle``, for
https://pytorch.org/memory_viz).

Steps count from 1, as the console does; a window the run resumes into is traced from where this
launch starts.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from bigtrain.field_checks import step_window

PROFILE_DIR = "profile"


def phase(name: str) -> AbstractContextManager:
    """A named range of the step on the trace (``bigtrain: <name>``); costs nearly nothing untraced."""
    return torch.profiler.record_function(f"bigtrain: {name}")


class StepProfiler:
    """Starts torch.profiler before the window's first step this launch runs, and writes the trace
    after its last (or when the run ends inside it)."""

    def __init__(self, steps_text: str, run_dir: Path, rank: int, world_size: int, device: torch.device,
                 memory: bool):
        self.window = step_window(steps_text)
        self.out = Path(run_dir) / PROFILE_DIR
        self.rank, self.world_size, self.device, self.memory = rank, world_size, device, memory
        self.profiler: torch.profiler.profile | None = None
        self.first_traced: int | None = None
        self.last_traced: int | None = None  # the window's end, unless the run ended before it
        self.written: Path | None = None

    def step(self, step: int) -> AbstractContextManager:
        """Around the step that makes ``step`` updates (from 1): starts the trace when it is the
        window's first this launch runs; the step is a named range on it."""
        if self.window is None or not self.window[0] <= step <= self.window[1] or self.written is not None:
            return nullcontext()
        if self.profiler is None:
            self._start(step)
        self.last_traced = step
        return torch.profiler.record_function(f"bigtrain: step {step}")

    def stepped(self, step: int) -> None:
        """After the step that made ``step`` updates: the window's last writes the trace."""
        if self.profiler is not None and step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Write what was traced (a run that ended inside the window too)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.stop()
        steps = f"{self.first_traced}-{self.last_traced}"  # what the trace holds, not what the window asked
        path = self.out / f"rank{self.rank}_steps{steps}.json"
        try:
            self._write(profiler, path)
        except OSError as e:  # a full disk: said, and the run's own ending (a failure, maybe) is not hidden
            print(f"bigtrain: warning: the trace of steps {steps} could not be written to {self.out} ({e})",
                  file=sys.stderr, flush=True)
            return
        finally:
            if self.memory and self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)  # recording stops with the window
        self.written = path
        if self.rank == 0:
            others = f" and the other {self.world_size - 1} ranks' beside it" if self.world_size > 1 else ""
            print(f"bigtrain: traced steps {steps}: {path}{others} (open in "
                  f"https://ui.perfetto.dev)", flush=True)

    def _write(self, profiler: torch.profiler.profile, path: Path) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        # The operators that took the most time, as a table beside the trace (read without a viewer).
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        path.with_suffix(".txt").write_text(profiler.key_averages().table(sort_by=by, row_limit=30) + "\n")
        if self.memory and self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.out / f"rank{self.rank}_memory.pickle"))

    def _start(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                               profile_memory=self.memory)
        self.profiler.start()
        self.first_traced = step
