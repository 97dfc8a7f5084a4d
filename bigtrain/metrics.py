"""Metrics: one JSON object per logged step in ``metrics.jsonl``, and what rank 0 shows while
training: a progress bar on a terminal; elsewhere (a log file, a CI job, ``logging.progress =
false``) one plain line per logged step, so a log holds steps / log_every lines and no carriage
returns.

The schema only grows: ``step, loss, lr, grad_norm, tokens_per_s, step_time_s`` (a recommender's
steps count samples: ``samples_per_s`` in place of ``tokens_per_s``) and
``mem`` (bytes on the worst rank: params, grads, optimizer, activations) and ``comm``
(bytes this rank sent in the step, by mesh axis; ``comm_ops`` splits them by collective),
``skipped`` (the NaN policy skipped the update; skipped steps are always logged) and, in fp16,
``loss_scale``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from bigtrain.run_dir import write_atomic, write_failed


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def device_bytes(mem: dict[str, int]) -> int:
    """The device's total of a ``mem`` record: offload's ``host`` and ``nvme`` bytes are elsewhere."""
    return sum(v for k, v in mem.items() if k not in ("host", "nvme"))


def log_line(record: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """``step 10/300 | loss 3.2101 | 8,723 tok/s | mem 12.3 MiB | eta 1m05s`` (a record's step counts
    from 1: the number of updates done, as checkpoint ``step_00000010`` does)."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}"]
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    if "auc" in record:  # a recommender's held-out metrics
        parts.append(f"auc {record['auc']:.4f} | log loss {record['log_loss']:.4f}")
    parts.append(f"{record['samples_per_s']:,.0f} samples/s" if "samples_per_s" in record
                 else f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("mem"):
        parts.append(f"mem {human_bytes(device_bytes(record['mem']))}")
    if eta_s is not None:
        parts.append(f"eta {human_duration(eta_s)}")
    if record.get("skipped"):
        parts.append("skipped")
    return " | ".join(parts)


class MetricsLog:
    """Appends metric records to ``metrics.jsonl`` (rank 0 only) and shows progress: a bar when
    ``progress`` and stdout is a terminal, else a plain line per record."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, first_step: int, progress: bool,
                 tensorboard: bool = False):
        self.enabled = enabled
        self.board = tensorboard_writer(run_dir, first_step) if enabled and tensorboard else None
        self.path = run_dir / "metrics.jsonl"
        self.total_steps, self.first_step = total_steps, first_step
        self._pace_from: tuple[int, float] | None = None  # (steps done, time) at the first record
        self.bar = None
        if enabled:
            self._drop_records_from(first_step)
        if enabled and progress and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def _drop_records_from(self, step: int) -> None:
        """A fresh run starts an empty log; a resumed one (``step`` updates done) keeps only the
        records of those steps (a torn last line, from a run that died mid-write, is dropped with them)."""
        if self.path.exists():
            kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
            # A crash (or a full disk: RunDirWriteError) leaves the old log or the new one, not half of it.
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: said in a line (exit 1); a torn last line is dropped on resume
            raise write_failed(self.path, e, "its last record may be cut short, which a resume drops") from e
        if self.board is not None:
            write_scalars(self.board, record)
        if self.bar is not None:
            unit, key = ("samples_s", "samples_per_s") if "samples_per_s" in record else ("tok_s", "tokens_per_s")
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", **{unit: f"{record[key]:.0f}"},
                                 mem=human_bytes(device_bytes(record["mem"])), refresh=False)
        else:
            print(log_line(record, self.total_steps, self._eta(record["step"])), flush=True)

    def _eta(self, done: int) -> float | None:
        """Seconds left at the mean pace since the first record: the first step (warm-up, allocation)
        is slower than the rest and would inflate the estimate."""
        now = time.perf_counter()
        if self._pace_from is None:
            self._pace_from = (done, now)
        first_done, first_time = self._pace_from
        if done <= first_done or done >= self.total_steps:
            return None
        return (now - first_time) / (done - first_done) * (self.total_steps - done)

    def note(self, text: str) -> None:
        """One line on stdout (rank 0), above the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.board is not None:
            self.board.close()


TENSORBOARD_DIR = "tensorboard"


def tensorboard_writer(run_dir: Path, first_step: int = 0):
    """torch's SummaryWriter into ``run_dir/tensorboard``; None (with a warning) without the
    ``tensorboard`` package, which torch's writer needs. A run that has done ``first_step`` updates
    (resumed) trains step ``first_step + 1`` on: the events of those steps and later, left by the
    run it continues (steps past its checkpoint, an abandoned timeline), are purged, as
    ``metrics.jsonl`` drops their records; kept, TensorBoard drew two values for each such step."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn("logging.tensorboard = true, but the tensorboard package is not installed "
                      "(pip install tensorboard); no event files are written", stacklevel=2)
        return None
    return SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=first_step + 1)


def write_scalars(writer, record: dict[str, Any]) -> None:
    """One record's scalars, at its step (counted from 1, as the log lines count)."""
    step = record["step"]
    for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s",
                "offload_step_ms", "offload_hidden"):
        if key in record:
            writer.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", record[key], step)
    if record.get("mem"):
        writer.add_scalar("memory/total_bytes", device_bytes(record["mem"]), step)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``. A line that is not a whole record (the torn last
    line of a run killed mid-write, or a damaged one) is skipped with a warning."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            warnings.warn(f"{path}: line {number} is not a whole metrics record (a run killed mid-write?); "
                          f"skipped", stacklevel=2)
            continue
        records.append(record)
    return records
