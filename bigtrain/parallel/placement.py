"""Where every parameter lives on the mesh: one record, built by the parallelize steps, read by all.

A :class:`Placement` says, for one parameter (as this rank holds it):

- ``shards``: tensor dimensions cut over mesh axes (:class:`ShardSpec`, each naming its axis):
  tensor parallelism's column / row / vocabulary shards over ``tp``; experts over ``ep``; later
  row- or column-wise embedding tables over their shard group;
- ``flat``: the axis whose ranks each hold a flat range of the parameter's ZeRO unit (stages 1-3);
- ``replicate``: axes whose ranks hold the same values of it (what they hold of it, after the cuts
  above): such copies are counted once in the gradient norm and written once in checkpoints;
- ``partial``: axes over which its gradient is a partial sum that must be reduced before the step:
  the data-parallel axis (``dp_sp`` for dense weights, ``edp`` for experts; under hybrid sharded
  data parallelism ``dp_shard_sp`` or ``edp_shard``, the ZeRO group, then ``dp_replicate``, across the groups:
  :data:`REPLICA_AXES`), ``tp`` for replicated
  weights that see a sequence shard (norms under sequence parallelism) or part of a projection
  (replicated key/value heads), ``pp_ends`` for the two copies of a weight tied across the pipeline;
- ``canonical``: for a copy of another parameter (the tied head on the last pipeline stage), the
  name it is initialized and saved under.

This is DTensor's Shard / Replicate / Partial per mesh dimension (and TorchRec's
``ParameterSharding``), written for our flat ZeRO ranges, which DTensor cannot express.

Who reads it: the engines (which group reduces each gradient, which group a ZeRO unit is cut
over: :meth:`Placement.grad_axis`), the tensor-parallel hooks (``partial`` over ``tp``), the tied
copies (``partial`` over ``pp_ends``), gradient-norm clipping (:meth:`Placements.counted_in_norm`),
checkpoints (entry names, full shapes, chunk offsets and who writes), full-state gathering and
sharded initialization (:meth:`Placements.gather_full`, :meth:`Placements.local_init`), and
``bigtrain check`` (which names are copies of which).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm, CommStats

# The axes over which an engine reduces (and ZeRO shards) gradients: the replicas of a dense
# weight (dp, times sp under Ulysses) or of an expert (the expert-data-parallel axis); under HSDP
# the part of either inside one replica group.
DATA_AXES = ("dp_sp", "edp", "dp_shard_sp", "edp_shard")
# The axes over which a gradient already reduced over its data axis (and cut there by ZeRO) is
# all-reduced once more: the replicas of a ZeRO group under HSDP (distributed/mesh.py).
REPLICA_AXES = ("dp_replicate",)
NORM_AXIS = "world"  # squared gradient norms are summed over every rank (see counted_in_norm)


@dataclass(frozen=True)
class ShardSpec:
    """The local tensor is part ``index`` of ``parts`` equal parts of the full tensor along ``dim``,
    after padding that dimension from ``full_size`` to ``padded_size`` (vocabularies), cut over the
    mesh axis ``axis``."""

    dim: int
    index: int
    parts: int
    full_size: int
    padded_size: int
    axis: str = "tp"

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        if self.padded_size > self.full_size:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded_size - self.full_size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        return full.chunk(self.parts, dim=self.dim)[self.index].contiguous()

    def full_from_parts(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=self.dim).narrow(self.dim, 0, self.full_size)

    @property
    def local_size(self) -> int:
        """The part's size along ``dim`` (padding included)."""
        return self.padded_size // self.parts

    @property
    def offset(self) -> int:
        """Where this part starts along ``dim`` of the (padded) full tensor."""
        return self.index * self.local_size


def even_shard(size: int, parts: int, index: int, dim: int, pad_to: int = 1, axis: str = "tp") -> ShardSpec:
    """Part ``index`` of ``parts`` equal parts along ``dim``, the size padded to a multiple of
    ``parts x pad_to`` (pad_to 1: no padding, the caller checks that ``parts`` divides it)."""
    return ShardSpec(dim, index, parts, size, -(-size // (parts * pad_to)) * parts * pad_to, axis)


def vocab_pad_to(vocab: int, parts: int) -> int:
    """A vocabulary that ``parts`` does not divide is padded to a multiple of 8 x parts (whole
    8-row tiles per rank), as Megatron does; the padding rows are masked in the loss."""
    return 1 if vocab % parts == 0 else 8


@dataclass(frozen=True)
class Placement:
    shards: tuple[ShardSpec, ...] = ()
    flat: str | None = None
    replicate: tuple[str, ...] = ()
    partial: tuple[str, ...] = ()
    canonical: str | None = None

    def __post_init__(self):
        dims = [s.dim for s in self.shards]
        if len(set(dims)) != len(dims):
            raise ValueError(f"placement: two shardings of one dimension ({self.shards}); nest them in one axis")
        if self.flat is not None and self.flat != self.grad_axis:
            raise ValueError(f"placement: ZeRO cuts a unit over the axis its gradients are reduced on "
                             f"({self.grad_axis}), not over {self.flat}")

    @property
    def grad_axis(self) -> str | None:
        """The data-parallel axis whose ranks hold replicas of it and reduce its gradient (the
        engine's group for it), or None when no engine reduction is needed."""
        return next((a for a in self.partial if a in DATA_AXES), None)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The axes over which the gradient, reduced over :attr:`grad_axis`, is then all-reduced."""
        return tuple(a for a in self.partial if a in REPLICA_AXES)

    def shard_over(self, axis: str) -> ShardSpec | None:
        return next((s for s in self.shards if s.axis == axis), None)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        for s in self.shards:
            shape[s.dim] = s.full_size
        return tuple(shape)

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        for s in self.shards:
            shape[s.dim] = s.local_size
        return tuple(shape)

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        for s in self.shards:
            full = s.local_from_full(full)
        return full

    def with_shard(self, spec: ShardSpec) -> "Placement":
        """Cut along ``spec.dim`` over ``spec.axis``: no longer replicated there."""
        return replace(self, shards=self.shards + (spec,), replicate=_without(self.replicate, spec.axis))

    def with_partial(self, axis: str) -> "Placement":
        return replace(self, partial=_with(self.partial, axis))

    def with_copy(self, axis: str, canonical: str | None) -> "Placement":
        """A copy of the same weight on the other ranks of ``axis`` (tied weights across the
        pipeline): replicated there, its gradient summed there."""
        return replace(self, replicate=_with(self.replicate, axis), partial=_with(self.partial, axis),
                       canonical=canonical)

    def sharded_flat(self) -> "Placement":
        """ZeRO (stages 1-3): each replica over the gradient axis holds a flat range of the unit."""
        axis = self.grad_axis
        if axis is None:
            return self
        return replace(self, flat=axis, replicate=_without(self.replicate, axis))

    def describe(self) -> str:
        parts = [f"shard({s.axis}, dim {s.dim})" for s in self.shards]
        parts += [f"flat({self.flat})"] if self.flat else []
        parts += [f"replicate({', '.join(self.replicate)})"] if self.replicate else []
        parts += [f"partial({', '.join(self.partial)})"] if self.partial else []
        parts += [f"copy of {self.canonical}"] if self.canonical else []
        return " ".join(parts) or "local"


def _with(axes: tuple[str, ...], axis: str) -> tuple[str, ...]:
    return axes if axis in axes else axes + (axis,)


def _without(axes: tuple[str, ...], axis: str) -> tuple[str, ...]:
    return tuple(a for a in axes if a != axis)


def dense(data_axis: str = "dp_sp", model_axes: tuple[str, ...] = ("tp",),
          replica_axes: tuple[str, ...] = ()) -> Placement:
    """A plain weight: whole on every rank of ``model_axes``, of the data axis and of the
    ``replica_axes`` (HSDP's dp_replicate), whose ranks see different samples (its gradient is
    partial there: reduced over the data axis, then over the replica axes)."""
    return Placement(replicate=(data_axis, *replica_axes, *model_axes), partial=(data_axis, *replica_axes))


CommOf = Callable[[str], AxisComm]


class Placements(Mapping[str, Placement]):
    """The placement of every parameter this rank holds, by name, and the axes' groups
    (``comm_of``: axis name -> :class:`AxisComm`, e.g. ``mesh.comm``; each asked once)."""

    def __init__(self, by_name: dict[str, Placement], comm_of: CommOf):
        self._by_name, self._comm_of, self._comms = dict(by_name), comm_of, {}

    @classmethod
    def of_model(cls, model: nn.Module, comm_of: CommOf, data_axis: str = "dp_sp",
                 model_axes: tuple[str, ...] = ("tp",), replica_axes: tuple[str, ...] = ()) -> "Placements":
        """Every parameter of ``model`` (under every name it is registered as) placed as :func:`dense`."""
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        return cls({n: dense(data_axis, model_axes, replica_axes) for n in names}, comm_of)

    @classmethod
    def data_parallel(cls, model: nn.Module, comm: AxisComm) -> "Placements":
        """An engine given only its group ``comm``: every parameter replicated over it, and nothing else
        (``comm`` is also the norm's group: the engine's ranks are all the ranks there are)."""
        comms = {"dp_sp": comm, NORM_AXIS: comm}
        return cls.of_model(model, lambda axis: comms[axis], "dp_sp", ())

    # -- the mapping ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Placement:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def update(self, name: str, placement: Placement) -> None:
        """Used by the parallelize steps while they build the record; nobody else writes it."""
        self._by_name[name] = placement

    def restricted_to(self, model: nn.Module) -> "Placements":
        """The record of the parameters ``model`` (this rank's pipeline stages) holds."""
        held = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        return Placements({n: p for n, p in self._by_name.items() if n in held}, self._comm_of)

    def comm(self, axis: str) -> AxisComm:
        """The group of ``axis``; ``"none"``: this rank alone (a gradient nobody else adds to)."""
        if axis not in self._comms:
            self._comms[axis] = AxisComm("none", None, 1, 0, CommStats()) if axis == "none" else self._comm_of(axis)
        return self._comms[axis]

    # -- what readers ask ----------------------------------------------------------------------
    def grad_comm(self, name: str) -> AxisComm:
        """The group that reduces parameter ``name``'s gradient in its engine (and, under ZeRO, cuts
        its unit); a group of one rank when its gradient needs no data-parallel reduction."""
        axis = self[name].grad_axis
        return self.comm(axis if axis is not None else "none")

    def replica_comm(self, name: str) -> AxisComm:
        """The group over which parameter ``name``'s reduced gradient (shard) is all-reduced once
        more (HSDP's dp_replicate); a group of one rank when there is none."""
        axes = self[name].replica_axes
        if len(axes) > 1:
            raise ValueError(f"placement of {name}: more than one replica axis {axes}")
        return self.comm(axes[0] if axes else "none")

    def names_partial_over(self, axis: str) -> list[str]:
        return [n for n, p in self._by_name.items() if axis in p.partial]

    def _first_on(self, axes) -> bool:
        return all(self.comm(a).rank == 0 for a in axes)

    def counted_in_norm(self, name: str) -> bool:
        """Whether this rank adds its part of ``name``'s squared gradient to the norm, which is summed
        over every rank (:data:`NORM_AXIS`): the ranks that hold different parts (shards, flat
        ranges, pipeline stages) all count theirs; of the ranks holding the same values (replicas,
        after their reduction) only the first does, so no value is counted twice."""
        return self._first_on(self[name].replicate)

    def writes_checkpoint(self, name: str) -> bool:
        """Whether this rank writes its part of ``name`` (before the engine's even split of a range
        among its data-parallel replicas): only the first of the ranks holding the same values over
        any other axis (tp for a replicated norm, pp_ends for a tied copy) does."""
        p = self[name]
        return self._first_on(a for a in p.replicate if a != p.grad_axis)

    def first_part(self, name: str) -> bool:
        """Whether this rank holds the first part of every cut of ``name`` (per-tensor optimizer
        state is written once, by the owner of the first element)."""
        return all(s.index == 0 for s in self[name].shards)

    def saved_name(self, name: str) -> str:
        return self[name].canonical or name

    def copies(self) -> dict[str, str]:
        """{name: canonical name} of the copies this rank holds."""
        return {n: p.canonical for n, p in self._by_name.items() if p.canonical}

    # -- cutting and gathering by placement ------------------------------------------------------
    def local_init(self, full_init: Callable[[str, tuple], torch.Tensor]) -> Callable[[str, tuple], torch.Tensor]:
        """``init_fn(name, local_shape)`` giving this rank's part of ``full_init(name, full_shape)``."""
        def init(name: str, local_shape: tuple) -> torch.Tensor:
            p = self._by_name.get(name)
            if p is None or not p.shards:
                return full_init(name, local_shape)
            return p.local_from_full(full_init(name, p.full_shape(local_shape)))
        return init

    def shard_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors by parameter name -> this rank's parts (no communication)."""
        return {n: self[n].local_from_full(t) if n in self._by_name else t for n, t in tensors.items()}

    def gather_full(self, tensors: dict[str, torch.Tensor], device: torch.device | None = None
                    ) -> dict[str, torch.Tensor]:
        """This rank's parts by parameter name -> full tensors (a collective over each cut's axis, in
        the same order on every rank). The gather runs on ``device`` when given (NCCL cannot gather
        host copies); each full tensor comes back on the device its part was on."""
        from bigtrain.parallel.tensor.functional import gather_along

        out = {}
        for name, t in tensors.items():
            p = self._by_name.get(name)
            if p is None or not p.shards:
                out[name] = t
                continue
            full = t.to(device) if device is not None else t
            for s in reversed(p.shards):  # undo the cuts, the last one first
                comm = self.comm(s.axis)
                full = s.full_from_parts(list(gather_along(full, comm, s.dim, "checkpoint").chunk(s.parts, s.dim)))
            out[name] = full.to(t.device).clone()
        return out

    def describe(self) -> str:
        width = max((len(n) for n in self._by_name), default=0)
        return "\n".join(f"{n:<{width}}  {p.describe()}" for n, p in self._by_name.items())

