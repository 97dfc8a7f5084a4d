"""The device mesh: named parallel axes, this rank's coordinates, and one process group per axis.

Built once from the config and the world size and passed explicitly; nothing here is global, so
a test may build two meshes in one process. Ranks are laid out with ``tp`` innermost (adjacent
ranks, so tensor-parallel traffic stays inside a node), then ``sp``, ``cp``, ``dp``, ``pp`` outermost,
as Megatron and torchtitan do; ``dp`` is ``dp_replicate`` x ``dp_shard`` (hybrid sharded data
parallel: ZeRO cuts within a group of dp_shard x cp x sp adjacent ranks, the groups are replicas).
Axes are declared (:class:`Axis`: the dimensions they span and what they mean for gradients, data
and placement); groups, sizes and coordinates follow from the declarations. Expert parallelism adds no ranks: ``ep`` and ``edp`` factor the
data-parallel replicas (see ``EXPERT``). The groups are our own; :meth:`Mesh.device_mesh` shows
them to torch as a ``DeviceMesh`` without making new ones (docs/architecture.md, "Mesh").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bigtrain.config import ParallelConfig
from bigtrain.distributed.comm import AxisComm, CommStats, world_timeout

AXES = ("pp", "dp", "cp", "sp", "tp")  # the config's axes, outermost first (dp: every data-parallel rank)


@dataclass(frozen=True)
class Axis:
    """A named axis of the mesh: the grid dimensions it spans (itself, for a dimension) and what it
    means for a dense weight's gradients, for the data and for where weights lie. The mesh's groups,
    sizes, coordinates and counted collectives all follow from these declarations; a new axis is one
    more of them (and the engine that uses it)."""

    name: str
    parts: tuple[str, ...]
    grads: str  # what its ranks do with a dense weight's gradient
    data: str  # what its ranks see of the batch
    placement: str  # how a dense weight lies on it
    # Its part in a dense weight's gradient reduction (Mesh.gradient_axes reads it): "all" the group
    # it is reduced and ZeRO-cut over when there are no replica groups, "within" the one under
    # HSDP, "across" the groups that all-reduce the reduced shards; "" none.
    reduction: str = ""


# The grid's dimensions, outermost first: pp, then the data-parallel ranks as dp_replicate x dp_shard
# (replicas outer, so a ZeRO group is adjacent ranks, inside a node), cp, sp, tp innermost. With
# dp_replicate = 1 the grid is the one dp axis it always was.
DIMENSIONS = (
    Axis("pp", ("pp",), "none: each stage holds different weights", "the same micro-batches, in turn",
         "pipeline stages"),
    Axis("dp_replicate", ("dp_replicate",), "all-reduced after the shard group's reduce-scatter (HSDP)",
         "different samples: the outer part of the data rank", "whole copies of each ZeRO group's shards",
         "across"),
    Axis("dp_shard", ("dp_shard",), "reduce-scattered (ZeRO 1-3) or all-reduced (ZeRO 0)",
         "different samples: the inner part of the data rank", "ZeRO shards"),
    Axis("cp", ("cp",), "reduced with dp_shard: every cp rank holds every weight", "chunks of each sequence",
         "like dp_shard"),
    Axis("sp", ("sp",), "reduced with dp_shard: every sp rank holds every weight", "shards of each sequence",
         "like dp_shard"),
    Axis("tp", ("tp",), "partial sums only for replicated weights seeing part of the input (tp hooks)",
         "the same samples", "tensor-parallel column / row / vocabulary shards"),
)
GRID = tuple(a.name for a in DIMENSIONS)
# Views of several dimensions at once (flattened): one process group each where more than one of
# their dimensions has ranks. ``dp`` is the data rank (replicate index x dp_shard + shard index),
# which the sampler reads; ``dp_sp`` every rank holding whole copies of a dense weight (the name
# predates cp: dp x cp x sp); ``dp_shard_sp`` the ranks one ZeRO group cuts a weight over.
VIEWS = (
    Axis("dp", ("dp_replicate", "dp_shard"), "-", "different samples: the data rank", "-"),
    Axis("dp_sp", ("dp_replicate", "dp_shard", "cp", "sp"),
         "reduced (and cut by ZeRO) over all of it when dp_replicate = 1", "different tokens", "replicas of dense weights",
         "all"),
    Axis("dp_shard_sp", ("dp_shard", "cp", "sp"),
         "reduce-scattered over it, then all-reduced over dp_replicate (HSDP)", "different tokens",
         "one ZeRO group: each rank a flat range of every unit", "within"),
)
FLATTENED = {a.name: a.parts for a in VIEWS}
DECLARED = {a.name: a for a in (*DIMENSIONS, *VIEWS)}
# A group is counted (CommStats) under the first of these names that spans the same dimensions of
# more than one rank: dp_sp with cp = sp = 1 is "dp", and dp_shard with dp_replicate = 1 is "dp" too.
COUNTED_AS = ("pp", "dp", "cp", "sp", "tp", "dp_replicate", "dp_shard", "dp_sp", "dp_shard_sp")


# The first and last rank of an axis: the pipeline ranks holding the first stage (the embedding)
# and the last (the output head), which keep one copy each of a weight tied between the two.
ENDS = {"pp_ends": "pp"}
# Expert parallelism factors the replicas of a dense weight, dp x sp (flattened, sp inner), as
# edp x ep: experts are sharded over ``ep``, the inner factor (adjacent ranks, so the token
# all-to-all stays close), and replicated over ``edp``, the outer one ("expert data parallel": expert
# gradients are reduced and ZeRO-sharded there). Every rank of dp x sp holds different tokens at an
# MoE layer, so ep may take from sp as torchtitan's ep takes from dp_shard x cp; with sp = 1 it is
# the inner part of dp, as in Megatron-Core. Under HSDP ep divides one ZeRO group (dp_shard x cp x
# sp), so every ep group lies inside one replica group: ``edp_shard``, the edp ranks of this rank's
# replica group, is the experts' ZeRO group, and their reduced shards are all-reduced over
# dp_replicate, whose ranks hold the same experts (the same place in the same-sized groups).
EXPERT = ("ep", "edp", "edp_shard")
KNOWN = (*AXES, "dp_replicate", "dp_shard", "ep")  # the sizes a mesh is built from
# torch DeviceMesh views of the same ranks (Mesh.device_mesh): dims of size 1 are left out.
DEVICE_MESH_LAYOUTS = {"dense": AXES, "expert": ("pp", "edp", "ep", "tp")}


def data_parallel_sizes(sizes: dict[str, int]) -> tuple[int, int, int]:
    """(dp, dp_replicate, dp_shard) from a mesh's sizes: dp is their product; a dp_shard of 0 (or
    none) follows as dp / dp_replicate, and dp, when not given, as dp_replicate x dp_shard."""
    replicate, shard = int(sizes.get("dp_replicate", 1)), int(sizes.get("dp_shard", 0) or 0)
    dp = int(sizes.get("dp", replicate * shard if shard else 1))
    if replicate < 1 or dp < 1 or dp % replicate:
        raise ValueError(f"dp_replicate = {replicate} must be >= 1 and divide dp = {dp}: the data-parallel ranks "
                         f"are dp_replicate groups of dp_shard ranks")
    shard = shard or dp // replicate
    if replicate * shard != dp:
        raise ValueError(f"dp_replicate x dp_shard = {replicate} x {shard} = {replicate * shard} != dp = {dp}")
    return dp, replicate, shard


class Mesh:
    """Named axes over ``world_size`` ranks; ``groups`` are made only when torch.distributed is up."""

    def __init__(self, sizes: dict[str, int], rank: int = 0, make_groups: bool = True):
        unknown = set(sizes) - set(KNOWN)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {KNOWN}")
        dp, replicate, shard = data_parallel_sizes(sizes)
        grid = {axis: int(sizes.get(axis, 1)) for axis in GRID}
        grid.update(dp_replicate=replicate, dp_shard=shard)
        ep, replicas = int(sizes.get("ep", 1)), dp * grid["cp"] * grid["sp"]
        if ep < 1 or replicas % ep:
            replica_axes = ("dp", "cp", "sp") if grid["cp"] > 1 else ("dp", "sp")
            values = {**grid, "dp": dp}
            raise ValueError(f"ep = {ep} must be >= 1 and divide {' x '.join(replica_axes)} = "
                             f"{' x '.join(str(values[a]) for a in replica_axes)}: experts "
                             f"are sharded over part of the data-parallel ranks, which ep does not multiply")
        if replicate > 1 and (replicas // replicate) % ep:
            raise ValueError(f"ep = {ep} must divide dp_shard x cp x sp = {shard} x {grid['cp']} x {grid['sp']} under "
                             f"hybrid sharding (dp_replicate = {replicate}): an ep group must lie inside one "
                             f"replica group")
        self.grid = grid
        # Every named size: the config's axes, the data-parallel factors, ep (not a factor of the world size).
        self.sizes = {**{a: grid[a] if a in grid else dp for a in AXES}, "ep": ep,
                      "dp_replicate": replicate, "dp_shard": shard}
        self.world_size = math.prod(grid.values())
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        self.rank = rank
        self.stats = CommStats()
        self.coords = self._named_coords(self._coords_of(rank))
        replica = (self.coords["dp"] * grid["cp"] + self.coords["cp"]) * grid["sp"] + self.coords["sp"]  # in dp_sp
        in_group = replica % (replicas // replicate)  # in dp_shard_sp, this rank's replica group
        self.coords.update(ep=replica % ep, edp=replica // ep, edp_shard=in_group // ep)
        self.groups: dict[str, dist.ProcessGroup | None] = {
            axis: None for axis in (*DECLARED, *ENDS, *EXPERT)}
        self._device_meshes: dict[tuple[str, str], object] = {}
        if make_groups and self.world_size > 1:
            self._make_groups()

    @classmethod
    def from_config(cls, parallel: ParallelConfig, rank: int = 0, world_size: int = 1,
                    make_groups: bool = True) -> "Mesh":
        sizes = {axis: getattr(parallel, axis) for axis in KNOWN}
        if parallel.world_size != world_size:
            raise ValueError(f"mesh {sizes} needs {parallel.world_size} ranks, world size is {world_size}")
        return cls(sizes, rank, make_groups)

    # -- what the declarations mean for gradients ----------------------------------------------------
    def gradient_axes(self) -> tuple[str, tuple[str, ...]]:
        """(the axis over which a dense weight's gradient is reduced and its ZeRO unit cut, the axes
        over which that reduced shard is then all-reduced): all of dp x cp x sp at once, or, under
        HSDP (dp_replicate > 1), reduce-scatter within one ZeRO group and all-reduce across groups."""
        across = tuple(a.name for a in DIMENSIONS if a.reduction == "across" and self.grid[a.name] > 1)
        return next(a.name for a in VIEWS if a.reduction == ("within" if across else "all")), across

    def expert_gradient_axes(self) -> tuple[str, tuple[str, ...]]:
        """:meth:`gradient_axes` for experts: reduced and cut over edp, or under HSDP over the edp
        ranks of one replica group (edp_shard) and then all-reduced over dp_replicate."""
        across = self.gradient_axes()[1]
        return ("edp_shard" if across else "edp"), across

    # -- coordinates --------------------------------------------------------------------------------
    def _parts(self, axis: str) -> tuple[str, ...]:
        if axis in DECLARED:
            return DECLARED[axis].parts
        raise ValueError(f"unknown mesh axis {axis!r}; known: {sorted((*DECLARED, *ENDS, *EXPERT))}")

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis in reversed(GRID):
            strides[axis] = stride
            stride *= self.grid[axis]
        return strides

    def _coords_of(self, rank: int) -> dict[str, int]:
        """Grid coordinates of ``rank``."""
        strides = self._strides()
        return {axis: rank // strides[axis] % self.grid[axis] for axis in GRID}

    def _named_coords(self, grid_coords: dict[str, int]) -> dict[str, int]:
        """The config's axes' coordinates and the data-parallel factors' (dp = replicate x dp_shard + shard)."""
        dp = grid_coords["dp_replicate"] * self.grid["dp_shard"] + grid_coords["dp_shard"]
        return {**{a: grid_coords[a] if a in grid_coords else dp for a in AXES},
                "dp_replicate": grid_coords["dp_replicate"], "dp_shard": grid_coords["dp_shard"]}

    def _rank_of(self, coords: dict[str, int]) -> int:
        strides = self._strides()
        return sum(coords[axis] * strides[axis] for axis in GRID)

    def ranks_along(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of the ``axis`` group that ``rank`` (default: this rank) belongs to, in the
        order of the group's own ranks; ``axis`` is a declared axis (a dimension or a view) or ep / edp."""
        if axis in EXPERT:
            rank = self.rank if rank is None else rank
            replicas = self.ranks_across(FLATTENED[self._expert_view(axis)], rank)
            return next(ranks for ranks in self._split_replicas(axis, replicas) if rank in ranks)
        return self.ranks_across(self._parts(axis), rank)

    def ranks_across(self, axes: tuple[str, ...], rank: int | None = None) -> list[int]:
        """Global ranks sharing ``rank``'s coordinates on every dimension but those of ``axes``."""
        parts = tuple(dim for axis in axes for dim in self._parts(axis))
        base = self._coords_of(self.rank if rank is None else rank)
        out = []
        for values in itertools.product(*(range(self.grid[a]) for a in parts)):
            out.append(self._rank_of({**base, **dict(zip(parts, values))}))
        return sorted(out)

    def all_groups(self, axis: str) -> list[list[int]]:
        """The ranks of every ``axis`` group of the mesh (each group once, in the same order on
        every rank), whether or not a process group is made for it."""
        if axis in ENDS:
            return self._end_rank_pairs(ENDS[axis])
        parts = self._parts(self._expert_view(axis) if axis in EXPERT else axis)
        others = [a for a in GRID if a not in parts]
        out = []
        for fixed in itertools.product(*(range(self.grid[a]) for a in others)):
            ranks = self.ranks_across(parts, self._rank_of(dict(zip(others, fixed), **{a: 0 for a in parts})))
            out += self._split_replicas(axis, ranks) if axis in EXPERT else [ranks]
        return out

    @staticmethod
    def _expert_view(axis: str) -> str:
        """The view an expert axis cuts: edp_shard one replica group's, the others all of dp x sp."""
        return "dp_shard_sp" if axis == "edp_shard" else "dp_sp"

    def _split_replicas(self, axis: str, replicas: list[int]) -> list[list[int]]:
        """One dp x sp group, or for edp_shard one replica group's part of it (sorted ranks are in
        flattened order, and ep divides either), cut into its ep or edp(_shard) groups."""
        ep = self.sizes["ep"]
        if axis == "ep":  # consecutive blocks of ep ranks
            return [replicas[i:i + ep] for i in range(0, len(replicas), ep)]
        return [replicas[i::ep] for i in range(ep)]  # the same place in every block

    def _make_groups(self) -> None:
        # Every rank must call new_group for every group, in the same order. A set of ranks that
        # two names share (edp is dp when ep = 1, ep is dp when ep = dp) gets one process group.
        # Each waits as long as the world group (distributed.timeout_s), not torch's 30-minute
        # default for new groups.
        timeout = world_timeout()
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for name in self._grouped_names():
            for ranks in self.all_groups(name):
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.groups[name] = made[tuple(ranks)]

    def _grouped_names(self) -> list[str]:
        """The names that get process groups: every declared axis of more than one rank (views of a
        single real dimension share that dimension's group, see _make_groups), ends of more than
        two ranks (two are the axis) and the expert axes."""
        names = [a for a in DECLARED if self.size(a) > 1]
        names += [name for name, axis in ENDS.items() if self.grid[axis] > 2]
        return names + [name for name in EXPERT if self.size(name) > 1]

    def _end_rank_pairs(self, axis: str) -> list[list[int]]:
        """[rank at coordinate 0, rank at the last coordinate] of ``axis``, for every setting of the others."""
        others = [a for a in GRID if a != axis]
        pairs = []
        for fixed in itertools.product(*(range(self.grid[a]) for a in others)):
            coords = dict(zip(others, fixed))
            pairs.append([self._rank_of({**coords, axis: 0}), self._rank_of({**coords, axis: self.grid[axis] - 1})])
        return pairs

    def size(self, axis: str) -> int:
        if axis in EXPERT:
            ep = self.sizes["ep"]
            return ep if axis == "ep" else self.size(self._expert_view(axis)) // ep
        if axis in ENDS:
            return min(2, self.grid[ENDS[axis]])
        if axis == "ep":
            return self.sizes["ep"]
        return math.prod(self.grid[a] for a in self._parts(axis))

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    def _real(self, axis: str) -> tuple[str, ...]:
        return tuple(a for a in self._parts(axis) if self.grid[a] > 1)

    def counted_name(self, axis: str) -> str:
        """The name ``axis``'s collectives are counted under: the first of :data:`COUNTED_AS` spanning
        the same dimensions of more than one rank (a view of one real dimension is that dimension:
        dp_sp is "dp" while cp = sp = 1, dp_shard is "dp" while dp_replicate = 1)."""
        real = self._real(axis)
        if not real:
            return axis if axis in GRID or axis in AXES else "dp"
        return next(name for name in COUNTED_AS if self._real(name) == real)

    def comm(self, axis: str) -> AxisComm:
        """Counted collectives over ``axis`` ("world" means every rank)."""
        if axis == "world":
            return AxisComm("world", None, self.world_size, self.rank, self.stats)
        if axis in ENDS:
            return self._ends_comm(axis)
        if axis in EXPERT:  # named ep / edp even when they are the same ranks as dp, for the counts
            size = self.size(axis)
            return AxisComm(axis, self.groups[axis] if size > 1 else None, size, self.coords[axis], self.stats)
        size, name = self.size(axis), self.counted_name(axis)
        if size == 1:
            return AxisComm(name, None, 1, 0, self.stats)
        return AxisComm(name, self.groups[axis], size, self.ranks_along(axis).index(self.rank), self.stats)

    def _ends_comm(self, name: str) -> AxisComm:
        """The two end ranks of the axis (this rank alone when it is not an end, or the axis has one rank)."""
        axis = ENDS[name]
        size, coord = self.grid[axis], self.coords[axis]
        if size == 1 or coord not in (0, size - 1):
            return AxisComm(name, None, 1, 0, self.stats)
        group = self.groups[axis] if size == 2 else self.groups[name]
        return AxisComm(name, group, 2, 0 if coord == 0 else 1, self.stats)

    def device_mesh(self, layout: str = "dense", device_type: str | None = None):
        """torch's ``DeviceMesh`` over this mesh's axes of more than one rank, for DTensor and DCP:
        ``layout`` "dense" has the dims (pp, dp, cp, sp, tp), "expert" (pp, edp, ep, tp). It is made
        from this mesh's process groups (``DeviceMesh.from_group``), so it makes no new ones, and
        once per layout. ``device_type``: "cuda" under NCCL, else "cpu", unless given."""
        if layout not in DEVICE_MESH_LAYOUTS:
            raise ValueError(f"layout {layout!r}: must be one of {sorted(DEVICE_MESH_LAYOUTS)}")
        device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        if (layout, device_type) not in self._device_meshes:
            self._device_meshes[layout, device_type] = self._make_device_mesh(layout, device_type)
        return self._device_meshes[layout, device_type]

    def _make_device_mesh(self, layout: str, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh  # only for DTensor users

        axes = DEVICE_MESH_LAYOUTS[layout]
        real = [a for a in axes if self.size(a) > 1]
        if not real:  # one rank: a 1-D mesh of it, named after the replicas
            return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=(axes[1],))
        missing = [a for a in real if self.groups[a] is None]
        if missing:
            raise RuntimeError(f"no process groups for axes {missing}: build the Mesh after init_process_group, "
                               f"with make_groups=True")
        ranks = torch.arange(self.world_size).reshape([self.size(a) for a in real])  # the layout, see EXPERT
        return DeviceMesh.from_group([self.groups[a] for a in real], device_type, mesh=ranks,
                                     mesh_dim_names=tuple(real))

    def __repr__(self) -> str:
        shape = " x ".join(f"{a}={self.sizes[a]}" for a in AXES)
        experts = f" (ep={self.sizes['ep']} inside dp x sp)" if self.sizes["ep"] > 1 else ""
        if self.grid["dp_replicate"] > 1:
            shape += f" (dp = dp_replicate={self.grid['dp_replicate']} x dp_shard={self.grid['dp_shard']})"
        return f"Mesh({shape}{experts}, rank={self.rank}, coords={self.coords})"
