"""The device mesh: named parallel axes, this rank's coordinates, and one process group per axis.

Built once from the config and the world size and passed explicitly; nothing here is global, so
a test may build two meshes in one process. Ranks are laid out with ``tp`` innermost (adjacent
ranks, so tensor-parallel traffic stays inside a node), then ``sp``, ``cp``, ``dp``, ``pp`` outermost,
as Megatron and torchtitan do. Expert parallelism adds no ranks: ``ep`` and ``edp`` factor the
data-parallel replicas (see ``EXPERT``). The groups are our own; :meth:`Mesh.device_mesh` shows
them to torch as a ``DeviceMesh`` without making new ones (docs/architecture.md, "Mesh").
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from bigtrain.config import ParallelConfig
from bigtrain.distributed.comm import AxisComm, CommStats, world_timeout

AXES = ("pp", "dp", "cp", "sp", "tp")  # outermost first
# Axes flattened into one group: the replicas of every weight under Ulysses sequence parallelism
# are the ranks of dp x sp, so gradients are reduced (and ZeRO shards cut) over both at once;
# context parallelism (cp) cuts the sequence too, so its ranks are replicas of every weight as well.
# The name predates cp: ``dp_sp`` is every axis that holds whole weights, dp x cp x sp.
FLATTENED = {"dp_sp": ("dp", "cp", "sp")}
# The first and last rank of an axis: the pipeline ranks holding the first stage (the embedding)
# and the last (the output head), which keep one copy each of a weight tied between the two.
ENDS = {"pp_ends": "pp"}
# Expert parallelism factors the replicas of a dense weight, dp x sp (flattened, sp inner), as
# edp x ep: experts are sharded over ``ep``, the inner factor (adjacent ranks, so the token
# all-to-all stays close), and replicated over ``edp``, the outer one ("expert data parallel": expert
# gradients are reduced and ZeRO-sharded there). Every rank of dp x sp holds different tokens at an
# MoE layer, so ep may take from sp as torchtitan's ep takes from dp_shard x cp; with sp = 1 it is
# the inner part of dp, as in Megatron-Core.
EXPERT = ("ep", "edp")
KNOWN = (*AXES, "ep")  # the sizes a mesh is built from
# torch DeviceMesh views of the same ranks (Mesh.device_mesh): dims of size 1 are left out.
DEVICE_MESH_LAYOUTS = {"dense": AXES, "expert": ("pp", "edp", "ep", "tp")}


class Mesh:
    """Named axes over ``world_size`` ranks; ``groups`` are made only when torch.distributed is up."""

    def __init__(self, sizes: dict[str, int], rank: int = 0, make_groups: bool = True):
        unknown = set(sizes) - set(KNOWN)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {KNOWN}")
        grid = {axis: int(sizes.get(axis, 1)) for axis in AXES}
        ep, replicas = int(sizes.get("ep", 1)), grid["dp"] * grid["cp"] * grid["sp"]
        if ep < 1 or replicas % ep:
            replica_axes = ("dp", "cp", "sp") if grid["cp"] > 1 else ("dp", "sp")
            raise ValueError(f"ep = {ep} must be >= 1 and divide {' x '.join(replica_axes)} = "
                             f"{' x '.join(str(grid[a]) for a in replica_axes)}: experts "
                             f"are sharded over part of the data-parallel ranks, which ep does not multiply")
        self.sizes = {**grid, "ep": ep}  # ep is not a factor of the world size
        self.world_size = math.prod(grid.values())
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        self.rank = rank
        self.stats = CommStats()
        self.coords = self._coords_of(rank)
        replica = (self.coords["dp"] * grid["cp"] + self.coords["cp"]) * grid["sp"] + self.coords["sp"]  # in dp_sp
        self.coords.update(ep=replica % ep, edp=replica // ep)
        self.groups: dict[str, dist.ProcessGroup | None] = {
            axis: None for axis in (*AXES, *FLATTENED, *ENDS, *EXPERT)}
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

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis in reversed(AXES):
            strides[axis] = stride
            stride *= self.sizes[axis]
        return strides

    def _coords_of(self, rank: int) -> dict[str, int]:
        strides = self._strides()
        return {axis: rank // strides[axis] % self.sizes[axis] for axis in AXES}

    def _rank_of(self, coords: dict[str, int]) -> int:
        strides = self._strides()
        return sum(coords[axis] * strides[axis] for axis in AXES)

    def ranks_along(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of the ``axis`` group that ``rank`` (default: this rank) belongs to, in the
        order of the group's own ranks; ``axis`` is a grid axis, a flattened one or ep / edp."""
        if axis in FLATTENED:
            return self.ranks_across(FLATTENED[axis], rank)
        if axis in EXPERT:
            rank = self.rank if rank is None else rank
            replicas = self.ranks_across(FLATTENED["dp_sp"], rank)
            return next(ranks for ranks in self._split_replicas(axis, replicas) if rank in ranks)
        return self.ranks_across((axis,), rank)

    def ranks_across(self, axes: tuple[str, ...], rank: int | None = None) -> list[int]:
        """Global ranks sharing ``rank``'s coordinates on every axis but ``axes``."""
        base = self._coords_of(self.rank if rank is None else rank)
        out = []
        for values in itertools.product(*(range(self.sizes[a]) for a in axes)):
            out.append(self._rank_of({**base, **dict(zip(axes, values))}))
        return sorted(out)

    def all_groups(self, axis: str) -> list[list[int]]:
        """The ranks of every ``axis`` group of the mesh (each group once, in the same order on
        every rank), whether or not a process group is made for it."""
        if axis in ENDS:
            return self._end_rank_pairs(ENDS[axis])
        parts = FLATTENED.get(axis, FLATTENED["dp_sp"] if axis in EXPERT else (axis,))
        others = [a for a in AXES if a not in parts]
        out = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            ranks = self.ranks_across(parts, self._rank_of(dict(zip(others, fixed), **{a: 0 for a in parts})))
            out += self._split_replicas(axis, ranks) if axis in EXPERT else [ranks]
        return out

    def _split_replicas(self, axis: str, replicas: list[int]) -> list[list[int]]:
        """One dp x sp group (sorted ranks are in flattened order) cut into its ep or edp groups."""
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
        """The names that get process groups: every axis of more than one rank, except a flattened
        axis with a single real part (it is that part, see comm) and ends of two ranks (the axis)."""
        names = [a for a in AXES if self.sizes[a] > 1]
        names += [name for name, parts in FLATTENED.items() if sum(self.sizes[a] > 1 for a in parts) > 1]
        names += [name for name, axis in ENDS.items() if self.sizes[axis] > 2]
        return names + [name for name in EXPERT if self.size(name) > 1]

    def _end_rank_pairs(self, axis: str) -> list[list[int]]:
        """[rank at coordinate 0, rank at the last coordinate] of ``axis``, for every setting of the others."""
        others = [a for a in AXES if a != axis]
        pairs = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            coords = dict(zip(others, fixed))
            pairs.append([self._rank_of({**coords, axis: 0}), self._rank_of({**coords, axis: self.sizes[axis] - 1})])
        return pairs

    def size(self, axis: str) -> int:
        if axis in EXPERT:
            ep = self.sizes["ep"]
            return ep if axis == "ep" else self.size("dp_sp") // ep
        if axis in ENDS:
            return min(2, self.sizes[ENDS[axis]])
        if axis in FLATTENED:
            return math.prod(self.sizes[a] for a in FLATTENED[axis])
        return self.sizes[axis]

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    def comm(self, axis: str) -> AxisComm:
        """Counted collectives over ``axis`` ("world" means every rank)."""
        if axis == "world":
            return AxisComm("world", None, self.world_size, self.rank, self.stats)
        if axis in ENDS:
            return self._ends_comm(axis)
        if axis in EXPERT:  # named ep / edp even when they are the same ranks as dp, for the counts
            size = self.size(axis)
            return AxisComm(axis, self.groups[axis] if size > 1 else None, size, self.coords[axis], self.stats)
        if axis in FLATTENED:
            real = [a for a in FLATTENED[axis] if self.sizes[a] > 1]
            if len(real) < 2:  # only one part is real: it is that axis
                return self.comm(real[0] if real else FLATTENED[axis][0])
            rank = self.ranks_across(FLATTENED[axis]).index(self.rank)
            return AxisComm(axis, self.groups[axis], self.size(axis), rank, self.stats)
        return AxisComm(axis, self.groups[axis], self.sizes[axis], self.coords[axis], self.stats)

    def _ends_comm(self, name: str) -> AxisComm:
        """The two end ranks of the axis (this rank alone when it is not an end, or the axis has one rank)."""
        axis = ENDS[name]
        size, coord = self.sizes[axis], self.coords[axis]
        if size == 1 or coord not in (0, size - 1):
            return AxisComm(name, None, 1, 0, self.stats)
        group = self.groups[axis] if size == 2 else self.groups[name]
        return AxisComm(name, group, 2, 0 if coord == 0 else 1, self.stats)

    def device_mesh(self, layout: str = "dense", device_type: str | None = None):
        """torch's ``DeviceMesh`` over this mesh's axes of more than one rank, for DTensor and DCP:
        ``layout`` "dense" has the dims (pp, dp, sp, tp), "expert" (pp, edp, ep, tp). It is made
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
        return f"Mesh({shape}{experts}, rank={self.rank}, coords={self.coords})"
