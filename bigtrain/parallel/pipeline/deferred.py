"""PipeDream-2BW's deferred update: the step boundary is no barrier.

Synchronously, the end of a step waits for every rank: the loss is summed over the pipeline and the
gradient norm over every rank before clipping and AdamW. Rank 0 runs the step's last backward, so
the last stage idles about p - 1 backwards a step, although 2BW's rule lets it go on: step s + 1
runs with version s (kept before step s's update), and the weights that update makes (version
s + 1) are first read by step s + 2's forwards, which upstream ranks start inside step s + 1's
segment and the last stage only in step s + 2's.

So at the end of step s's segment :meth:`DeferredUpdate.post` computes this rank's sum of squares,
posts the loss and norm all-reduces with ``async_op=True``, moves the step's gradients aside (the
``.grad`` tensors are swapped with a spare set: two gradient buffers) and returns; step s + 1's
backwards accumulate into the spare set. :meth:`DeferredUpdate.land` waits for the handles, vetoes
a non-finite loss or norm as ``engine.step`` does, clips by the global norm and steps the optimizer
at step s's learning rate, then keeps the live weights as version s + 1. It runs at the latest point:

* before the first forward that needs version s + 1 (the executor calls ``make_version``), which on
  an upstream rank falls inside step s + 1's segment;
* else at the end of step s + 1's segment (the last stage), since step s + 1's gradients then need
  the buffer that step s's hold.

By then every rank has posted the reductions (rank 0 posts last, at the end of its segment s, which
comes before any of these points), so nothing waits on a slower rank: the numbers are the same as
the synchronous boundary's, computed from the same tensors in the same order.

Only where it is simple (see :func:`deferrable`): the replicated fp32 engine (ZeRO and data
parallel would shard or reduce the gradients this moves aside; validation already keeps 2BW to
zero = 0, dp = 1, fp32), no weights tied across the pipeline's ends (their gradients are summed
between the two end ranks before the norm can be taken, a second collective in a chain) and no MoE
routers (their bias update is a per-step collective on model state that is not versioned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from bigtrain.distributed.comm import AxisComm
from bigtrain.optim.clip import norm_of


@dataclass
class PendingUpdate:
    """One step's update, waiting: its gradients and the reductions in flight."""

    step: int  # the trainer's step number
    run: int  # the executor's run that computed the gradients; the update makes version run + 1
    lr: float
    loss_sum: torch.Tensor  # summed over the pipeline once ``works`` are done
    parts: torch.Tensor  # [sum of squares, overflow flag], summed over every rank once ``works`` are done
    works: list
    grads: list[torch.Tensor]  # the step's gradients, moved aside
    info: dict[str, Any] = field(default_factory=dict)  # the caller's (timing, traffic) for the step's metrics


@dataclass
class LandedUpdate:
    pending: PendingUpdate
    loss_sum: float
    grad_norm: float
    skipped: bool


class DeferredUpdate:
    """Posts each 2BW step's reductions and lands its update when its weights are first needed.

    ``engine``: a :class:`ReplicatedEngine`; ``executor``: the 2BW :class:`PipelineExecutor`, whose
    versions after the first are then kept here; ``pp``: the pipeline axis (the loss's sum)."""

    def __init__(self, engine, executor, pp: AxisComm, max_norm: float):
        self.engine, self.executor, self.pp, self.max_norm = engine, executor, pp, max_norm
        self.params = engine.params
        self._own = [p.grad for p in self.params]  # the engine's gradient buffers
        self.spare = [torch.zeros_like(g) for g in self._own]  # zero, and neither .grad nor a pending step's
        self.pending: PendingUpdate | None = None
        self.landed: list[LandedUpdate] = []  # landed, not yet read by the caller
        self.landed_by_forward = 0  # updates landed inside a segment, by the forward that needed them
        executor.make_version = self._make_version

    def post(self, step: int, lr: float, loss_sum: torch.Tensor) -> PendingUpdate:
        """At the end of ``step``'s segment (its gradients complete in ``.grad``): start the
        reductions, move the gradients aside and give ``.grad`` the spare zeros."""
        if self.pending is not None:
            raise RuntimeError(f"step {step}: step {self.pending.step}'s update has not landed")
        parts = self.engine.norm_parts()
        works = [self.pp.all_reduce(loss_sum, async_op=True, tag="metrics"), self.engine.post_norm(parts)]
        grads = [p.grad for p in self.params]
        for p, spare in zip(self.params, self.spare):
            p.grad = spare
        self.spare = []
        self.pending = PendingUpdate(step, self.executor.runs - 1, lr, loss_sum, parts,
                                     [w for w in works if w is not None], grads)
        return self.pending

    def land(self) -> None:
        """Apply the pending update, if any, to the live weights and keep them as the next version."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        for work in pending.works:
            work.wait()
        loss_sum = float(pending.loss_sum)
        norm, found_inf = norm_of(pending.parts)
        # A non-finite loss vetoes the step on every rank (the loss is the same sum everywhere), as
        # the synchronous boundary's flag does.
        skipped = found_inf or not math.isfinite(loss_sum)
        accumulating = [p.grad for p in self.params]  # the next step's, partly done on an upstream rank
        for p, g in zip(self.params, pending.grads):
            p.grad = g
        self.engine.update(pending.lr, self.max_norm, norm, skipped)
        for p, g in zip(self.params, accumulating):
            p.grad = g
        torch._foreach_zero_(pending.grads)
        self.spare = pending.grads
        self.executor.keep_version(pending.run + 1)
        self.landed.append(LandedUpdate(pending, loss_sum, norm, skipped))

    def flush(self) -> None:
        """At a step boundary: land the pending update and give ``.grad`` back the engine's own
        buffers (all gradients are zero here), so that a checkpoint, an evaluation or a synchronous
        step sees the state the synchronous boundary leaves."""
        self.land()
        if self.spare and self.spare[0].data_ptr() == self._own[0].data_ptr():
            self.spare = [p.grad for p in self.params]
            for p, g in zip(self.params, self._own):
                p.grad = g

    def _make_version(self, version: int) -> None:
        pending = self.pending
        if pending is None or pending.run + 1 != version:
            held = sorted(next(iter(self.executor.versions.values())).versions)
            raise RuntimeError(f"weight version {version} is needed, but the pending update makes "
                               f"{None if pending is None else pending.run + 1} (held: {held})")
        self.land()
        self.landed_by_forward += 1


def deferrable(parallel, model_cfg) -> bool:
    """Whether this layout's 2BW boundary can be deferred (see the module docstring for why not).

    Every rank must give the same answer, or some ranks run the deferred boundary and the others
    the synchronous one and their collectives never meet: so the tied weights and the experts are
    read from the model's config (``model_cfg``: ``cfg.model``), which every rank shares, not from
    this rank's stage (a middle stage holds no tied weight; a stage may hold no MoE block)."""
    from bigtrain.parallel.replicated import ReplicatedEngine

    schedule, engine = parallel.schedule, parallel.engine
    return (schedule is not None and schedule.kind == "pipedream-2bw"
            and isinstance(engine, ReplicatedEngine) and engine.averaging is None and engine.scaler is None
            and parallel.grad_comm.size == 1
            and not model_cfg.tie_embeddings and not model_cfg.moe_experts)
