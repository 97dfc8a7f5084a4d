"""SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption): save at the next step boundary, then stop.

A signal reaches ranks at different moments, so one rank alone must not decide: at every step
boundary the ranks take the maximum of "a signal arrived here" over the world group (one 4-byte
all-reduce a step, only with more than one rank), and all of them save and stop at the same step.
The run then exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell
reports a process a signal ended: not 0, so that ``bigtrain train ... && next-stage`` does not go
on, and resumable with ``--resume``.

Under ``bigtrain train``'s own launcher a signal reaches the ranks once, from the launcher
(:func:`bigtrain.distributed.launch.wait_for_ranks`; torchrun's agent never sees it), and a rank
whose launcher died sends SIGTERM to itself (:func:`~bigtrain.distributed.launch.stop_when_orphaned`).
Repeats: another launcher may pass on a signal that a terminal also sent, so a second signal within
a second is the same request. A SIGINT a second or more after the first is a user who does not want
to wait: it raises KeyboardInterrupt at once (nothing saved).
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_REPEAT_WINDOW_S = 1.0


class Preempted(RuntimeError):
    """The run stopped on a signal, after saving (or not) at a step boundary."""

    recorded = False  # written to stopped.json, where the launcher reads the code (Trainer._record)

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalWatch:
    """Records SIGINT / SIGTERM while active (a context manager; the main thread only: Python
    delivers signals there, and a thread cannot install handlers)."""

    def __init__(self, world=None):
        self.world = world  # an AxisComm over every rank (or None / size 1: decide alone)
        self.received: int | None = None
        self._at = 0.0
        self._previous: dict[int, object] = {}
        self._posted = None  # agreed_late's flag in flight: (work, tensor)

    def __enter__(self) -> "SignalWatch":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._at = signum, now
        elif signum == signal.SIGINT and now - self._at >= _REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    def agreed(self, device: torch.device | str = "cpu") -> int | None:
        """At a step boundary, on every rank: the signal any rank received (the largest number),
        else None. A collective when there are several ranks."""
        if self.world is None or self.world.size == 1:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int32, device=device)
        self.world.max(flag, tag="signal")
        return int(flag.item()) or None

    def agreed_late(self, device: torch.device | str = "cpu") -> int | None:
        """As :meth:`agreed`, without waiting for the other ranks at this boundary: posts this
        boundary's flag and returns the decision of the previous one's (None at the first), so a
        signal stops the run one step later. For 2BW's deferred boundary, where a blocking
        collective would be the barrier it avoids; :meth:`settle` waits for the last one."""
        if self.world is None or self.world.size == 1:
            return self.received
        previous = self._posted
        flag = torch.tensor([self.received or 0], dtype=torch.int32, device=device)
        self._posted = (self.world.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True, tag="signal"), flag)
        if previous is None:
            return None
        work, value = previous
        work.wait()
        return int(value.item()) or None

    def settle(self) -> None:
        """Wait for the flag :meth:`agreed_late` posted last (its decision is not needed any more)."""
        if self._posted is not None:
            self._posted[0].wait()
            self._posted = None
