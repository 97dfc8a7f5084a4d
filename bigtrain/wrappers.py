"""Wrappers: a module that takes another's place in a model and adds behaviour around its forward.

Recomputation (``memory/checkpointing.py``, ``memory/selective.py``), int8 saved inputs
(``memory/compression.py``), the fused loss head (``memory/fused_loss.py``), the vocabulary-parallel
lookup (``parallel/tensor/styles.py``) and compiled regions (``parallel/compile.py``) are each a
:class:`ModuleWrapper` put where the plain module was. None of them changes the wrapped module,
its ``forward`` or its attributes.

torch's ``checkpoint_wrapper`` keeps the wrapped block as a child (``_checkpoint_wrapped_module``)
and strips that prefix from state dicts with hooks. bigtrain keys far more than state dicts by
parameter name (the placement record, ZeRO units, initial values, sharded checkpoints, parity
checks, tensor-parallel plans), so a wrapper here adds no name at all: it shares the wrapped
module's registries (parameters, buffers, children) and its hooks. For the parent it *is* the
module: ``named_parameters`` and ``state_dict`` read exactly as without it (old checkpoints load),
and a hook registered on either runs around the wrapper's call, outside what the wrapper adds, as
hooks ran around the module before. Inside, the wrapper calls the wrapped module's own
``forward`` (its hooks have run already). Wrappers nest; the outermost is the one in the model.
"""

from __future__ import annotations

from torch import nn

# What makes a module what it is to its parent and to hooks: shared by reference, not copied.
SHARED_STATE = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
                "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
                "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


class ModuleWrapper(nn.Module):
    """Takes ``wrapped``'s place (same parameters, children, buffers and hooks; no name of its own).
    Subclasses define ``forward`` and call ``self.wrapped.forward`` inside it, and name what
    they do in ``kind`` (the parallel model's record of transforms lists it)."""

    kind = "wrapper"

    def __init__(self, wrapped: nn.Module):
        super().__init__()
        object.__setattr__(self, "wrapped", wrapped)  # not registered: it would add a name
        for key in SHARED_STATE:
            object.__setattr__(self, key, getattr(wrapped, key))
        self.training = wrapped.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, children (the shared registries)
        except AttributeError:
            if name == "wrapped":
                raise
            return getattr(self.__dict__["wrapped"], name)  # plain attributes (in_features, eps, ...)

    def train(self, mode: bool = True) -> "ModuleWrapper":
        super().train(mode)
        self.wrapped.train(mode)
        return self

    def extra_repr(self) -> str:
        return f"wraps {type(self.wrapped).__name__}"


class WholeBackward:
    """Marks a wrapper whose backward computes its weight gradients with its input gradients
    (recomputation reads the weights again; a compiled region has one backward for both): the
    zero-bubble pipeline's split backward takes these weights' gradients in I, not in W
    (``parallel/pipeline/split_backward.py``)."""


def unwrapped(module: nn.Module) -> nn.Module:
    """The plain module under any number of wrappers."""
    while isinstance(module, ModuleWrapper):
        module = module.wrapped
    return module


def wrappers_of(module: nn.Module) -> list[ModuleWrapper]:
    """The wrappers around a plain module, outermost first."""
    out = []
    while isinstance(module, ModuleWrapper):
        out.append(module)
        module = module.wrapped
    return out


def is_wrapped_by(module: nn.Module, kind: type) -> bool:
    """Whether one of the wrappers around ``module`` is a ``kind``."""
    return any(isinstance(w, kind) for w in wrappers_of(module))


def transforms_of(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The record of what was wrapped: {qualified module name: kinds of its wrappers, outermost
    first}. Read from the model's structure, so it cannot disagree with it."""
    return {name: tuple(w.kind for w in wrappers_of(m)) for name, m in model.named_modules()
            if isinstance(m, ModuleWrapper)}


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` (qualified, e.g. ``layers.3.attention.core``) is."""
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def name_in(root: nn.Module, module: nn.Module) -> str:
    """The qualified name of ``module`` in ``root`` ('' for root itself)."""
    for name, sub in root.named_modules():
        if sub is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(root).__name__}")


def wrap(root: nn.Module, name: str, make) -> ModuleWrapper:
    """Wrap the submodule ``name`` of ``root`` in ``make(submodule)`` in place; returns the wrapper."""
    wrapper = make(root.get_submodule(name))
    replace_module(root, name, wrapper)
    return wrapper


def wrap_all(modules: nn.ModuleList | nn.ModuleDict, indices, make) -> list[ModuleWrapper]:
    """Wrap the entries ``indices`` of a container (a model's blocks) in place."""
    out = []
    for i in indices:
        key = i if isinstance(modules, nn.ModuleList) else str(i)
        modules[key] = make(modules[key])
        out.append(modules[key])
    return out
