"""The device mesh: named parallel axes, this rank's coordinates, and one process group per axis.

Built once from the config and the world size and passed explicitly; nothing here is global, so
a test may build two meshes in one process. Ranks are laid out with ``tp`` innermost (adjacent
ranks, so tensor-parallel traffic stays inside a node), then ``sp``, ``dp``, and ``pp`` outermost,
as Megatron and torchtitan do.
"""

from __future__ import annotations

import itertools
import math

import torch.distributed as dist

from bigtrain.config import ParallelConfig
from bigtrain.distributed.comm import AxisComm, CommStats, world_timeout

AXES = ("pp", "dp", "sp", "tp")  # outermost first
# Axes flattened into one group: the replicas of every weight under Ulysses sequence parallelism
# are the ranks of dp x sp, so gradients are reduced (and ZeRO shards cut) over both at once.
FLATTENED = {"dp_sp": ("dp", "sp")}
# The first and last rank of an axis: the pipeline ranks holding the first stage (the embedding)
# and the last (the output head), which keep one copy each of a weight tied between the two.
ENDS = {"pp_ends": "pp"}


class Mesh:
    """Named axes over ``world_size`` ranks; ``groups`` are made only when torch.distributed is up."""

    def __init__(self, sizes: dict[str, int], rank: int = 0, make_groups: bool = True):
        unknown = set(sizes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {AXES}")
        self.sizes = {axis: int(sizes.get(axis, 1)) for axis in AXES}
        self.world_size = math.prod(self.sizes.values())
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        self.rank = rank
        self.stats = CommStats()
        self.coords = self._coords_of(rank)
        self.groups: dict[str, dist.ProcessGroup | None] = {axis: None for axis in (*AXES, *FLATTENED, *ENDS)}
        if make_groups and self.world_size > 1:
            self._make_groups()

    @classmethod
    def from_config(cls, parallel: ParallelConfig, rank: int = 0, world_size: int = 1) -> "Mesh":
        sizes = {"pp": parallel.pp, "dp": parallel.dp, "sp": parallel.sp, "tp": parallel.tp}
        if math.prod(sizes.values()) != world_size:
            raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} ranks, world size is {world_size}")
        return cls(sizes, rank)

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
        """Global ranks of the ``axis`` group that ``rank`` (default: this rank) belongs to."""
        return self.ranks_across((axis,), rank)

    def ranks_across(self, axes: tuple[str, ...], rank: int | None = None) -> list[int]:
        """Global ranks sharing ``rank``'s coordinates on every axis but ``axes``."""
        base = self._coords_of(self.rank if rank is None else rank)
        out = []
        for values in itertools.product(*(range(self.sizes[a]) for a in axes)):
            out.append(self._rank_of({**base, **dict(zip(axes, values))}))
        return sorted(out)

    def _make_groups(self) -> None:
        # Every rank must call new_group for every group, in the same order; each waits as long as
        # the world group (distributed.timeout_s), not torch's 30-minute default for new groups.
        timeout = world_timeout()
        for name, axes in [(a, (a,)) for a in AXES] + list(FLATTENED.items()):
            if sum(self.sizes[a] > 1 for a in axes) < len(axes) or self.sizes[axes[0]] == 1:
                continue  # a flattened axis is made only when all its parts are real
            others = [a for a in AXES if a not in axes]
            for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
                coords = dict(zip(others, fixed), **{a: 0 for a in axes})
                ranks = self.ranks_across(axes, self._rank_of(coords))
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.groups[name] = group
        for name, axis in ENDS.items():
            if self.sizes[axis] <= 2:
                continue  # two ranks or fewer: the ends are the whole axis, whose group serves (see comm)
            for ranks in self._end_rank_pairs(axis):
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.groups[name] = group

    def _end_rank_pairs(self, axis: str) -> list[list[int]]:
        """[rank at coordinate 0, rank at the last coordinate] of ``axis``, for every setting of the others."""
        others = [a for a in AXES if a != axis]
        pairs = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            coords = dict(zip(others, fixed))
            pairs.append([self._rank_of({**coords, axis: 0}), self._rank_of({**coords, axis: self.sizes[axis] - 1})])
        return pairs

    def size(self, axis: str) -> int:
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

    def __repr__(self) -> str:
        shape = " x ".join(f"{a}={s}" for a, s in self.sizes.items())
        return f"Mesh({shape}, rank={self.rank}, coords={self.coords})"
