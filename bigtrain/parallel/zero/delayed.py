"""ZeRO-Offload's one-step delayed parameter update (DPU): the host optimizer step of step t runs on
a worker thread while step t+1's forward and backward run, and step t+1 computes with the weights
from before step t's update, W(t+1) = W(t) - lr(t) * g(W(t-1)) (the first step computes at W(0)).

The pieces, and why:

- **Masters apart from the compute weights.** The worker updates the fp32 masters in place while
  the forward reads the compute weights, so the two are different tensors even in fp32 (the
  engine allocates a separate master when ``offload.delayed_update`` is on). The compute weights
  catch up in :meth:`DelayedUpdate.publish`, on the main thread (stages 1-2 all-gather there: no
  collective ever runs on the worker, so every rank issues them in the same order).
- **The gradient handed over.** Step t+1's backward accumulates into the gradient shards while the
  worker still reads step t's: with the host apart from the device each unit has two host
  accumulators and they swap (:class:`~bigtrain.parallel.zero.grad_stream.HostGradients`); on a CPU
  device step t's clipped gradient is copied into a host buffer per unit; with gradients in files it is moved to a file of its own
  (:meth:`~bigtrain.parallel.zero.offload.UnitOffload.hand_over`).
- **Order in one step** (:meth:`~bigtrain.parallel.zero.engine.ZeroEngine.step`): wait for the
  worker (step t-1's update), publish it, reduce and agree on step t's norm and skip flag (the
  norm, the clipping and a non-finite veto are those of the gradient being applied, at its own
  step's learning rate), then hand step t's gradient to the worker. A skipped step hands nothing.
- **Anything that reads the masters** (checkpoints, full state) first waits for the worker
  (:meth:`wait`); the compute weights may then be one update behind the masters, and a checkpoint
  saves them too (``optim/<name>/weight_in_use``) so a resumed run computes its next step with the
  same weights as the uninterrupted one.

The worker's own timing, (start, end) of each host step, is kept for the run's overlap timeline.

**A trainer closed or dropped mid-update.** The worker holds the engine (and every state) until its
host step ends: a trainer deleted during one stayed alive, memory, files and threads, for the rest
of it (3 s at 57M parameters in files). :meth:`cancel` stops the step at its next unit and joins the
worker: ``Trainer.close`` calls it, and so does the trainer's collection (:func:`abandon`, a
finalizer holding no reference to the update).
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class DelayedUpdate:
    def __init__(self, offload):
        self.offload = offload
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bigtrain-host-step")
        self._running: Future | None = None
        self.unpublished = False  # the masters are one update ahead of the compute weights
        self.finished: tuple[float, float] | None = None  # (start, end) of the last host step waited for
        self._stop = threading.Event()  # set by cancel: the running step ends at its next unit

    def held_buffer(self, unit) -> torch.Tensor:
        """The unit's host buffer for a handed-over gradient (allocated once, fp32)."""
        return self.offload.host_grad(unit)

    def hold(self, unit, grad):
        """Step t's gradient of ``unit``, kept apart from the shard the next backward fills: with the
        host apart from the device, the host accumulator itself (the next backward fills the unit's
        other one); on a CPU device a copy in its host buffer."""
        if not torch.is_tensor(grad):  # already moved to its own file (a lazy read)
            return grad
        if self.offload.host_grads is not None:  # accumulated on the host: the other buffer takes the next
            return self.offload.host_grads.hold(unit)
        return self.held_buffer(unit).copy_(grad)

    def start(self, grads: list, lr: float) -> None:
        """Run the host step of these (held) gradients on the worker; returns at once."""
        self.wait()
        self._running = self._worker.submit(self._run, grads, lr)

    def _run(self, grads: list, lr: float) -> tuple[float, float]:
        start = time.perf_counter()
        self.offload.step_units(grads, lr, publish=False, stop=self._stop)
        return start, time.perf_counter()

    @property
    def running(self) -> bool:
        return self._running is not None

    def wait(self) -> None:
        """The running update is finished: the masters are current, the compute weights not yet."""
        if self._running is not None:
            running, self._running = self._running, None
            self.finished = running.result()  # re-raises the worker's error here, on the main thread
            self.unpublished = True

    def publish(self) -> None:
        """Wait for the running update, then copy its masters into the compute weights."""
        self.wait()
        if self.unpublished:
            self.offload.publish_all()
            self.unpublished = False

    def close(self) -> None:
        self.wait()
        self._worker.shutdown()

    def cancel(self) -> None:
        """Stop the running update at its next unit (the masters then hold part of it: for an update
        nobody will read, its trainer closed or gone) and join the worker thread. Idempotent."""
        self._stop.set()
        running, self._running = self._running, None
        if running is not None:
            try:
                running.result()
            except Exception:  # noqa: BLE001 - a step abandoned with its trainer: nothing is left to report to
                pass
        self._worker.shutdown(wait=True)


def abandon(delayed: "weakref.ref[DelayedUpdate]") -> None:
    """A trainer's finalizer: cancel its delayed update if it still exists (the worker holds it while
    a step runs), so the engine's memory is freed now rather than when the step would have ended."""
    update = delayed()
    if update is not None:
        update.cancel()
