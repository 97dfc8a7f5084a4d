"""The mesh: coordinates and process groups of every axis, the expert axes ep / edp above all.

Expert parallelism adds no ranks: ``ep`` is the inner factor of the data-parallel replicas dp x sp
(adjacent ranks), ``edp`` the outer one. Layouts are checked three ways: on paper (no process
group), on real Gloo ranks (the groups torch holds), and with the fake process group at 64 and
1024 ranks.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from bigtrain.config import ParallelConfig
from bigtrain.distributed.comm import sent_fraction
from bigtrain.distributed.mesh import AXES, Mesh
from bigtrain.testing import run_fake_rank, run_ranks

NAMES = (*AXES, "dp_sp", "ep", "edp", "edp_shard", "dp_replicate", "dp_shard", "dp_shard_sp")

# (sizes, world size, {axis: every group of the axis}) written out by hand, not by the mesh's code.
LAYOUTS = {
    # tp innermost: ranks (0, 1) share a tp group; dp coordinate = rank // 2; ep = the inner half of dp.
    "dp4-ep2-tp2": ({"dp": 4, "ep": 2, "tp": 2}, 8, {
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }),
    "dp8-ep4": ({"dp": 8, "ep": 4}, 8, {
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 1, 2, 3, 4, 5, 6, 7]],
    }),
    # pp outermost: ranks 0-3 are stage 0; the expert groups never cross a stage.
    "pp2-dp2-ep2": ({"pp": 2, "dp": 2, "ep": 2}, 4, {
        "ep": [[0, 1], [2, 3]],
        "edp": [[0], [1], [2], [3]],
        "pp": [[0, 2], [1, 3]],
        "dp": [[0, 1], [2, 3]],
    }),
    "pp2-dp4-ep2": ({"pp": 2, "dp": 4, "ep": 2}, 8, {
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }),
    # Ulysses: replicas are dp x sp (sp inner); ep = 2 takes the two sp ranks, edp the two dp ranks.
    "dp2-sp2-ep2": ({"dp": 2, "sp": 2, "ep": 2}, 4, {
        "ep": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]],
        "dp_sp": [[0, 1, 2, 3]],
    }),
    # ep = 4 = 2 dp x 2 sp, within each tp column.
    "dp4-sp2-ep4": ({"dp": 4, "sp": 2, "ep": 4}, 8, {
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }),
    # ep = 1: every rank is its own ep group and edp is dp.
    "dp4-ep1": ({"dp": 4}, 4, {"ep": [[0], [1], [2], [3]], "edp": [[0, 1, 2, 3]]}),
    # HSDP: dp = 2 replicas (outer) x 2 shards (inner, adjacent); a ZeRO group is dp_shard x cp x sp.
    # HSDP with experts: ep = 2 inside each replica group (ranks 0-3, 4-7); the experts' ZeRO group
    # (edp_shard) is the edp ranks of one replica group, and dp_replicate pairs the same experts.
    "hsdp-2x4-ep2": ({"dp": 8, "dp_replicate": 2, "ep": 2}, 8, {
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "edp_shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_shard_sp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    }),
    "hsdp-2x2": ({"dp": 4, "dp_replicate": 2}, 4, {
        "dp_replicate": [[0, 2], [1, 3]],
        "dp_shard": [[0, 1], [2, 3]],
        "dp_shard_sp": [[0, 1], [2, 3]],
        "dp": [[0, 1, 2, 3]],
        "dp_sp": [[0, 1, 2, 3]],
    }),
    "hsdp-2x2-cp2-tp2": ({"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}, 16, {
        "dp_replicate": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        "dp_shard_sp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "dp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    }),
}


def _owner(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


# --------------------------------------------------------------------------- on paper


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_groups_on_paper(name):
    sizes, world, expected = LAYOUTS[name]
    for rank in range(world):
        mesh = Mesh(sizes, rank, make_groups=False)
        assert mesh.world_size == world  # ep does not multiply it
        for axis, groups in expected.items():
            assert sorted(mesh.all_groups(axis)) == groups, (axis, mesh.all_groups(axis))
            assert mesh.ranks_along(axis) == _owner(groups, rank)
            assert mesh.size(axis) == len(groups[0])
        assert mesh.ranks_along("ep").index(rank) == mesh.coord("ep")
        assert mesh.ranks_along("edp").index(rank) == mesh.coord("edp")
        assert mesh.ranks_along("edp_shard").index(rank) == mesh.coord("edp_shard")


def test_every_rank_is_in_one_group_of_each_axis():
    mesh = Mesh({"pp": 2, "dp": 4, "sp": 2, "tp": 2, "ep": 4}, make_groups=False)
    for axis in NAMES:
        groups = mesh.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(32)), axis
        assert {len(g) for g in groups} == {mesh.size(axis)}, axis
    # ep x edp is exactly dp x sp: the expert axes only factor the replicas.
    assert mesh.size("ep") * mesh.size("edp") == mesh.size("dp_sp") == 8


def test_from_config_takes_ep_without_growing_the_world():
    mesh = Mesh.from_config(ParallelConfig(dp=4, tp=2, ep=2), rank=5, world_size=8, make_groups=False)
    assert mesh.sizes == {"pp": 1, "dp": 4, "cp": 1, "sp": 1, "tp": 2, "ep": 2, "dp_replicate": 1, "dp_shard": 4}
    assert mesh.coords == {"pp": 0, "dp": 2, "cp": 0, "sp": 0, "tp": 1, "ep": 0, "edp": 1, "edp_shard": 1,
                           "dp_replicate": 0, "dp_shard": 2}
    assert "ep=2 inside dp x sp" in repr(mesh)
    with pytest.raises(ValueError, match="world size is 16"):
        Mesh.from_config(ParallelConfig(dp=4, tp=2, ep=2), rank=0, world_size=16, make_groups=False)


@pytest.mark.parametrize("sizes, match", [
    ({"dp": 4, "ep": 3}, "ep = 3 must be >= 1 and divide dp x sp = 4 x 1"),
    ({"dp": 2, "sp": 2, "ep": 8}, "divide dp x sp = 2 x 2"),
    ({"dp": 2, "ep": 0}, "ep = 0 must be >= 1"),
    # under HSDP an ep group must lie inside one replica group of dp_shard x cp x sp ranks
    ({"dp": 4, "dp_replicate": 2, "ep": 4}, "ep = 4 must divide dp_shard x cp x sp = 2 x 1 x 1"),
    ({"dp": 2, "xp": 2}, r"unknown mesh axes \['xp'\]"),
    ({"dp": 2, "cp": 2, "ep": 8}, "divide dp x cp x sp = 2 x 2 x 1"),
    ({"edp": 2}, r"unknown mesh axes \['edp'\]"),  # edp follows from dp x sp / ep: not a size to give
])
def test_bad_sizes_are_named(sizes, match):
    with pytest.raises(ValueError, match=match):
        Mesh(sizes, make_groups=False)


# --------------------------------------------------------------------------- real Gloo ranks


def _gloo_groups(rank, world_size, sizes):
    mesh = Mesh(sizes, rank)
    held = {name: (dist.get_process_group_ranks(g) if g is not None else None) for name, g in mesh.groups.items()}
    comms = {name: (mesh.comm(name).size, mesh.comm(name).rank) for name in (*NAMES, "pp_ends")}
    # The data agree with the layout: a sum over ep adds the ranks of this rank's ep group.
    value = torch.tensor([float(rank)])
    mesh.comm("ep").all_reduce(value)
    edp_value = torch.tensor([float(rank)])
    mesh.comm("edp").all_reduce(edp_value)
    return {"held": held, "comms": comms, "ep_sum": value.item(), "edp_sum": edp_value.item(),
            "same_as_dp": mesh.groups["edp"] is mesh.groups["dp"] if mesh.groups["edp"] else None}


@pytest.mark.parametrize("name", ["dp4-ep2-tp2", "dp8-ep4", "pp2-dp2-ep2", "dp2-sp2-ep2", "dp4-ep1"])
def test_groups_on_gloo_ranks(name):
    sizes, world, expected = LAYOUTS[name]
    results = run_ranks(_gloo_groups, world, sizes)
    for rank, got in enumerate(results):
        mesh = Mesh(sizes, rank, make_groups=False)
        for axis in ("ep", "edp"):
            ranks = _owner(expected[axis], rank)
            # A group of one rank is not made; the comm then is a no-op of size 1.
            assert got["held"][axis] == (ranks if len(ranks) > 1 else None), (axis, rank)
            assert got["comms"][axis] == (len(ranks), mesh.coord(axis))
        assert got["ep_sum"] == sum(_owner(expected["ep"], rank))
        assert got["edp_sum"] == sum(_owner(expected["edp"], rank))
        # The other axes keep their groups.
        for axis in (*AXES, "dp_sp"):
            assert got["comms"][axis][0] == mesh.size(axis)
            if got["held"][axis] is not None:
                assert got["held"][axis] == mesh.ranks_along(axis)
    if name == "dp4-ep1":  # edp is the dp group itself, not a second group of the same ranks
        assert all(got["same_as_dp"] for got in results)


def _ep_traffic(rank, world_size):
    mesh = Mesh({"dp": 4, "ep": 2, "tp": 2}, rank)
    before = mesh.stats.snapshot()
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    out = torch.empty_like(x)
    mesh.comm("ep").all_to_all(out, x, tag="dispatch")
    grad = torch.ones(5, dtype=torch.float32)
    mesh.comm("edp").all_reduce(grad, tag="grads")
    delta = mesh.stats.since(before)
    return {"out": out.tolist(), "payload": dict(delta.payload), "calls": dict(delta.calls),
            "by_axis": delta.by_axis(), "ep_ranks": mesh.ranks_along("ep")}


def test_bytes_on_the_ep_axis_are_counted():
    results = run_ranks(_ep_traffic, 8)
    for rank, got in enumerate(results):
        assert got["payload"] == {("ep", "all_to_all:dispatch"): 6 * 4, ("edp", "all_reduce:grads"): 5 * 4}
        assert got["calls"] == {("ep", "all_to_all:dispatch"): 1, ("edp", "all_reduce:grads"): 1}
        # ep = 2: an all-to-all sends half its input; edp = 2: a ring all-reduce sends the buffer once.
        assert got["by_axis"] == {"ep": 6 * 4 * float(sent_fraction("all_to_all", 2)),
                                  "edp": 5 * 4 * float(sent_fraction("all_reduce", 2))}
        assert got["by_axis"]["ep"] == 12.0
        # The all-to-all really went over the ep pair: chunk i of the output came from ep rank i.
        peers = got["ep_ranks"]
        me = peers.index(rank)
        assert got["out"] == [10.0 * peers[i] + 3 * me + k for i in range(2) for k in range(3)]


# --------------------------------------------------------------------------- fake process group, many ranks


def _fake_groups(rank, world_size, sizes, axes):
    calls = []
    real_new_group = dist.new_group

    def counting(ranks, *args, **kwargs):
        calls.append(list(ranks))
        return real_new_group(ranks, *args, **kwargs)

    with mock.patch.object(dist, "new_group", counting):
        mesh = Mesh(sizes, rank)
    held = {a: dist.get_process_group_ranks(mesh.groups[a]) for a in axes if mesh.groups[a] is not None}
    return {"coords": mesh.coords, "held": held, "comms": {a: (mesh.comm(a).size, mesh.comm(a).rank) for a in axes},
            "new_groups": len(calls), "distinct": len({tuple(c) for c in calls})}


def test_1024_ranks_on_the_fake_process_group():
    # pp=4 x dp=32 x tp=8, ep=8: rank 777 = pp 3 (768..1023), dp 1, tp 1.
    sizes = {"pp": 4, "dp": 32, "tp": 8, "ep": 8}
    got = run_fake_rank(_fake_groups, 1024, sizes, ("ep", "edp", "dp", "tp", "pp"), rank=777)
    assert got["coords"] == {"pp": 3, "dp": 1, "cp": 0, "sp": 0, "tp": 1, "ep": 1, "edp": 0, "edp_shard": 0,
                             "dp_replicate": 0, "dp_shard": 1}
    assert got["held"]["ep"] == [768 + 8 * i + 1 for i in range(8)]  # dp 0..7 of this stage and tp column
    assert got["held"]["edp"] == [768 + 8 * (1 + 8 * i) + 1 for i in range(4)]  # dp 1, 9, 17, 25
    assert got["held"]["dp"] == [768 + 8 * i + 1 for i in range(32)]
    assert got["held"]["tp"] == list(range(776, 784))
    assert got["held"]["pp"] == [9, 265, 521, 777]
    assert got["comms"]["ep"] == (8, 1) and got["comms"]["edp"] == (4, 0)
    # Each group once: 256 pp + 32 dp + 128 tp + 256 pp_ends pairs + 128 ep + 256 edp groups.
    assert got["new_groups"] == got["distinct"] == 256 + 32 + 128 + 256 + 32 * 4 + 32 * 8


def test_64_ranks_with_ulysses_and_no_duplicate_groups():
    # dp=4 x sp=4 x tp=4, ep=8: replicas are 16 (dp x sp), ep takes 2 dp x 4 sp, edp the other 2 dp.
    sizes = {"dp": 4, "sp": 4, "tp": 4, "ep": 8}
    got = run_fake_rank(_fake_groups, 64, sizes, ("ep", "edp", "dp_sp"), rank=45)  # dp 2, sp 3, tp 1
    assert got["coords"] == {"pp": 0, "dp": 2, "cp": 0, "sp": 3, "tp": 1, "ep": 3, "edp": 1, "edp_shard": 1,
                             "dp_replicate": 0, "dp_shard": 2}
    assert got["held"]["ep"] == [32 + 4 * i + 1 for i in range(8)]
    assert got["held"]["edp"] == [13, 45]
    assert got["held"]["dp_sp"] == [4 * i + 1 for i in range(16)]
    assert got["new_groups"] == got["distinct"]
    # ep = 1 makes no group of its own: edp is the dp_sp group.
    plain = run_fake_rank(_fake_groups, 64, {"dp": 4, "sp": 4, "tp": 4}, ("edp", "dp_sp"), rank=45)
    with_ep1 = run_fake_rank(_fake_groups, 64, {**{"dp": 4, "sp": 4, "tp": 4}, "ep": 1}, ("edp", "dp_sp"), rank=45)
    assert with_ep1["new_groups"] == plain["new_groups"] == plain["distinct"]
    assert with_ep1["held"]["edp"] == with_ep1["held"]["dp_sp"]


# --------------------------------------------------------------------------- torch DeviceMesh over our groups


def _device_meshes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = Mesh({"dp": 4, "ep": 2, "tp": 2}, rank)
    dense, expert = mesh.device_mesh(), mesh.device_mesh("expert")
    same = {f"dense.{a}": dense.get_group(a) is mesh.groups[a] for a in dense.mesh_dim_names}
    same |= {f"expert.{a}": expert.get_group(a) is mesh.groups[a] for a in expert.mesh_dim_names}
    # torch's own mesh of the same shape (its own new groups) puts the same ranks together.
    theirs = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("edp", "ep", "tp"))
    theirs_ranks = {a: dist.get_process_group_ranks(theirs.get_group(a)) for a in ("edp", "ep", "tp")}
    # DTensor runs on our groups: experts sharded over ep, gathered back whole.
    local = torch.full((2, 3), float(mesh.coord("ep")))
    full = DTensor.from_local(local, expert["ep"], [Shard(0)]).full_tensor()
    return {"dense_names": dense.mesh_dim_names, "expert_names": expert.mesh_dim_names,
            "dense_layout": dense.mesh.tolist(), "expert_layout": expert.mesh.tolist(), "same": same,
            "theirs": theirs_ranks, "ours": {a: mesh.ranks_along(a) for a in ("edp", "ep", "tp")},
            "full": full.tolist(), "cached": mesh.device_mesh() is dense}


def test_device_mesh_is_a_view_of_our_groups():
    # DTensor imports these on first use: once here, not in each of the 8 forked ranks (7 s of CPU).
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    results = run_ranks(_device_meshes, 8)
    for got in results:
        assert got["dense_names"] == ("dp", "tp") and got["expert_names"] == ("edp", "ep", "tp")
        assert got["dense_layout"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert got["expert_layout"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        assert all(got["same"].values()) and len(got["same"]) == 5, got["same"]
        assert got["theirs"] == got["ours"]
        assert got["full"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
        assert got["cached"]
