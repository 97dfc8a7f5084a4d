"""Pipeline schedules as data: generators, validator, simulator, drawing (no processes)."""

from __future__ import annotations

import pytest

from bigtrain.parallel.pipeline import (
    SCHEDULE_KINDS,
    Action,
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    compute_dependencies,
    draw_timeline,
    matching_comm,
    outgoing_transfer,
    peak_inflight,
    simulate,
    validate,
)

SMALL_P = (2, 4)
SMALL_M = (1, 4, 8)
# (p, m, v) for every kind; interleaved needs v >= 2 and m a multiple of p.
ALL_SHAPES = [
    (kind, p, m, 1)
    for kind in ("naive", "gpipe", "1f1b", "zb-h1")
    for p in (1, 2, 3, 4)
    for m in (1, 2, 4, 8)
] + [("interleaved", p, m, v) for p in (1, 2, 4) for v in (2, 3) for m in (p, 2 * p, 8)]


def compute_rows(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in schedule.compute_actions(r)] for r in range(schedule.p)]


# ------------------------------------------------------------------ data types

def test_action_text_and_hashing():
    assert str(Action(Op.FORWARD, 1, 3)) == "F3.s1"
    assert str(Action(Op.BACKWARD_WEIGHT, 0, 2)) == "W2.s0"
    assert str(Action(Op.SEND_FWD, 1, 3, peer=2)) == "SEND_FWD s1 mb3 ->r2"
    assert str(Action(Op.RECV_BWD, 0, 5, peer=1)) == "RECV_BWD s0 mb5 <-r1"
    assert len({Action(Op.FORWARD, 1, 3), Action(Op.FORWARD, 1, 3)}) == 1
    with pytest.raises(AttributeError):
        Action(Op.FORWARD, 1, 3).stage = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="peer"):
        Action(Op.SEND_FWD, 0, 0)
    with pytest.raises(ValueError, match="peer"):
        Action(Op.FORWARD, 0, 0, peer=1)


def test_dependencies_and_matching_transfers():
    assert compute_dependencies(Action(Op.FORWARD, 2, 5), 4) == [Action(Op.FORWARD, 1, 5)]
    assert compute_dependencies(Action(Op.FORWARD, 0, 5), 4) == []
    assert compute_dependencies(Action(Op.BACKWARD_INPUT, 2, 5), 4) == [
        Action(Op.FORWARD, 2, 5), Action(Op.BACKWARD_INPUT, 3, 5)]
    assert compute_dependencies(Action(Op.BACKWARD, 3, 5), 4) == [Action(Op.FORWARD, 3, 5)]
    assert compute_dependencies(Action(Op.BACKWARD_WEIGHT, 3, 5), 4) == [Action(Op.BACKWARD_INPUT, 3, 5)]
    send, recv = outgoing_transfer(Action(Op.FORWARD, 1, 3), p=4, num_stages=4)
    assert (send, recv) == (Action(Op.SEND_FWD, 1, 3, peer=2), Action(Op.RECV_FWD, 2, 3, peer=1))
    assert matching_comm(send, 4) == recv and matching_comm(recv, 4) == send
    send, recv = outgoing_transfer(Action(Op.BACKWARD, 4, 0), p=4, num_stages=8)  # stage 4 on rank 0
    assert (send, recv) == (Action(Op.SEND_BWD, 4, 0, peer=3), Action(Op.RECV_BWD, 3, 0, peer=0))
    assert outgoing_transfer(Action(Op.FORWARD, 0, 0), p=1, num_stages=2) is None  # same rank
    assert outgoing_transfer(Action(Op.BACKWARD, 0, 0), p=2, num_stages=2) is None  # first stage


def test_stages_of_rank_and_describe():
    schedule = build_schedule("interleaved", p=2, m=2, v=3)
    assert schedule.stages_of_rank(0) == [0, 2, 4]
    assert schedule.stages_of_rank(1) == [1, 3, 5]
    with pytest.raises(ValueError, match="rank"):
        schedule.stages_of_rank(2)
    assert str(build_schedule("gpipe", p=2, m=2)) == (
        "gpipe schedule: p=2 ranks, m=2 micro-batches, v=1 stage(s) per rank\n"
        "rank 0 stages 0 | F0.s0 F1.s0 B0.s0 B1.s0\n"
        "rank 1 stages 1 | F0.s1 F1.s1 B0.s1 B1.s1"
    )


# ------------------------------------------------------------------ generators

@pytest.mark.parametrize(
    ("kind", "p", "m", "v", "message"),
    [
        ("gpipe", 0, 4, 1, "p=0"),
        ("gpipe", 2, 0, 1, "m=0"),
        ("gpipe", 2, 4, 0, "v=0"),
        ("1f1b", 2, 4, 2, "v=2.*v=1"),
        ("zb-h1", 2, 4, 2, "v=2.*v=1"),
        ("interleaved", 2, 4, 1, "v=1.*v=2"),
        ("interleaved", 4, 6, 2, "m=6.*m=8"),
        ("interleaved", 4, 2, 2, "m=2.*m=4"),
        ("chimera", 2, 4, 1, "kind='chimera'.*1f1b"),
    ],
)
def test_invalid_arguments_name_the_parameter_and_a_fix(kind, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(kind, p, m, v)


@pytest.mark.parametrize(("kind", "p", "m", "v"), ALL_SHAPES)
def test_every_built_schedule_validates(kind, p, m, v):
    schedule = build_schedule(kind, p, m, v)
    validate(schedule)
    assert (schedule.kind, schedule.p, schedule.m, schedule.v) == (kind, p, m, v)
    per_microbatch = 3 if kind == "zb-h1" else 2
    assert sum(len(schedule.compute_actions(r)) for r in range(p)) == per_microbatch * p * v * m


def test_exact_compute_orders():
    assert compute_rows(build_schedule("naive", p=2, m=2)) == [
        ["F0.s0", "B0.s0", "F1.s0", "B1.s0"], ["F0.s1", "B0.s1", "F1.s1", "B1.s1"]]
    assert compute_rows(build_schedule("1f1b", p=3, m=4)) == [
        ["F0.s0", "F1.s0", "F2.s0", "B0.s0", "F3.s0", "B1.s0", "B2.s0", "B3.s0"],
        ["F0.s1", "F1.s1", "B0.s1", "F2.s1", "B1.s1", "F3.s1", "B2.s1", "B3.s1"],
        ["F0.s2", "B0.s2", "F1.s2", "B1.s2", "F2.s2", "B2.s2", "F3.s2", "B3.s2"],
    ]
    assert compute_rows(build_schedule("zb-h1", p=2, m=3)) == [
        ["F0.s0", "F1.s0", "I0.s0", "W0.s0", "F2.s0", "I1.s0", "W1.s0", "I2.s0", "W2.s0"],
        ["F0.s1", "I0.s1", "F1.s1", "I1.s1", "W0.s1", "F2.s1", "I2.s1", "W1.s1", "W2.s1"],
    ]
    assert compute_rows(build_schedule("interleaved", p=2, m=4, v=2))[0] == [
        "F0.s0", "F1.s0", "F0.s2", "F1.s2", "F2.s0", "B0.s2", "F3.s0", "B1.s2",
        "F2.s2", "B0.s0", "F3.s2", "B1.s0", "B2.s2", "B3.s2", "B2.s0", "B3.s0"]


def test_transfers_surround_the_compute_they_serve():
    schedule = build_schedule("gpipe", p=2, m=2)
    assert [str(a) for a in schedule.actions[0]] == [
        "F0.s0", "SEND_FWD s0 mb0 ->r1", "F1.s0", "SEND_FWD s0 mb1 ->r1",
        "RECV_BWD s0 mb0 <-r1", "B0.s0", "RECV_BWD s0 mb1 <-r1", "B1.s0"]
    no_transfers = build_schedule("interleaved", p=1, m=2, v=2)  # both stages on rank 0
    assert all(a.kind.is_compute for a in no_transfers.actions[0])


# ------------------------------------------------------------------ validator

def hand_made(kind: str, p: int, m: int, rows: list[list[Action]]) -> Schedule:
    return Schedule(kind=kind, p=p, m=m, v=1, actions=rows)


def send_eagerly_receive_lazily(schedule: Schedule) -> Schedule:
    """The textbook blocking placement: RECV right before its consumer, SEND right after."""
    rows: list[list[Action]] = [[] for _ in range(schedule.p)]
    for rank in range(schedule.p):
        for action in schedule.compute_actions(rank):
            for dependency in compute_dependencies(action, schedule.num_stages):
                transfer = outgoing_transfer(dependency, schedule.p, schedule.num_stages)
                if transfer is not None and transfer[1].stage == action.stage:
                    rows[rank].append(transfer[1])
            rows[rank].append(action)
            transfer = outgoing_transfer(action, schedule.p, schedule.num_stages)
            if transfer is not None:
                rows[rank].append(transfer[0])
    return hand_made(schedule.kind, schedule.p, schedule.m, rows)


def test_blocking_send_first_1f1b_deadlock_is_found():
    broken = send_eagerly_receive_lazily(build_schedule("1f1b", p=2, m=4))
    with pytest.raises(ScheduleError) as caught:
        validate(broken)
    message = str(caught.value)
    assert message.startswith("deadlock")
    # Rank 0 (F0 SEND F1 SEND...) and rank 1 (RECV F0 B0 SEND...) both wait to send to the other.
    assert "rank 0 blocked at action #3 (SEND_FWD s0 mb1 ->r1)" in message
    assert "rank 1 blocked at action #3 (SEND_BWD s1 mb0 ->r0)" in message
    assert [(r, i) for r, i, _ in caught.value.blocked] == [(0, 3), (1, 3)]


def test_reordered_transfers_deadlock_names_every_blocked_rank():
    schedule = build_schedule("gpipe", p=2, m=2)
    row = schedule.actions[0]
    row[3], row[4] = row[4], row[3]  # wait for a gradient before shipping the last activation
    with pytest.raises(ScheduleError) as caught:
        validate(schedule)
    assert str(caught.value) == (
        "deadlock: rank 0 blocked at action #3 (RECV_BWD s0 mb0 <-r1); "
        "rank 1 blocked at action #2 (RECV_FWD s1 mb1 <-r0)")
    assert (caught.value.rank, caught.value.index) == (0, 3)


def test_swapped_sends_are_caught():
    schedule = build_schedule("gpipe", p=2, m=2)
    row = schedule.actions[0]
    row[1], row[3] = row[3], row[1]
    with pytest.raises(ScheduleError, match=r"rank 0, action #1 \(SEND_FWD s0 mb1 ->r1\): sends before"):
        validate(schedule)


def test_dropped_recv_is_caught():
    schedule = build_schedule("1f1b", p=2, m=2)
    assert str(schedule.actions[1][0]) == "RECV_FWD s1 mb0 <-r0"
    del schedule.actions[1][0]
    with pytest.raises(ScheduleError, match=r"rank 1, action #0 \(F0.s1\): runs before its input: "
                                            r"no earlier RECV_FWD s1 mb0 <-r0"):
        validate(schedule)


def test_dropped_send_leaves_an_unpaired_recv():
    schedule = build_schedule("gpipe", p=2, m=2)
    schedule.actions[0].remove(Action(Op.SEND_FWD, 0, 1, peer=1))
    with pytest.raises(ScheduleError, match=r"rank 1, action #2 \(RECV_FWD s1 mb1 <-r0\): no matching "
                                            r"SEND_FWD s0 mb1 ->r1 on rank 0"):
        validate(schedule)


def test_compute_mistakes_are_caught():
    f, b = Op.FORWARD, Op.BACKWARD
    cases = [
        ([[Action(f, 0, 0), Action(f, 0, 0), Action(b, 0, 0)]], r"rank 0, action #1 \(F0.s0\): duplicated"),
        ([[Action(f, 0, 0)]], r"rank 0: B0.s0 is missing"),
        ([[Action(b, 0, 0), Action(f, 0, 0)]],
         r"rank 0, action #0 \(B0.s0\): runs before its input: no earlier F0.s0"),
        ([[Action(f, 1, 0)], []], r"rank 0, action #0 \(F0.s1\): rank does not own stage 1"),
        ([[Action(f, 0, 3), Action(b, 0, 3)]], r"rank 0, action #0 \(F3.s0\): micro-batch out of range"),
        ([[Action(f, 0, 0), Action(Op.BACKWARD_INPUT, 0, 0), Action(Op.BACKWARD_WEIGHT, 0, 0),
           Action(b, 0, 0)]],
         r"rank 0, action #3 \(B0.s0\): mixes full backward"),
    ]
    for rows, message in cases:
        with pytest.raises(ScheduleError, match=message):
            validate(hand_made("hand", len(rows), 1, rows))


def test_an_asynchronous_transfer_crossing_a_step_boundary_is_caught():
    # Each of the whole list's checks passes (it is still deadlock-free as one list), but the executor
    # runs it a step at a time: rank 0 would wait in step 0 for a gradient that rank 1 sends only in
    # step 1, and whatever runs between the steps (an evaluation's transfers) would meet it instead.
    schedule = build_schedule("pipedream-2bw", p=2, m=1)
    row = schedule.actions[1]
    late = Action(Op.SEND_BWD, 1, 0, peer=0)
    at = row.index(late)
    assert str(row[at + 1]) == "F1.s1"  # the first compute of rank 1's step 1
    row[at], row[at + 1] = row[at + 1], row[at]
    with pytest.raises(ScheduleError, match=r"rank 0, action #4 \(RECV_BWD s0 mb0 <-r1\): in step 0's segment, but "
                                            r"its SEND_BWD s1 mb0 ->r0 on rank 1 is in step 1's"):
        validate(schedule)


def test_wrong_peer_is_caught():
    schedule = build_schedule("1f1b", p=4, m=1)
    schedule.actions[1][2] = Action(Op.SEND_FWD, 1, 0, peer=3)
    expected = r"rank 1, action #2 \(SEND_FWD s1 mb0 ->r3\): peer should be rank 2"
    with pytest.raises(ScheduleError, match=expected):
        validate(schedule)


# ------------------------------------------------------------------ simulator

def test_gpipe_timeline_is_exact():
    result = simulate(build_schedule("gpipe", p=2, m=2), cost_f=1, cost_b=2)
    assert [(str(a), s, e) for a, s, e in result.timelines[0]] == [
        ("F0.s0", 0, 1), ("F1.s0", 1, 2), ("B0.s0", 5, 7), ("B1.s0", 7, 9)]
    assert [(str(a), s, e) for a, s, e in result.timelines[1]] == [
        ("F0.s1", 1, 2), ("F1.s1", 2, 3), ("B0.s1", 3, 5), ("B1.s1", 5, 7)]
    assert result.makespan == 9


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", SMALL_P)
@pytest.mark.parametrize("m", SMALL_M)
@pytest.mark.parametrize(("cost_f", "cost_b"), [(1.0, 1.0), (1.0, 2.0)])
def test_gpipe_and_1f1b_bubble(kind, p, m, cost_f, cost_b):
    result = simulate(build_schedule(kind, p, m), cost_f=cost_f, cost_b=cost_b)
    expected = (p - 1) / (m + p - 1)
    assert result.makespan == pytest.approx((m + p - 1) * (cost_f + cost_b))
    assert result.bubble_fraction == pytest.approx([expected] * p)
    assert result.overall_bubble_fraction == pytest.approx(expected)


@pytest.mark.parametrize("p", SMALL_P)
@pytest.mark.parametrize("m", (4, 8))
@pytest.mark.parametrize(("cost_f", "cost_b"), [(1.0, 1.0), (1.0, 2.0)])
def test_interleaved_bubble_shrinks_by_v(p, m, cost_f, cost_b):
    v = 2
    result = simulate(build_schedule("interleaved", p, m, v), cost_f=cost_f, cost_b=cost_b)
    expected = (p - 1) / (v * m + p - 1)
    assert result.overall_bubble_fraction == pytest.approx(expected)
    assert result.bubble_fraction == pytest.approx([expected] * p)
    # Costs are per rank's share of the model: v chunks together still cost m * (f + b).
    busy = [sum(e - s for _, s, e in row) for row in result.timelines]
    assert busy == pytest.approx([m * (cost_f + cost_b)] * p)


def test_naive_runs_one_microbatch_at_a_time():
    for p in SMALL_P:
        for m in SMALL_M:
            result = simulate(build_schedule("naive", p, m), cost_f=1, cost_b=2)
            assert result.makespan == pytest.approx(m * p * 3)
            assert result.overall_bubble_fraction == pytest.approx(1 - 1 / p)


@pytest.mark.parametrize("p", SMALL_P)
@pytest.mark.parametrize("m", SMALL_M)
def test_zb_h1_beats_1f1b_when_weight_grad_costs_something(p, m):
    one_f_one_b = simulate(build_schedule("1f1b", p, m), cost_f=1, cost_b=2)
    zero_bubble = build_schedule("zb-h1", p, m)
    # With a free W the split changes nothing.
    assert simulate(zero_bubble, cost_f=1, cost_b=2, cost_w=0).makespan == pytest.approx(one_f_one_b.makespan)
    result = simulate(zero_bubble, cost_f=1, cost_b=2, cost_w=1)
    if p > 1:
        assert result.overall_bubble_fraction < one_f_one_b.overall_bubble_fraction
    if m >= p:
        # Qi et al.: the bubble is (p-1) * (T_F + T_I - T_W), here T_F = T_I = T_W = 1.
        assert result.makespan == pytest.approx(3 * m + (p - 1))
    assert max(result.peak_inflight) == max(one_f_one_b.peak_inflight)


def test_zb_h1_bubble_formula_with_unequal_costs():
    for p, m in [(2, 2), (4, 4), (4, 8)]:
        result = simulate(build_schedule("zb-h1", p, m), cost_f=1, cost_b=3, cost_w=1)
        assert result.makespan == pytest.approx(4 * m + (p - 1) * (1 + 2 - 1))


@pytest.mark.parametrize("p", SMALL_P)
@pytest.mark.parametrize("m", SMALL_M)
def test_peak_inflight(p, m):
    assert peak_inflight(build_schedule("gpipe", p, m)) == [m] * p
    assert peak_inflight(build_schedule("1f1b", p, m)) == [min(p - r, m) for r in range(p)]
    assert peak_inflight(build_schedule("zb-h1", p, m)) == [min(p, m)] * p


def test_interleaved_peak_inflight_counts_chunks():
    p, v = 4, 2
    for m in (4, 8):
        expected = [min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p)]
        assert simulate(build_schedule("interleaved", p, m, v)).peak_inflight == expected


def test_transfer_cost_delays_only_receivers():
    p, m, comm = 4, 8, 0.5
    gpipe = simulate(build_schedule("gpipe", p, m), cost_f=1, cost_b=2, cost_comm=comm)
    # One forward and one backward crossing of the p-1 links on the critical path.
    assert gpipe.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * comm)
    ranks0 = [s for _, s, _ in gpipe.timelines[0][:m]]
    assert ranks0 == pytest.approx(list(range(m)))  # sending never stalls rank 0's forwards


def test_simulate_rejects_bad_costs_and_broken_schedules():
    schedule = build_schedule("zb-h1", 2, 2)
    with pytest.raises(ValueError, match="cost_w=3"):
        simulate(schedule, cost_b=2, cost_w=3)
    with pytest.raises(ValueError, match="cost_f=-1"):
        simulate(schedule, cost_f=-1)
    del schedule.actions[0][0]
    with pytest.raises(ScheduleError):
        simulate(schedule)


# ------------------------------------------------------------------ drawing

def test_draw_timeline_writes_png(tmp_path):
    simulated = simulate(build_schedule("interleaved", 2, 4, 2), cost_f=1, cost_b=2)
    path = draw_timeline(simulated.timelines, tmp_path / "interleaved.png", "interleaved p=2 v=2")
    measured = [
        [("F0.s0", 0.0, 1.1), ("B0.s0", 3.0, 5.2)],
        [("F0", 1.2, 2.0), ("B0.s1", 2.0, 2.9), ("sync", 3, 4)],  # unknown labels are drawn grey
    ]
    measured_path = draw_timeline(measured, str(tmp_path / "measured.png"), "measured")
    for png in (path, measured_path):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_every_kind_is_listed():
    assert set(SCHEDULE_KINDS) == {"naive", "gpipe", "1f1b", "interleaved", "zb-h1", "pipedream-2bw", "pipedream"}
