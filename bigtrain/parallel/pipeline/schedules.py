"""Pipeline-parallel schedules as plain data.

A schedule is, for every pipeline rank, the list of actions that rank executes in
order: compute actions (F, B, or the split backward I + W) and the explicit
point-to-point transfers (SEND_*/RECV_*) between them. Nothing here touches
torch.distributed; an executor walks the lists, ``validate`` proves they are
consistent and deadlock-free, ``simulate`` times them.

Conventions:

* ``p`` ranks, ``v`` stages per rank, ``num_stages = p * v``; stage ``s`` lives on
  rank ``s % p`` (Megatron's looped placement), so with ``v == 1`` stage ``s`` is
  rank ``s``.
* Every action's ``stage`` is a stage owned by the rank that executes it, transfers
  included: ``SEND_FWD s`` ships the output of stage ``s`` and pairs with
  ``RECV_FWD s+1`` (the input of stage ``s+1``) on the peer; ``SEND_BWD s`` ships the
  gradient of stage ``s``'s input and pairs with ``RECV_BWD s-1``. ``matching_comm``
  gives the counterpart.
* A hand-off between two stages on the same rank (``p == 1``) has no transfer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable


class Op(enum.Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input grad and weight grad together
    BACKWARD_INPUT = "I"  # input grad only (zero-bubble split)
    BACKWARD_WEIGHT = "W"  # weight grad only (zero-bubble split)
    SEND_FWD = "SEND_FWD"
    RECV_FWD = "RECV_FWD"
    SEND_BWD = "SEND_BWD"
    RECV_BWD = "RECV_BWD"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_OPS

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_FWD, Op.SEND_BWD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_FWD, Op.RECV_BWD)


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
# Ops that produce the gradient a stage sends upstream.
GRAD_INPUT_OPS = frozenset({Op.BACKWARD, Op.BACKWARD_INPUT})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's schedule; ``peer`` is the other rank of a transfer."""

    kind: Op
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind.is_compute == (self.peer is not None):
            raise ValueError(f"peer must be set exactly for send/recv actions, got {self!r}")

    def __str__(self) -> str:
        if self.kind.is_compute:
            return f"{self.kind.value}{self.microbatch}.s{self.stage}"
        arrow = "->" if self.kind.is_send else "<-"
        return f"{self.kind.name} s{self.stage} mb{self.microbatch} {arrow}r{self.peer}"


@dataclass
class Schedule:
    """Per-rank action lists of one training step (``actions[rank]`` in execution order).

    An asynchronous kind (``ASYNC_KINDS``: no flush between steps) lists ``steps`` consecutive
    optimizer steps unrolled, micro-batch ``k`` belonging to step ``k // m``, so that the validator,
    simulator and drawing see how one step's backwards overlap the next step's forwards;
    :func:`step_segments` cuts a rank's list into its steps.
    """

    kind: str
    p: int
    m: int
    v: int
    actions: list[list[Action]]
    steps: int = 1

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def num_microbatches(self) -> int:
        """Micro-batches the lists cover: ``m`` per step over ``steps`` steps."""
        return self.m * self.steps

    @property
    def asynchronous(self) -> bool:
        return self.kind in ASYNC_KINDS

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W (zero-bubble kinds)."""
        return any(a.kind in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) for row in self.actions for a in row)

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.p

    def stages_of_rank(self, rank: int) -> list[int]:
        """Global stage indices held by ``rank``, in model order."""
        if not 0 <= rank < self.p:
            raise ValueError(f"rank={rank} is out of range; use 0 <= rank < p={self.p}")
        return list(range(rank, self.num_stages, self.p))

    def compute_actions(self, rank: int) -> list[Action]:
        """The F/B/I/W actions of ``rank`` in execution order (transfers left out)."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def describe(self) -> str:
        """A text table: one row per rank, its stages, then its compute actions in order."""
        header = (f"{self.kind} schedule: p={self.p} ranks, m={self.m} micro-batches, "
                  f"v={self.v} stage(s) per rank" + (f", {self.steps} steps unrolled" if self.steps > 1 else ""))
        cells = [[str(a) for a in self.compute_actions(r)] for r in range(self.p)]
        width = max((len(c) for row in cells for c in row), default=1)
        labels = [f"rank {r} stages {','.join(map(str, self.stages_of_rank(r)))}" for r in range(self.p)]
        label_width = max(len(label) for label in labels)
        rows = [
            f"{label.ljust(label_width)} | " + " ".join(c.ljust(width) for c in row)
            for label, row in zip(labels, cells)
        ]
        return "\n".join([header, *(row.rstrip() for row in rows)])

    def __str__(self) -> str:
        return self.describe()


def compute_dependencies(action: Action, num_stages: int) -> list[Action]:
    """Compute actions whose results ``action`` consumes (all of the same micro-batch).

    F(s) needs F(s-1); B(s)/I(s) need F(s) (saved activations) and the same kind on
    stage s+1 (the output gradient); W(s) needs I(s).
    """
    s, mb = action.stage, action.microbatch
    if action.kind is Op.FORWARD:
        return [Action(Op.FORWARD, s - 1, mb)] if s > 0 else []
    if action.kind in GRAD_INPUT_OPS:
        deps = [Action(Op.FORWARD, s, mb)]
        if s < num_stages - 1:
            deps.append(Action(action.kind, s + 1, mb))
        return deps
    if action.kind is Op.BACKWARD_WEIGHT:
        return [Action(Op.BACKWARD_INPUT, s, mb)]
    raise ValueError(f"{action} is not a compute action")


_COUNTERPART = {
    Op.SEND_FWD: (Op.RECV_FWD, +1),
    Op.RECV_FWD: (Op.SEND_FWD, -1),
    Op.SEND_BWD: (Op.RECV_BWD, -1),
    Op.RECV_BWD: (Op.SEND_BWD, +1),
}


def matching_comm(action: Action, p: int) -> Action:
    """The send/recv on ``action.peer`` that pairs with the send/recv ``action``."""
    kind, stage_offset = _COUNTERPART[action.kind]
    return Action(kind, action.stage + stage_offset, action.microbatch, peer=action.stage % p)


def outgoing_transfer(action: Action, p: int, num_stages: int) -> tuple[Action, Action] | None:
    """The (send, recv) pair shipping ``action``'s output to another rank, or None."""
    s, mb = action.stage, action.microbatch
    if action.kind is Op.FORWARD and s < num_stages - 1:
        send = Action(Op.SEND_FWD, s, mb, peer=(s + 1) % p)
    elif action.kind in GRAD_INPUT_OPS and s > 0:
        send = Action(Op.SEND_BWD, s, mb, peer=(s - 1) % p)
    else:
        return None
    if send.peer == s % p:
        return None  # both stages on one rank: the tensor is handed over in memory
    return send, matching_comm(send, p)


# ---------------------------------------------------------------- generators
# Each returns, per rank, the compute actions in execution order.

def _f(stage: int, mb: int) -> Action:
    return Action(Op.FORWARD, stage, mb)


def _b(stage: int, mb: int) -> Action:
    return Action(Op.BACKWARD, stage, mb)


def _naive_orders(p: int, m: int, v: int) -> list[list[Action]]:
    orders: list[list[Action]] = [[] for _ in range(p)]
    for mb in range(m):
        for s in range(p):
            orders[s].append(_f(s, mb))
        for s in reversed(range(p)):
            orders[s].append(_b(s, mb))
    return orders


def _gpipe_orders(p: int, m: int, v: int) -> list[list[Action]]:
    # Backwards in micro-batch order 0..m-1: the last stage can start B0 as soon as
    # its last forward is done, and the gradient of mb0 reaches rank 0 first.
    return [[_f(r, mb) for mb in range(m)] + [_b(r, mb) for mb in range(m)] for r in range(p)]


def _merge_one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward / one backward, then cool-down backwards."""
    order = forwards[:warmup]
    for i, fwd in enumerate(forwards[warmup:]):
        order += [fwd, backwards[i]]
    return order + backwards[len(forwards) - warmup:]


def _one_f_one_b_orders(p: int, m: int, v: int) -> list[list[Action]]:
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        forwards, backwards = [_f(r, mb) for mb in range(m)], [_b(r, mb) for mb in range(m)]
        orders.append(_merge_one_f_one_b(forwards, backwards, warmup))
    return orders


def _interleaved_orders(p: int, m: int, v: int) -> list[list[Action]]:
    # Megatron's virtual pipeline: micro-batches go through chunk 0 in groups of p,
    # then the same group through chunk 1, ...; backwards walk the chunks in reverse.
    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    total = m * v
    orders = []
    for r in range(p):
        forwards = [_f(((k // p) % v) * p + r, microbatch(k)) for k in range(total)]
        backwards = [_b((v - 1 - (k // p) % v) * p + r, microbatch(k)) for k in range(total)]
        # Megatron's warm-up: all of chunk 0..v-2 for one group of p micro-batches, plus
        # two per hop to the last rank since each hop delays the first gradient by one
        # forward and one backward.
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        orders.append(_merge_one_f_one_b(forwards, backwards, warmup))
    return orders


def _zb_h1_orders(p: int, m: int, v: int) -> list[list[Action]]:
    # 1F1B with B split into I and W: rank r postpones each W by r backward steps so
    # the W's fill the cool-down bubble; at most p micro-batches are in flight
    # (F done, W not done) on any rank, the same peak as rank 0 of 1F1B.
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [_f(r, mb) for mb in range(warmup)]
        backward_steps = [[Action(Op.BACKWARD_INPUT, r, mb)] for mb in range(m)]
        for mb in range(r, m):  # after I of micro-batch mb, the W of micro-batch mb - r
            backward_steps[mb].append(Action(Op.BACKWARD_WEIGHT, r, mb - r))
        for i in range(m - warmup):
            order += [_f(r, warmup + i), *backward_steps[i]]
        for mb in range(m - warmup, m):
            order += backward_steps[mb]
        order += [Action(Op.BACKWARD_WEIGHT, r, mb) for mb in range(max(m - r, 0), m)]
        orders.append(order)
    return orders


_GENERATORS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "naive": _naive_orders,
    "gpipe": _gpipe_orders,
    "1f1b": _one_f_one_b_orders,
    "interleaved": _interleaved_orders,
    "zb-h1": _zb_h1_orders,
    # No flush: 1F1B over the micro-batches of consecutive steps, so rank r starts the next step's
    # first p - r - 1 forwards before the current step's last backwards. What differs between the
    # two is which weight version each micro-batch runs with (the executor's WeightVersions):
    # 2BW updates once per step of m micro-batches, the step's gradients computed with the weights
    # of one step before; PipeDream updates after every micro-batch (m = 1) and stashes one
    # version per micro-batch in flight.
    "pipedream-2bw": _one_f_one_b_orders,
    "pipedream": _one_f_one_b_orders,
}
SCHEDULE_KINDS: tuple[str, ...] = tuple(_GENERATORS)
ASYNC_KINDS: tuple[str, ...] = ("pipedream-2bw", "pipedream")


def unrolled_steps(p: int, m: int) -> int:
    """Steps an asynchronous schedule lists by default: the warm-up step, two steady ones (whose
    equality :func:`steady_segments` checks) and enough more that the drain (rank 0's forwards
    run out p - 1 micro-batches before the end) starts after them."""
    return 3 + -(-p // m) + 1


def _check_arguments(kind: str, p: int, m: int, v: int) -> None:
    if kind not in _GENERATORS:
        raise ValueError(f"kind={kind!r} is unknown; use one of {', '.join(SCHEDULE_KINDS)}")
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1, e.g. {name}=1")
    if kind == "pipedream" and m != 1:
        raise ValueError(f"m={m}: kind 'pipedream' updates the weights after every micro-batch; use m=1 "
                         f"(or kind='pipedream-2bw' to update once per step of m micro-batches)")
    if kind != "interleaved":
        if v != 1:
            raise ValueError(
                f"v={v}: kind {kind!r} holds one stage per rank; use v=1 (or kind='interleaved')")
        return
    if v < 2:
        raise ValueError(f"v={v}: kind 'interleaved' needs v >= 2 stages per rank; use v=2")
    if m < p or m % p:
        fixed = max(p, -(-m // p) * p)
        raise ValueError(f"m={m}: kind 'interleaved' needs m >= p and m a multiple of p={p}; use m={fixed}")


def _topological_order(orders: list[list[Action]], num_stages: int) -> list[Action]:
    """All compute actions in one order that respects each rank's order and the data flow.

    Among ranks whose next action is ready, the one that has done the fewest actions
    goes first, so ranks advance roughly in lock-step (this only decides where the
    transfers land in the lists, not whether they can deadlock).
    """
    heads = [0] * len(orders)
    done: set[Action] = set()
    result: list[Action] = []
    while len(result) < sum(map(len, orders)):
        ready = [
            r for r, order in enumerate(orders)
            if heads[r] < len(order)
            and all(d in done for d in compute_dependencies(order[heads[r]], num_stages))
        ]
        if not ready:
            stuck = [str(order[heads[r]]) for r, order in enumerate(orders) if heads[r] < len(order)]
            raise RuntimeError(f"compute orders wait on each other at {stuck}")
        rank = min(ready, key=lambda r: (heads[r], r))
        action = orders[rank][heads[rank]]
        heads[rank] += 1
        done.add(action)
        result.append(action)
    return result


def _add_transfers(orders: list[list[Action]], p: int, num_stages: int) -> list[list[Action]]:
    """Per-rank lists with SEND after each producer and RECV on the peer at the same point.

    Why this cannot deadlock with blocking rendezvous transfers: every transfer is
    appended to the sender's and the receiver's list at the same position of one
    global sequence, so each rank's list is a sub-sequence of that sequence; the
    earliest unfinished event of the global sequence always has every participant
    at the head of its list, hence something can always progress.
    """
    actions: list[list[Action]] = [[] for _ in range(p)]
    for action in _topological_order(orders, num_stages):
        actions[action.stage % p].append(action)
        transfer = outgoing_transfer(action, p, num_stages)
        if transfer is not None:
            send, recv = transfer
            actions[action.stage % p].append(send)
            actions[send.peer].append(recv)
    return actions


def build_schedule(kind: str, p: int, m: int, v: int = 1, steps: int | None = None) -> Schedule:
    """Build the per-rank action lists of one step of pipeline schedule ``kind``.

    Args:
        kind: one of ``SCHEDULE_KINDS``: "naive" (one micro-batch at a time through
            the whole pipe), "gpipe" (all forwards, then backwards in micro-batch
            order), "1f1b", "interleaved" (Megatron virtual pipeline, needs v >= 2
            and m a multiple of p), "zb-h1" (1F1B with backward split into I and W), and the
            asynchronous "pipedream-2bw" and "pipedream" (m = 1), which never flush.
        p: pipeline ranks. m: micro-batches per step. v: stages per rank.
        steps: optimizer steps the lists cover: 1 for a synchronous kind (each step is alike), at
            least 2 (default ``unrolled_steps(p, m)``) for an asynchronous one.

    Raises:
        ValueError: naming the bad parameter and a value that works.
    """
    _check_arguments(kind, p, m, v)
    asynchronous = kind in ASYNC_KINDS
    steps = (unrolled_steps(p, m) if asynchronous else 1) if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < (2 if asynchronous else 1) or (
            steps > 1 and not asynchronous):
        fix = f"steps >= 2 (default {unrolled_steps(p, m)})" if asynchronous else "steps=1 (a flush ends every step)"
        raise ValueError(f"steps={steps!r}: kind {kind!r} needs {fix}")
    orders = _GENERATORS[kind](p, m * steps, v)
    return Schedule(kind=kind, p=p, m=m, v=v, actions=_add_transfers(orders, p, p * v), steps=steps)


def step_segments(schedule: Schedule, rank: int) -> list[list[Action]]:
    """``rank``'s list cut into its steps: each segment ends with the backward of the step's last
    micro-batch on the rank's stages (and the transfer shipping it); the last takes the rest.

    Cut there, every segment of an asynchronous schedule finishes its step's gradients, so the
    optimizer can step between segments; and no compute waits on a tensor a peer sends only in a
    later segment (a forward's producer upstream has a longer warm-up, so it runs no later).
    """
    row, m = schedule.actions[rank], schedule.m
    grad_done = Op.BACKWARD_WEIGHT if schedule.split_backward else Op.BACKWARD
    segments, start = [], 0
    for index, action in enumerate(row):
        if action.kind is grad_done and action.microbatch % m == m - 1 and len(segments) < schedule.steps - 1:
            end = index + 1
            if end < len(row) and row[end].kind is Op.SEND_BWD and row[end].microbatch == action.microbatch:
                end += 1
            segments.append(row[start:end])
            start = end
    segments.append(row[start:])
    return segments


def steady_segments(schedule: Schedule, rank: int) -> tuple[list[Action], list[Action]]:
    """(first step's segment, a steady step's segment) of ``rank`` in an asynchronous schedule, with
    the steady one's micro-batches renumbered as if it were step 1: run step t >= 1 as the steady
    segment with micro-batch k standing for k + (t - 1) m.

    Raises ValueError unless segments 1 and 2 are the same up to that renumbering (so stitching
    the steady segment step after step runs the never-flushed pipeline), which needs the default
    ``steps = unrolled_steps(p, m)``.
    """
    segments = step_segments(schedule, rank)
    shifted = [replace_microbatch(a, a.microbatch - schedule.m) for a in segments[2]]
    if shifted != segments[1]:
        raise ValueError(f"{schedule.kind} p={schedule.p} m={schedule.m}: rank {rank}'s steps 1 and 2 differ; "
                         f"the schedule has no steady state to repeat")
    return segments[0], segments[1]


def replace_microbatch(action: Action, microbatch: int) -> Action:
    return Action(action.kind, action.stage, microbatch, action.peer)
