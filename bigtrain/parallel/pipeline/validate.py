"""Prove a pipeline schedule complete, consistent and deadlock-free before running it."""

from __future__ import annotations

from collections import Counter

from bigtrain.parallel.pipeline.schedules import (
    GRAD_INPUT_OPS,
    Action,
    Op,
    Schedule,
    compute_dependencies,
    matching_comm,
    step_segments,
)


class ScheduleError(ValueError):
    """A schedule is broken; ``rank``/``index``/``action`` locate the first culprit.

    For a deadlock, ``blocked`` lists ``(rank, index, action)`` for every unfinished rank.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        index: int | None = None,
        action: Action | None = None,
        blocked: list[tuple[int, int, Action]] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.action = action
        self.blocked = blocked or []


def _error(rank: int, index: int, action: Action, problem: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, action #{index} ({action}): {problem}", rank, index, action)


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is runnable.

    Checks, in order: every action is on a rank that owns its stage, with an
    in-range micro-batch and the right peer; each (stage, micro-batch) has exactly one
    F and one B (or one I and one W); every compute runs after its local inputs and
    after the RECV of its remote inputs, every SEND after the compute it ships; every
    SEND has exactly one matching RECV on its peer; executing the lists with
    blocking rendezvous transfers (the strictest model) cannot deadlock; and, for an
    asynchronous schedule run one step's segment at a time, every transfer lies in the
    same step as its counterpart.
    """
    if len(schedule.actions) != schedule.p:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lists for p={schedule.p} ranks")
    _check_placement(schedule)
    _check_complete(schedule)
    _check_local_order(schedule)
    _check_pairing(schedule)
    _check_no_deadlock(schedule)
    _check_step_boundaries(schedule)


def _check_placement(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if not 0 <= action.stage < schedule.num_stages:
                raise _error(rank, index, action, f"stage out of range 0..{schedule.num_stages - 1}")
            if schedule.rank_of_stage(action.stage) != rank:
                raise _error(rank, index, action, f"rank does not own stage {action.stage} "
                             f"(it owns {schedule.stages_of_rank(rank)})")
            if not 0 <= action.microbatch < schedule.num_microbatches:
                raise _error(rank, index, action, f"micro-batch out of range 0..{schedule.num_microbatches - 1}")
            if not action.kind.is_compute:
                _check_peer(schedule, rank, index, action)


def _check_peer(schedule: Schedule, rank: int, index: int, action: Action) -> None:
    counterpart = matching_comm(action, schedule.p)
    if not 0 <= counterpart.stage < schedule.num_stages:
        raise _error(rank, index, action, "transfer past the end of the pipeline")
    expected_peer = schedule.rank_of_stage(counterpart.stage)
    if expected_peer == rank:
        raise _error(rank, index, action, "stages on the same rank hand over in memory, not by transfer")
    if action.peer != expected_peer:
        raise _error(
            rank, index, action, f"peer should be rank {expected_peer} (owner of stage {counterpart.stage})")


def _required_compute(schedule: Schedule) -> tuple[Op, ...]:
    if schedule.split_backward:
        return (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
    return (Op.FORWARD, Op.BACKWARD)


def _check_complete(schedule: Schedule) -> None:
    required = _required_compute(schedule)
    seen: set[Action] = set()
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if not action.kind.is_compute:
                continue
            if action.kind not in required:
                raise _error(rank, index, action, "mixes full backward B with split backward I/W")
            if action in seen:
                raise _error(rank, index, action, "duplicated")
            seen.add(action)
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            for kind in required:
                missing = Action(kind, stage, mb)
                if missing not in seen:
                    owner = schedule.rank_of_stage(stage)
                    raise ScheduleError(f"rank {owner}: {missing} is missing", owner, None, missing)


def _input_source(schedule: Schedule, rank: int, dependency: Action, consumer: Action) -> Action:
    """What must precede ``consumer`` on ``rank`` for ``dependency``'s result to be there."""
    if schedule.rank_of_stage(dependency.stage) == rank:
        return dependency
    recv_kind = Op.RECV_FWD if consumer.kind is Op.FORWARD else Op.RECV_BWD
    sender = schedule.rank_of_stage(dependency.stage)
    return Action(recv_kind, consumer.stage, consumer.microbatch, peer=sender)


def _check_local_order(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        earlier: set[Action] = set()
        for index, action in enumerate(row):
            if action.kind.is_compute:
                for dependency in compute_dependencies(action, schedule.num_stages):
                    source = _input_source(schedule, rank, dependency, action)
                    if source not in earlier:
                        raise _error(rank, index, action, f"runs before its input: no earlier {source}")
            elif action.kind.is_send and not _shipped_result_done(action, earlier):
                raise _error(rank, index, action, "sends before the compute that produces the tensor")
            earlier.add(action)


def _shipped_result_done(send: Action, earlier: set[Action]) -> bool:
    producers = (Op.FORWARD,) if send.kind is Op.SEND_FWD else tuple(GRAD_INPUT_OPS)
    return any(Action(kind, send.stage, send.microbatch) in earlier for kind in producers)


def _check_pairing(schedule: Schedule) -> None:
    counts = [Counter(a for a in row if not a.kind.is_compute) for row in schedule.actions]
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if action.kind.is_compute:
                continue
            if counts[rank][action] > 1:
                raise _error(rank, index, action, "duplicated")
            counterpart = matching_comm(action, schedule.p)
            if counts[action.peer][counterpart] != 1:
                raise _error(rank, index, action, f"no matching {counterpart} on rank {action.peer}")


def _check_no_deadlock(schedule: Schedule) -> None:
    """Run all ranks with rendezvous transfers; fail if no rank can progress."""
    rows = schedule.actions
    heads = [0] * len(rows)

    def head(rank: int) -> Action | None:
        return rows[rank][heads[rank]] if heads[rank] < len(rows[rank]) else None

    while True:
        progressed = False
        for rank in range(len(rows)):
            # Compute always proceeds: _check_local_order proved its inputs come earlier.
            while (action := head(rank)) is not None and action.kind.is_compute:
                heads[rank] += 1
                progressed = True
        for rank in range(len(rows)):
            action = head(rank)
            # A match made earlier in this loop can leave a compute action at the head.
            if action is None or action.kind.is_compute:
                continue
            if head(action.peer) == matching_comm(action, schedule.p):
                heads[rank] += 1
                heads[action.peer] += 1
                progressed = True
        if all(head(rank) is None for rank in range(len(rows))):
            return
        if not progressed:
            raise _deadlock_error(rows, heads)


def _check_step_boundaries(schedule: Schedule) -> None:
    """An asynchronous schedule runs one step's segment (``step_segments``) per executor run and leaves
    its transfers posted across the boundary; between two runs come the update's collectives, a
    checkpoint's save and an evaluation, whose blocking transfers use the same channels. The tensors
    sent between two ranks share one channel and match in the order both ranks post them (Gloo: one
    tag; NCCL: one communicator), and on Gloo a message smaller than the receive it meets fills part
    of the buffer silently. So each transfer must be paired within its step: then at every boundary
    the two ends of each channel have posted as many transfers, and whatever comes between the steps
    meets only its own. (It also keeps a run from waiting for a tensor its peer sends in the next
    run, behind those collectives: a deadlock the whole-list proof above cannot see.)"""
    if not schedule.asynchronous:
        return  # one step, every transfer waited for before it ends
    step_of: dict[tuple[int, Action], int] = {}
    for rank in range(schedule.p):
        for step, segment in enumerate(step_segments(schedule, rank)):
            for action in segment:
                if not action.kind.is_compute:
                    step_of[(rank, action)] = step
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if action.kind.is_compute:
                continue
            counterpart = matching_comm(action, schedule.p)
            step, peer_step = step_of[(rank, action)], step_of[(action.peer, counterpart)]
            if step != peer_step:
                raise _error(rank, index, action, f"in step {step}'s segment, but its {counterpart} on rank "
                             f"{action.peer} is in step {peer_step}'s: it would stay unpaired across the step "
                             f"boundary, where the update, evaluation and checkpoints run their own transfers")


def _deadlock_error(rows: list[list[Action]], heads: list[int]) -> ScheduleError:
    blocked = [
        (rank, heads[rank], row[heads[rank]]) for rank, row in enumerate(rows) if heads[rank] < len(row)
    ]
    details = "; ".join(
        f"rank {rank} blocked at action #{index} ({action})" for rank, index, action in blocked)
    rank, index, action = blocked[0]
    return ScheduleError(f"deadlock: {details}", rank, index, action, blocked)
