"""Execute one rank's action list of a pipeline schedule: compute, transfers, timeline.

``PipelineExecutor.run(micro_batches)`` walks ``schedule.actions[rank]`` once through a small
dispatch table (one method per :class:`Op`):

* RECV_* posts an ``irecv`` into a fresh buffer and moves on; the compute that consumes the
  tensor waits for it just before it starts. SEND_* posts an ``isend`` of a tensor that stays
  referenced until its work completes. Consecutive transfers are posted as one
  ``batch_isend_irecv`` right before the next compute, so nothing blocks after a transfer and
  transfers overlap the compute in between (the schedule's lists pair sends and receives in the
  same order on both ranks, which ``validate`` proves before anything runs).
* F runs the stage (and the loss on the last stage); the output is cut from the graph of the next
  stage (``detach().requires_grad_()`` on arrival), so each stage backpropagates on its own.
* B is ``torch.autograd.backward(outputs, grad)``; the gradient of the stage input goes upstream.
  The zero-bubble split (``split_backward``): I computes the input gradient (and the weight
  gradients of checkpointed blocks), keeping the graph and the gradients flowing into each other
  weight's matmul; W later computes those weight gradients only, without walking the
  input-gradient part again.

The asynchronous schedules (``pipedream-2bw``, ``pipedream``) never flush: ``run`` executes this
rank's segment of one step (:func:`steady_segments`), and micro-batches still in flight at its end
(activations, posted transfers) carry over to the next ``run``. Each micro-batch runs with a weight
version kept apart from the live parameters (:mod:`bigtrain.parallel.pipeline.versions`), the
stage called through ``torch.func.functional_call``; the caller steps the optimizer between runs.

Gradient synchronization over data parallel stays with the gradient engines: given ``engines``
(stage -> an object with ``no_sync()``), every gradient-producing action but the last B, I and W
of each stage runs under ``no_sync()``, so the engine's hooks reduce each gradient once (each
parameter's last accumulation is in one of them), overlapped with the last backward; the caller
then calls ``finish_grad_sync()`` as after any accumulation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bigtrain.distributed.comm import AxisComm
from bigtrain.memory.accounting import SavedActivations
from bigtrain.parallel.pipeline.partition import PipelineStage
from bigtrain.parallel.pipeline.schedules import Action, Op, Schedule, replace_microbatch, steady_segments
from bigtrain.parallel.pipeline.split_backward import WeightGrads, backward_input, split_parameters
from bigtrain.parallel.pipeline.validate import validate
from bigtrain.parallel.pipeline.versions import WeightVersions, version_of

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (inputs of the first stage, targets of the last[, keywords every stage's call of it gets: its documents])
MicroBatch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, Mapping[str, Any]]
Key = tuple[int, int]  # (stage, micro-batch)
RecvKey = tuple[Op, int, int]  # (RECV_FWD or RECV_BWD, stage, micro-batch)
TimelineEntry = tuple[str, float, float]  # ("F3.s1", start, end), perf_counter seconds

# The actions that accumulate into .grad (I only for the parameters of checkpointed blocks).
_GRAD_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


class GradSync(Protocol):
    def no_sync(self) -> AbstractContextManager: ...


@dataclass
class _Step:
    """What one ``run`` holds between actions; dropped when the step ends."""

    micro_batches: Sequence[MicroBatch]
    first: int = 0  # the micro-batch number of micro_batches[0] (asynchronous runs count on across steps)
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # d loss / d output of (s, mb)
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # waiting for SEND_BWD
    weight_grads: dict[Key, WeightGrads] = field(default_factory=dict)  # I done, W to come
    queued: list[tuple[dist.P2POp, RecvKey | None]] = field(default_factory=list)  # not posted yet
    recvs: dict[RecvKey, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # posted, maybe unfinished
    losses: list[torch.Tensor] = field(default_factory=list)
    activation_bytes: dict[Key, int] = field(default_factory=dict)  # saved by each forward
    held: dict[Key, int] = field(default_factory=dict)  # held now: saved tensors, and W's gradients after I
    held_bytes: int = 0


class PipelineExecutor:
    """Runs this rank's part of ``schedule`` on its ``stages`` (global stage index -> stage).

    ``comm`` is the mesh's pp axis (``mesh.comm("pp")``); its rank is this rank's pp coordinate.
    ``loss_fn(last_stage_output, targets)`` gives a micro-batch's loss (normalize it by the global
    token count so gradients sum over micro-batches). ``engines`` maps a stage to its gradient
    engine (see the module docstring). With ``measure_activations`` each forward's saved-for-backward
    bytes are counted and ``peak_activation_bytes`` is the most held at once (under the zero-bubble
    split, with the gradients W keeps from I on: :meth:`WeightGrads.held_bytes`). ``forward_kwargs`` go
    to every stage call.

    Shapes need no declaring: on the first step with a new input shape, each activation sender
    tells its receiver the shape once (a small blocking message, counted under ``send:meta``);
    gradient buffers take the shape of the stage's own output.
    """

    def __init__(self, stages: Mapping[int, PipelineStage], schedule: Schedule, comm: AxisComm, loss_fn: LossFn,
                 engines: Mapping[int, GradSync] | None = None, measure_activations: bool = False,
                 forward_kwargs: Mapping[str, Any] | None = None, vertical_sync: bool = False):
        validate(schedule)  # a broken schedule fails here, naming the rank and action, before any transfer
        if comm.size != schedule.p:
            raise ValueError(f"schedule is for p={schedule.p} pipeline ranks but the pp axis has {comm.size}")
        self.rank = comm.rank
        owned = schedule.stages_of_rank(self.rank)
        if sorted(stages) != owned:
            raise ValueError(f"pp rank {self.rank} runs stages {owned} of the schedule but was given {sorted(stages)}")
        self.stages, self.schedule, self.comm, self.loss_fn = dict(stages), schedule, comm, loss_fn
        self.engines = dict(engines or {})
        self.forward_kwargs = dict(forward_kwargs or {})  # e.g. start_pos of a sequence-parallel chunk
        # Receive buffers and shape messages live where the stages compute.
        self.device = next(p.device for stage in self.stages.values() for p in stage.parameters())
        self.measure_activations = measure_activations
        self.actions = schedule.actions[self.rank]
        self._last_grad_actions = _last_grad_actions(self.actions)
        # Asynchronous kinds: this rank's first and steady segments, one weight-version store per
        # stage, what carries over between runs, and which version each compute used (last run).
        self.vertical_sync = vertical_sync
        self._segments = steady_segments(schedule, self.rank) if schedule.asynchronous else None
        self.versions = {s: WeightVersions(stage) for s, stage in self.stages.items()} if self._segments else {}
        # The first rank runs p - 1 forwards ahead: the later steps whose micro-batches a run reads.
        self.lookahead_steps = -(-(schedule.p - 1) // schedule.m) if self._segments else 0
        self.runs = 0
        self._carry: _Step | None = None
        self._in_flight: dict[Key, int] = {}  # (stage, micro-batch) -> weight version of its forward
        self._forwarded = -1  # the newest micro-batch forwarded on this rank
        # 2BW's deferred update (bigtrain/parallel/pipeline/deferred.py): versions after the first are
        # kept by ``keep_version`` once the caller has applied the update that makes them, not at the
        # start of each run; a forward that needs a version not yet held first calls
        # ``make_version(version)``, which lands that update (and keeps the version).
        self.make_version: Callable[[int], None] | None = None
        self.version_log: list[tuple[str, int]] = []  # (compute action, weight version), every run
        # Per model-input (shape, dtype): the received (shape, dtype) of each stage's input, and the
        # stages whose output shape this rank has sent; exchanged once, on the first step.
        self._input_specs: dict[tuple, dict[int, tuple[tuple[int, ...], torch.dtype]]] = {}
        self._announced: dict[tuple, set[int]] = {}
        self._dispatch: dict[Op, Callable[[_Step, Action], None]] = {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.SEND_FWD: self._send_forward,
            Op.SEND_BWD: self._send_backward,
            Op.RECV_FWD: self._recv_forward,
            Op.RECV_BWD: self._recv_backward,
        }
        self.timeline: list[TimelineEntry] = []
        self.wait_seconds = 0.0  # time the last step spent waiting for received tensors
        self.peak_activation_bytes = 0
        self.activation_bytes: dict[Key, int] = {}

    # ------------------------------------------------------------------ the step
    def run(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor | None:
        """One step over ``schedule.m`` micro-batches (every rank passes the same list; only the
        first stage reads the inputs and the last the targets). Returns the sum of the
        micro-batch losses on the rank holding the last stage, None elsewhere."""
        expected = self.schedule.m * (1 + self.lookahead_steps)
        if len(micro_batches) != expected:
            what = f" (this step's and the next {self.lookahead_steps} steps')" if self._segments else ""
            raise ValueError(f"schedule {self.schedule.kind} needs {expected} micro-batches{what}, "
                             f"got {len(micro_batches)}")
        first = micro_batches[0][0]
        if any(mb[0].shape != first.shape or mb[0].dtype != first.dtype for mb in micro_batches):
            raise ValueError("all micro-batches of a step must have the same input shape and dtype")
        self.timeline, self.wait_seconds, self.peak_activation_bytes = [], 0.0, 0
        if self._segments:
            step, actions = self._start_async_run(micro_batches)
        else:
            step, actions = _Step(micro_batches), self.actions
        for action in actions:
            if action.kind.is_compute:
                self._post_queued(step)
                self._await_inputs(step, action)
                start = time.perf_counter()
                with torch.profiler.record_function(f"bigtrain: {action}"):  # named on a trace (logging.profile_steps)
                    self._dispatch[action.kind](step, action)
                self.timeline.append((str(action), start, time.perf_counter()))
            else:
                self._dispatch[action.kind](step, action)
        self._post_queued(step)
        if self._segments:
            self._end_async_run(step)
        else:
            for work, _ in step.sends:  # sends must finish before their buffers go
                work.wait()
        self.activation_bytes = step.activation_bytes
        last = self.schedule.num_stages - 1
        return torch.stack(step.losses).sum() if last in self.stages else None

    # ------------------------------------------------------------------ asynchronous runs
    def _start_async_run(self, micro_batches: Sequence[MicroBatch]) -> tuple[_Step, list[Action]]:
        """This step's state (carried over) and actions (micro-batches numbered from the first step),
        after keeping the live weights as version ``runs`` (the updates they have seen)."""
        t, m = self.runs, self.schedule.m
        segment = self._segments[0] if t == 0 else self._segments[1]
        shift = 0 if t == 0 else (t - 1) * m
        actions = [replace_microbatch(a, a.microbatch + shift) for a in segment]
        self._last_grad_actions = _last_grad_actions(actions)
        step = self._carry if self._carry is not None else _Step(micro_batches)
        step.micro_batches, step.first, step.losses = micro_batches, t * m, []
        if self.make_version is None or t == 0:
            self.keep_version(t)
        return step, actions

    def keep_version(self, version: int) -> None:
        """Keep the live weights, which have seen ``version`` updates since this executor's first run,
        as that version on every stage of this rank."""
        for versions in self.versions.values():
            versions.snapshot(version)

    def _end_async_run(self, step: _Step) -> None:
        """Carry the micro-batches in flight to the next run; drop versions nobody will use again.
        Sends stay posted (their receivers may post the receive in their next run)."""
        self._carry = step
        self.runs += 1
        upcoming = self._version_for(self._forwarded + 1)
        oldest = min([*self._in_flight.values(), upcoming])
        for versions in self.versions.values():
            versions.release_below(oldest)

    def _version_for(self, microbatch: int) -> int:
        return version_of(self.schedule.kind, microbatch, self.schedule.m, self.schedule.p, self.rank,
                          self.vertical_sync, newest=self.runs)

    def _version_weights(self, action: Action) -> dict[str, torch.Tensor] | None:
        """The stashed weights the forward of ``action`` runs with (None: the live parameters, a
        schedule with a flush), its version recorded as in flight."""
        if not self._segments:
            return None
        version = self._version_for(action.microbatch)
        self._in_flight[(action.stage, action.microbatch)] = version
        self._forwarded = max(self._forwarded, action.microbatch)
        self.version_log.append((str(action), version))
        if self.make_version is not None and version not in self.versions[action.stage].versions:
            self.make_version(version)
        return self.versions[action.stage].weights(version)

    def _call_stage(self, action: Action, x: torch.Tensor, weights: dict[str, torch.Tensor] | None,
                    own: Mapping[str, Any]) -> torch.Tensor:
        """``own``: the micro-batch's keywords (its documents), on top of those of every call."""
        stage = self.stages[action.stage]
        kwargs = {**self.forward_kwargs, **own}
        if weights is None:
            return stage(x, **kwargs)
        return torch.func.functional_call(stage, weights, (x,), kwargs)

    def _log_backward_version(self, action: Action) -> None:
        if self._segments:
            self.version_log.append((str(action), self._in_flight.pop((action.stage, action.microbatch))))

    # ------------------------------------------------------------------ compute
    def _forward(self, step: _Step, action: Action) -> None:
        key, stage = (action.stage, action.microbatch), self.stages[action.stage]
        micro_batch = step.micro_batches[action.microbatch - step.first]
        inputs, targets = micro_batch[0], micro_batch[1]
        own = micro_batch[2] if len(micro_batch) > 2 else {}  # what travels with it to every stage
        x = inputs if stage.is_first else step.inputs.pop(key)
        weights = self._version_weights(action)
        # A weight version's tensors, saved by the stage's linears, are weights the versions count
        # (WeightVersions.peak_bytes, the planner's weight_versions), not activations: counted here
        # too, each micro-batch in flight added its stage's weights again (2BW at pp = 2, m = 4:
        # 2.17 MB measured where the planner's 1.38 MB of activations are what autograd holds).
        tracker = SavedActivations(stage, extra_exclude=(weights or {}).values()) if self.measure_activations else None
        with tracker if tracker is not None else nullcontext():
            out = self._call_stage(action, x, weights, own)
            if stage.is_last:
                out = self.loss_fn(out, targets)
                step.losses.append(out.detach())
        step.outputs[key] = out
        if not stage.is_first:
            step.inputs[key] = x
        if tracker is not None:
            step.activation_bytes[key] = tracker.current
            self._hold(step, key, tracker.current)
        if action.stage + 1 in self.stages:  # next stage on this rank (p == 1): hand over in memory
            step.inputs[(action.stage + 1, action.microbatch)] = out.detach().requires_grad_()

    def _backward(self, step: _Step, action: Action) -> None:
        key = (action.stage, action.microbatch)
        out, grad = step.outputs.pop(key), self._output_grad(step, action)
        with self._sync_context(action):
            torch.autograd.backward(out, grad)
        self._log_backward_version(action)
        x = step.inputs.pop(key, None)
        if x is not None:
            self._hand_upstream(step, action, x.grad)
        self._release(step, key)

    def _backward_input(self, step: _Step, action: Action) -> None:
        key = (action.stage, action.microbatch)
        out, grad = step.outputs.pop(key), self._output_grad(step, action)
        x = step.inputs.pop(key, None)  # None on the first stage: its W does the whole backward
        inputs = [] if x is None else [x]
        # What W needs stays reachable from step.weight_grads; the rest of the graph can go now.
        deferred, eager = split_parameters(self.stages[action.stage])  # read now: engines replace parameters
        with self._sync_context(action):
            input_grads, step.weight_grads[key] = backward_input([out], [grad], inputs, deferred, eager)
        if self.measure_activations:  # W's gradients are held from here on, beside the saved tensors
            self._hold(step, key, step.weight_grads[key].held_bytes())
        if x is not None:
            self._hand_upstream(step, action, input_grads[0])

    def _backward_weight(self, step: _Step, action: Action) -> None:
        key = (action.stage, action.microbatch)
        with self._sync_context(action):
            step.weight_grads.pop(key).run()
        self._release(step, key)

    def _output_grad(self, step: _Step, action: Action) -> torch.Tensor | None:
        """The gradient flowing into the stage's output: None for the loss, else local or received."""
        return step.output_grads.pop((action.stage, action.microbatch), None)

    def _await_inputs(self, step: _Step, action: Action) -> None:
        """Wait for the received tensors ``action`` consumes, just before it computes."""
        key = (action.stage, action.microbatch)
        if action.kind is Op.FORWARD and action.stage > 0 and key not in step.inputs:
            step.inputs[key] = self._wait_recv(step, (Op.RECV_FWD, *key)).requires_grad_()
        elif (action.kind in (Op.BACKWARD, Op.BACKWARD_INPUT) and action.stage < self.schedule.num_stages - 1
              and key not in step.output_grads):
            step.output_grads[key] = self._wait_recv(step, (Op.RECV_BWD, *key))

    def _hand_upstream(self, step: _Step, action: Action, input_grad: torch.Tensor) -> None:
        upstream = (action.stage - 1, action.microbatch)
        if upstream[0] in self.stages:
            step.output_grads[upstream] = input_grad
        else:
            step.input_grads[(action.stage, action.microbatch)] = input_grad

    def _sync_context(self, action: Action) -> AbstractContextManager:
        engine = self.engines.get(action.stage)
        if engine is None or action in self._last_grad_actions:
            return nullcontext()
        return engine.no_sync()

    def _hold(self, step: _Step, key: Key, nbytes: int) -> None:
        step.held[key] = step.held.get(key, 0) + nbytes
        step.held_bytes += nbytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, step.held_bytes)

    def _release(self, step: _Step, key: Key) -> None:
        step.held_bytes -= step.held.pop(key, 0)

    # ------------------------------------------------------------------ transfers
    def _send_forward(self, step: _Step, action: Action) -> None:
        tensor = step.outputs[(action.stage, action.microbatch)].detach()
        self._announce_shape(step, action, tensor)
        step.queued.append((self.comm.send_op(tensor, action.peer, tag="activations"), None))

    def _send_backward(self, step: _Step, action: Action) -> None:
        tensor = step.input_grads.pop((action.stage, action.microbatch))
        step.queued.append((self.comm.send_op(tensor, action.peer, tag="input_grads"), None))

    def _recv_forward(self, step: _Step, action: Action) -> None:
        shape, dtype = self._input_spec(step, action)
        self._queue_recv(step, action, torch.empty(shape, dtype=dtype, device=self.device))

    def _recv_backward(self, step: _Step, action: Action) -> None:
        output = step.outputs.get((action.stage, action.microbatch))
        if output is None:
            raise RuntimeError(f"pp rank {self.rank}: {action} comes before the forward of its stage and micro-batch")
        # The gradient of the stage's output: dense, even when the output is a strided sequence shard.
        self._queue_recv(step, action, torch.empty_like(output, memory_format=torch.contiguous_format))

    def _queue_recv(self, step: _Step, action: Action, buffer: torch.Tensor) -> None:
        step.queued.append((self.comm.recv_op(buffer, action.peer), (action.kind, action.stage, action.microbatch)))

    def _post_queued(self, step: _Step) -> None:
        """Post the transfers queued since the last compute as one batch; forget finished sends."""
        if not step.queued:
            return
        works = self.comm.batch_isend_irecv([op for op, _ in step.queued])
        for (op, recv_key), work in zip(step.queued, works):  # one work per op, in order
            if recv_key is None:
                step.sends.append((work, op.tensor))
            else:
                step.recvs[recv_key] = (work, op.tensor)
        step.queued.clear()
        # On CUDA the transfers run on NCCL's streams, after the compute queued so far. A send's
        # tensor stays referenced until its work has completed on the device (``is_completed``
        # asks NCCL's event, not the host), so its memory is not reused while NCCL reads it. A
        # received buffer is read only after ``_wait_recv``, whose ``wait()`` makes the current
        # stream wait for the transfer.
        step.sends = [(work, tensor) for work, tensor in step.sends if not work.is_completed()]

    def _wait_recv(self, step: _Step, key: RecvKey) -> torch.Tensor:
        work, buffer = step.recvs.pop(key)
        start = time.perf_counter()
        work.wait()
        self.wait_seconds += time.perf_counter() - start
        return buffer

    # ------------------------------------------------------------------ shapes
    def _input_key(self, step: _Step) -> tuple:
        first = step.micro_batches[0][0]
        return tuple(first.shape), first.dtype

    def _announce_shape(self, step: _Step, action: Action, tensor: torch.Tensor) -> None:
        """Before the first activation of a stage for a new input shape, tell the receiver its shape.

        Blocking, and only once per (input shape, stage): the queue is posted first so that this
        message stays in list order (on NCCL's one channel; Gloo gives shapes a channel of their own,
        ``comm.WIRE_TAGS``), and the validator's proof (every transfer blocking at its place in the
        list cannot deadlock) covers a blocking transfer here.
        """
        announced = self._announced.setdefault(self._input_key(step), set())
        if action.stage not in announced:
            self._post_queued(step)
            self.comm.send(_encode_spec(tensor, self.device), action.peer, tag="meta")
            announced.add(action.stage)

    def _input_spec(self, step: _Step, action: Action) -> tuple[tuple[int, ...], torch.dtype]:
        known = self._input_specs.setdefault(self._input_key(step), {})
        if action.stage not in known:
            self._post_queued(step)
            known[action.stage] = _recv_spec(self.comm, action.peer, self.device)
        return known[action.stage]


_SPEC_SLOTS = 8  # dtype code, ndim, then up to 6 sizes


def _encode_spec(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dim() > _SPEC_SLOTS - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dimensions between stages; "
                         f"use at most {_SPEC_SLOTS - 2} dimensions and one of {_DTYPES}")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (_SPEC_SLOTS - len(values)), dtype=torch.int64, device=device)


def _recv_spec(comm: AxisComm, peer: int, device: torch.device) -> tuple[tuple[int, ...], torch.dtype]:
    message = torch.empty(_SPEC_SLOTS, dtype=torch.int64, device=device)
    comm.recv(message, peer, tag="meta")  # the shapes' own channel (comm.WIRE_TAGS)
    dtype_code, ndim, *sizes = message.tolist()
    return tuple(sizes[:ndim]), _DTYPES[dtype_code]


def _last_grad_actions(actions: Sequence[Action]) -> set[Action]:
    """Each stage's last gradient-producing action of each kind (the ones that reduce over dp)."""
    return set({(a.stage, a.kind): a for a in actions if a.kind in _GRAD_OPS}.values())


def align_timelines(timelines: Sequence[Sequence[TimelineEntry]]) -> list[list[TimelineEntry]]:
    """Shift per-rank timelines (perf_counter seconds, one machine) so the earliest start is 0,
    ready for ``draw_timeline``."""
    origin = min((start for row in timelines for _, start, _ in row), default=0.0)
    return [[(label, start - origin, end - origin) for label, start, end in row] for row in timelines]
