"""The optimizer seam: an optimizer is data (its declared state) plus a step function.

An :class:`OptimizerSpec` says what an optimizer keeps per parameter (:class:`StateTensor`: names,
dtypes, whether a tensor is shaped like the parameter or is one value per parameter tensor),
whether its update is elementwise, and how to build the object whose ``step()`` updates the
parameters from their ``.grad`` (a ``torch.optim.Optimizer``: ``param_groups``, ``state``,
``step``, ``load_state_dict``). Everything else reads the declaration:

- the engines build the optimizer through the spec and call ``step()``; the ZeRO engine hands it
  flat pieces of the master shard, so it refuses an optimizer that is not elementwise;
- full state and checkpoints gather and cut the ``per="element"`` state tensors exactly like the
  parameters they belong to, and copy the ``per="tensor"`` ones (a step count) to every piece;
- the planner (``plan/memory.py``) counts ``bytes_per_param`` and ``bytes_per_tensor``.

This module does not import torch, so config validation can list the registered names cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from bigtrain.config import OptimConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "uint8": 1}
PER = ("element", "tensor")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of an optimizer's state for each parameter it updates."""

    name: str  # the key in ``optimizer.state[param]``
    dtype: str = "fp32"
    # "element": one value per parameter element, shaped like the parameter: reshards like it.
    # "tensor": one value per parameter tensor (Adam's step count): copied to every shard.
    per: str = "element"

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"state {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.per not in PER:
            raise ValueError(f"state {self.name!r}: per = {self.per!r} must be 'element' or 'tensor'")

    @property
    def nbytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


# (param groups, each with "params" and "weight_decay"; the optim config) -> torch.optim.Optimizer
BuildFn = Callable[[list[dict], "OptimConfig"], Any]


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    state: tuple[StateTensor, ...]
    build: BuildFn
    # True: the update of each element reads only that element's parameter, gradient and state, so
    # it can run on flat ZeRO shards that cut parameters anywhere. False: it needs parameter shapes
    # (Adafactor's row and column statistics); only the replicated engine can run it for now.
    elementwise: bool = True
    summary: str = ""

    @property
    def element_state(self) -> tuple[str, ...]:
        """Names of the state tensors shaped like the parameter (they reshard with it)."""
        return tuple(s.name for s in self.state if s.per == "element")

    @property
    def tensor_state(self) -> tuple[str, ...]:
        """Names of the state tensors holding one value per parameter tensor (copied, not cut)."""
        return tuple(s.name for s in self.state if s.per == "tensor")

    @property
    def bytes_per_param(self) -> int:
        """State bytes per parameter element (AdamW: two fp32 moments, 8)."""
        return sum(s.nbytes for s in self.state if s.per == "element")

    @property
    def bytes_per_tensor(self) -> int:
        """State bytes per parameter tensor the optimizer is given (AdamW: its fp32 step, 4)."""
        return sum(s.nbytes for s in self.state if s.per == "tensor")

    def check_state(self, keys: Iterable[str], where: str) -> None:
        """Raise unless ``keys`` (of one parameter's state, found at ``where``) are exactly the
        declared names: state the declaration misses would be dropped by resharding."""
        found, declared = sorted(keys), sorted(s.name for s in self.state)
        if found != declared:
            raise ValueError(f"optimizer {self.name!r} declares state {declared} but {where} holds {found}; "
                             f"the declaration (OptimizerSpec.state) must name every state tensor")

    def saved_state(self, optim_state: dict) -> dict[str, dict]:
        """The per-parameter entries of a saved full optimizer state ({"optimizer": name, "state":
        {param name: {state name: tensor}}}), after checking they are this optimizer's."""
        saved_by = optim_state.get("optimizer", self.name)  # checkpoints from before the seam: AdamW's
        if saved_by != self.name:
            raise ValueError(f"the checkpoint's optimizer state is {saved_by!r}'s but optim.name = '{self.name}'; "
                             f"resume with optim.name = '{saved_by}'")
        entries = optim_state.get("state", {})
        for name, entry in entries.items():
            self.check_state(entry, f"the saved state of {name}")
        return entries


_REGISTRY: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec, replace: bool = False) -> OptimizerSpec:
    """Make ``spec`` selectable as ``optim.name = spec.name``; returns it."""
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"an optimizer named {spec.name!r} is already registered (pass replace=True)")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_optimizer(name: str) -> None:
    _REGISTRY.pop(name, None)


def get_optimizer(name: str) -> OptimizerSpec:
    if name not in _REGISTRY:
        raise ValueError(f"optim.name = '{name}': no such optimizer; registered: {', '.join(optimizer_names())}")
    return _REGISTRY[name]


def optimizer_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
