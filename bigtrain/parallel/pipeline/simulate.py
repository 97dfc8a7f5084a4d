"""Time a pipeline schedule with fixed per-action costs: makespan, bubbles, memory.

Cost model (all costs are for one rank's share of the model, so totals are
comparable across kinds): a stage does F in ``cost_f / v`` and B in ``cost_b / v``;
with the zero-bubble split, I takes ``(cost_b - cost_w) / v`` and W ``cost_w / v``.
Every compute starts as soon as its rank is free and its inputs are there; a
transfer takes ``cost_comm`` and never blocks the sender (the receiver's compute
starts at max(rank free, producer end + cost_comm)). Only the order of compute
actions matters here; the position of SEND/RECV in the lists does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.parallel.pipeline.schedules import Action, Op, Schedule, compute_dependencies
from bigtrain.parallel.pipeline.validate import validate

TimelineEntry = tuple[Action, float, float]


@dataclass
class SimResult:
    """Outcome of ``simulate``.

    Attributes:
        timelines: per rank, ``(action, start, end)`` of every compute action in order.
        makespan: end of the last action (the step starts at 0).
        bubble_fraction: per rank, 1 - busy time / makespan.
        overall_bubble_fraction: mean of ``bubble_fraction`` over ranks.
        peak_inflight: per rank, see ``peak_inflight``.
    """

    timelines: list[list[TimelineEntry]]
    makespan: float
    bubble_fraction: list[float]
    overall_bubble_fraction: float
    peak_inflight: list[int]


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank, the most (stage, micro-batch) activations held at once.

    An activation is held from its F until its backward is complete: until B, or for
    the split backward until W (W needs the stage's saved input, so I alone frees
    nothing). Each stage chunk of a micro-batch counts as one.
    """
    release = Op.BACKWARD_WEIGHT if schedule.split_backward else Op.BACKWARD
    peaks = []
    for rank in range(schedule.p):
        held = peak = 0
        for action in schedule.compute_actions(rank):
            if action.kind is Op.FORWARD:
                held += 1
                peak = max(peak, held)
            elif action.kind is release:
                held -= 1
        peaks.append(peak)
    return peaks


def _durations(cost_f: float, cost_b: float, cost_w: float, cost_comm: float, v: int) -> dict[Op, float]:
    costs = {"cost_f": cost_f, "cost_b": cost_b, "cost_w": cost_w, "cost_comm": cost_comm}
    for name, value in costs.items():
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0, e.g. {name}=1.0")
    if cost_w > cost_b:
        raise ValueError(
            f"cost_w={cost_w} is the weight-grad part of the backward and cannot exceed "
            f"cost_b={cost_b}; use cost_w<={cost_b}")
    return {
        Op.FORWARD: cost_f / v,
        Op.BACKWARD: cost_b / v,
        Op.BACKWARD_INPUT: (cost_b - cost_w) / v,
        Op.BACKWARD_WEIGHT: cost_w / v,
    }


def _inputs_ready(
    schedule: Schedule, action: Action, end_time: dict[Action, float], cost_comm: float
) -> float | None:
    """When all of ``action``'s inputs are on its rank, or None if one is not computed yet."""
    ready = 0.0
    for dependency in compute_dependencies(action, schedule.num_stages):
        if dependency not in end_time:
            return None
        remote = schedule.rank_of_stage(dependency.stage) != schedule.rank_of_stage(action.stage)
        ready = max(ready, end_time[dependency] + (cost_comm if remote else 0.0))
    return ready


def _timelines(schedule: Schedule, durations: dict[Op, float], cost_comm: float) -> list[list[TimelineEntry]]:
    orders = [schedule.compute_actions(rank) for rank in range(schedule.p)]
    timelines: list[list[TimelineEntry]] = [[] for _ in orders]
    end_time: dict[Action, float] = {}
    rank_free = [0.0] * len(orders)
    # Start times depend only on finished actions, so the order in which ranks are
    # advanced here does not change the result.
    while sum(map(len, timelines)) < sum(map(len, orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while len(timelines[rank]) < len(order):
                action = order[len(timelines[rank])]
                ready = _inputs_ready(schedule, action, end_time, cost_comm)
                if ready is None:
                    break
                start = max(rank_free[rank], ready)
                end_time[action] = rank_free[rank] = start + durations[action.kind]
                timelines[rank].append((action, start, end_time[action]))
                progressed = True
        if not progressed:
            raise RuntimeError("compute orders wait on each other; validate() should have caught this")
    return timelines


def simulate(
    schedule: Schedule,
    cost_f: float = 1.0,
    cost_b: float = 2.0,
    cost_w: float = 0.0,
    cost_comm: float = 0.0,
) -> SimResult:
    """Validate ``schedule``, then time it under the cost model of this module.

    ``cost_w`` only matters for split-backward schedules (zb-h1), where it is the part
    of ``cost_b`` spent in W. Raises ``ScheduleError`` for an invalid schedule and
    ``ValueError`` for negative costs or ``cost_w > cost_b``.
    """
    validate(schedule)
    durations = _durations(cost_f, cost_b, cost_w, cost_comm, schedule.v)
    timelines = _timelines(schedule, durations, cost_comm)
    makespan = max((end for row in timelines for _, _, end in row), default=0.0)
    busy = [sum(end - start for _, start, end in row) for row in timelines]
    bubbles = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return SimResult(
        timelines=timelines,
        makespan=makespan,
        bubble_fraction=bubbles,
        overall_bubble_fraction=sum(bubbles) / len(bubbles),
        peak_inflight=peak_inflight(schedule),
    )


def steady_step_time(schedule: Schedule, result: SimResult) -> float:
    """How long one optimizer step takes once the pipeline runs steadily: the makespan for a
    synchronous kind (each step ends in a flush); for an asynchronous one, whose lists unroll
    several steps, the time between the ends of steps 1 and 2 (each step's end: its last
    micro-batch's last backward on any rank)."""
    if not schedule.asynchronous:
        return result.makespan
    ends = {}
    for row in result.timelines:
        for action, _, end in row:
            if action.kind in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                step = action.microbatch // schedule.m
                ends[step] = max(ends.get(step, 0.0), end)
    return ends[2] - ends[1]
