"""Choosing ZeRO units and turning a (meta) model's parameters into views of flat buffers."""

from __future__ import annotations

import warnings

from torch import nn

from bigtrain.parallel.zero.flat import FlatUnit

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_unit_modules(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the children holding parameters of the container (``nn.ModuleList``,
    ``nn.Sequential`` or ``nn.ModuleDict``) that holds the most parameters in two or more of them,
    whatever its name (``model.layers`` of a transformer, ``model.blocks`` of a user's module)."""
    blocks, most = [], 0
    for module in model.modules():
        if isinstance(module, _CONTAINERS):
            children = [c for c in module.children() if _numel(c) > 0]
            numel = sum(_numel(c) for c in children)
            if len(children) >= 2 and numel > most:
                blocks, most = children, numel
    if not blocks:
        # One unit is the whole model: ZeRO-3 would gather all of it at once and no reduction
        # could start before backward ends. Correct, but rarely what the user meant.
        warnings.warn(f"ZeroEngine: found no blocks in {type(model).__name__} (no nn.ModuleList, nn.Sequential "
                      f"or nn.ModuleDict of modules with parameters), so the whole model is one unit, gathered "
                      f"and reduced at once; pass unit_modules=[...] (e.g. its transformer blocks) to shard it "
                      f"block by block", UserWarning, stacklevel=3)
    return blocks


def build_units(model: nn.Module, unit_modules: list[nn.Module], shards: int, shard_rank: int
                ) -> tuple[list[FlatUnit], list[nn.Module]]:
    """One FlatUnit per unit module plus a root unit (the model) for every parameter left over.

    Returns the units and their modules, root first. A parameter shared by two modules (tied
    embeddings) belongs to the first unit that holds it, in the order root-last.
    """
    names = {}
    for name, p in model.named_parameters():  # named_parameters de-duplicates shared parameters
        names.setdefault(id(p), name)
    taken: set[int] = set()
    units, modules = [], []
    for i, module in enumerate(unit_modules):
        own = [(names[id(p)], p) for p in module.parameters() if id(p) not in taken and p.requires_grad]
        taken.update(id(p) for _, p in own)
        if own:
            units.append(FlatUnit(f"unit{i}", own, shards, shard_rank))
            modules.append(module)
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in taken and p.requires_grad]
    if rest:
        units.insert(0, FlatUnit("root", rest, shards, shard_rank))
        modules.insert(0, model)
    return units, modules


def replace_parameters(model: nn.Module, new_of: dict[int, nn.Parameter]) -> None:
    """Swap parameters everywhere they are registered (a tied weight is swapped in both places)."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in new_of:
                module._parameters[key] = new_of[id(p)]
