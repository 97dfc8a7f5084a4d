"""CUDA's side streams and events on the CPU, with asynchronous copies that really are late: what lets
the CUDA branch of offload's ``HostLink`` (bigtrain/parallel/zero/host.py) run in CPU tests.

A ``copy_(..., non_blocking=True)`` issued inside ``with torch.cuda.stream(s)`` (s a side stream) is
queued on ``s``, not made. It is made, reading its source *then*, only when the code waits for it as
CUDA requires: an event recorded after it is synchronized, ``s`` is synchronized, or the compute
stream waits for ``s`` (``wait_stream`` / ``wait_event``; the compute stream is the host's own
eager work, so everything after that wait sees the copy). A read that skipped its wait sees the
buffer's old contents, and a source rewritten before the copy's event completed is copied rewritten:
the two ways a missing ``wait`` / ``synchronize`` is silently wrong on a GPU.

Not modelled: the host reusing a buffer whose copy the compute stream has waited for but the host
has not (the staging ring's per-slot event); the compute stream's own asynchrony.
"""

from __future__ import annotations

import threading
import weakref

import torch

_copy = torch.Tensor.copy_
_current = threading.local()  # the side stream a `with torch.cuda.stream(...)` made current on this thread


class FakeStream:
    def __init__(self, device=None, priority: int = 0, compute: bool = False):
        self.compute = compute
        self._queue: list = []
        self._lock = threading.RLock()  # the fold thread waits on events while the main thread queues
        self.issued = self.done = 0

    def enqueue(self, work) -> None:
        with self._lock:
            self._queue.append(work)
            self.issued += 1

    def run_until(self, mark: int) -> None:
        with self._lock:
            while self.done < mark:
                self._queue.pop(0)()
                self.done += 1

    def synchronize(self) -> None:
        self.run_until(self.issued)

    def wait_stream(self, other: "FakeStream") -> None:
        if self.compute:  # the host's work after this point sees everything queued on ``other``
            other.synchronize()
        # a side stream waiting for the compute stream: that work is done already (eager)

    def wait_event(self, event: "FakeEvent") -> None:
        if self.compute:
            event.synchronize()


COMPUTE = FakeStream(compute=True)


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.stream, self.mark = None, 0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or current_stream()
        self.mark = self.stream.issued

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.mark


def current_stream(device=None) -> FakeStream:
    return getattr(_current, "stream", None) or COMPUTE


class _StreamContext:
    def __init__(self, stream: FakeStream):
        self.stream = stream

    def __enter__(self):
        self.previous = getattr(_current, "stream", None)
        _current.stream = self.stream

    def __exit__(self, *exc):
        _current.stream = self.previous


def _late_copy(self, src, non_blocking=False):
    stream = getattr(_current, "stream", None)
    if non_blocking and stream is not None and not stream.compute:
        stream.enqueue(lambda: _copy(self, src))
        return self
    return _copy(self, src, non_blocking)


class _Cudart:  # cudaHostRegister / Unregister: nothing to pin on the CPU
    @staticmethod
    def cudaHostRegister(ptr, size, flags):
        return 0

    @staticmethod
    def cudaHostUnregister(ptr):
        return 0


def install(monkeypatch) -> None:
    """From here on (until ``monkeypatch`` undoes it) every ``HostLink`` built takes its CUDA
    branch on a CPU device, with the streams, events and late copies above."""
    from bigtrain.parallel.zero import host

    monkeypatch.setattr(torch.Tensor, "copy_", _late_copy)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", _StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "cudart", _Cudart)
    built = host.HostLink.__init__

    def cuda_branch(self, device, separate=False, staging_slots=4):
        built(self, device, True, staging_slots)
        self.cuda = True
        self.stream, self.down_stream = FakeStream(), FakeStream()
        # the unpinning at collection waits for these streams, as it would for CUDA's
        self._unpin.detach()
        self._unpin = weakref.finalize(self, host._unregister_all, self._registered, [self.stream, self.down_stream])
        self._unpin.atexit = False

    monkeypatch.setattr(host.HostLink, "__init__", cuda_branch)
