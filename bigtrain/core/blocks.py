"""A model's blocks, found from its structure: the units ZeRO shards one at a time and activation
memory is planned per (a model family may name its own; this is the default for any module)."""

from __future__ import annotations

import warnings

from torch import nn

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
        warnings.warn(f"found no blocks in {type(model).__name__} (no nn.ModuleList, nn.Sequential "
                      f"or nn.ModuleDict of modules with parameters), so the whole model is one unit, gathered "
                      f"and reduced at once; pass unit_modules=[...] (e.g. its transformer blocks) to shard it "
                      f"block by block", UserWarning, stacklevel=3)
    return blocks
