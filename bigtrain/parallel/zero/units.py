"""Choosing ZeRO units and turning a (meta) model's parameters into views of flat buffers (the
default units are the model's blocks, :func:`bigtrain.core.blocks.default_unit_modules`)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.parallel.zero.flat import FlatUnit


def build_units(model: nn.Module, unit_modules: list[nn.Module], group_of: Callable[[str], AxisComm],
                sharded: bool, align: int = 1) -> tuple[list[FlatUnit], list[nn.Module]]:
    """FlatUnits for each unit module plus a root (the model) for every parameter left over.

    A unit's parameters share one group, ``group_of(name)`` (the placement record's gradient
    group: dp x sp for dense weights, edp for experts), which reduces its gradients and, when
    ``sharded`` (ZeRO stages 1-3), cuts it into that group's shards: a module holding parameters of
    two groups (an MoE block's attention and experts) becomes two units, the first named as usual
    (``unit<i>``), the others after their axis (``unit<i>:edp``). Every unit has its ``comm``.
    ``align``: the optimizer's block size, which every parameter's start and every cut respect.

    Returns the units and their modules, root first (a module once per unit). A parameter shared by
    two modules (tied embeddings) belongs to the first unit that holds it, in the order root-last.
    """
    names = {}
    for name, p in model.named_parameters():  # named_parameters de-duplicates shared parameters
        names.setdefault(id(p), name)
    taken: set[int] = set()
    units, modules = [], []

    def add(name: str, module: nn.Module, own: list[tuple[str, nn.Parameter]], at: int | None = None) -> None:
        for j, (comm, params) in enumerate(_by_group(own, group_of)):
            unit = FlatUnit(name if j == 0 else f"{name}:{comm.axis}", params, comm.size if sharded else 1,
                            comm.rank if sharded else 0, align)
            unit.comm = comm
            units.insert(len(units) if at is None else at + j, unit)
            modules.insert(len(modules) if at is None else at + j, module)

    for i, module in enumerate(unit_modules):
        own = [(names[id(p)], p) for p in module.parameters() if id(p) not in taken and p.requires_grad]
        taken.update(id(p) for _, p in own)
        add(f"unit{i}", module, own)
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in taken and p.requires_grad]
    add("root", model, rest, at=0)
    return units, modules


def _by_group(named: list[tuple[str, nn.Parameter]], group_of) -> list[tuple[AxisComm, list]]:
    """``named`` split by group, groups in order of first appearance (alike on every rank)."""
    groups: dict[int, tuple[AxisComm, list]] = {}
    for name, p in named:
        comm = group_of(name)
        groups.setdefault(id(comm), (comm, []))[1].append((name, p))
    return list(groups.values())


def replace_parameters(model: nn.Module, new_of: dict[int, nn.Parameter]) -> None:
    """Swap parameters everywhere they are registered (a tied weight is swapped in both places)."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in new_of:
                module._parameters[key] = new_of[id(p)]
