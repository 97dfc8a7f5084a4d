"""The optimizer seam: an optimizer is data (its declared state) plus a step function.

An :class:`OptimizerSpec` says what an optimizer keeps per parameter (:class:`StateTensor`: names,
dtypes, whether a tensor is shaped like the parameter or is one value per parameter tensor),
whether its update is elementwise, and how to build the object whose ``step()`` updates the
parameters from their ``.grad`` (a ``torch.optim.Optimizer``: ``param_groups``, ``state``,
``step``, ``load_state_dict``). Everything else reads the declaration:

- the engines build the optimizer through the spec and call ``step()``; the ZeRO engine hands it
  flat pieces of the master shard, so it refuses an optimizer that is not elementwise;
- full state and checkpoints gather and cut the ``per="element"`` state tensors exactly like the
  parameters they belong to, the ``per="block"`` ones (one value per block of ``block_size``
  elements, 8-bit AdamW's scales) like the parameters' blocks, and copy the ``per="tensor"`` ones
  (a step count, Adafactor's row and column statistics of the whole parameter) to every piece;
- what the engines may hand the optimizer is ``needs``: ``"elements"`` (any flat piece, cut
  anywhere), ``"blocks"`` (pieces of one parameter starting at a block boundary: ZeRO aligns its
  cuts), ``"shapes"`` (pieces of one parameter, each told where it sits in the whole parameter
  and which groups hold the rest, :mod:`bigtrain.optim.pieces`) or ``"whole"`` (whole parameters);
- the planner (``plan/memory.py``) counts ``bytes_per_param``, ``bytes_per_tensor`` and the
  ``factored_bytes`` of a parameter's shape.

This module does not import torch, so config validation can list the registered names cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from bigtrain.config import OptimConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "uint8": 1}
PER = ("element", "block", "tensor")
NEEDS = ("elements", "blocks", "shapes", "whole")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of an optimizer's state for each parameter it updates."""

    name: str  # the key in ``optimizer.state[param]``
    dtype: str = "fp32"
    # "element": one value per parameter element, shaped like the parameter: reshards like it.
    # "block": one value per block of ``block_size`` elements of the flattened parameter (a scale).
    # "tensor": one copy per parameter tensor, whatever its shape (Adam's step count, Adafactor's
    # statistics of the whole parameter): alike on every rank holding part of it, copied to each.
    per: str = "element"
    # per = "tensor" state whose size follows the parameter's shape (Adafactor's row and column
    # statistics): the spec's ``factored_bytes`` counts it, not ``bytes_per_tensor``.
    factored: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"state {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.per not in PER:
            raise ValueError(f"state {self.name!r}: per = {self.per!r} must be one of {', '.join(PER)}")

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
    # "elements": each element's update reads only its own parameter, gradient and state, so it
    # runs on flat ZeRO shards that cut parameters anywhere. "blocks": elementwise within blocks of
    # ``block_size(cfg)`` elements counted from each parameter's first (a block shares a scale).
    # "shapes": it needs sums over the whole parameter (Adafactor) and takes pieces of parameters,
    # told where each sits (an ``attach_pieces({id(tensor): ParamPiece})`` method on the optimizer).
    # "whole": it needs whole parameters; only the replicated engine (without tp) runs it.
    needs: str = "elements"
    summary: str = ""
    block_size: Callable[["OptimConfig"], int] | None = None
    # Bytes of per-tensor state for a parameter of this full shape (Adafactor: rows + columns).
    factored_bytes: Callable[[tuple], int] | None = None

    def __post_init__(self):
        if self.needs not in NEEDS:
            raise ValueError(f"optimizer {self.name!r}: needs = {self.needs!r} must be one of {', '.join(NEEDS)}")
        if (self.needs == "blocks") != (self.block_size is not None):
            raise ValueError(f"optimizer {self.name!r}: needs = 'blocks' goes with a block_size, and only it")

    @property
    def elementwise(self) -> bool:
        return self.needs == "elements"

    def alignment(self, cfg: "OptimConfig") -> int:
        """Elements a ZeRO cut must be a multiple of, counted from each parameter's start."""
        return self.block_size(cfg) if self.block_size is not None else 1

    def alignment_of(self, block_size: int) -> int:
        """:meth:`alignment` for a configured ``optim.block_size`` (the planner has no config)."""
        return block_size if self.block_size is not None else 1

    @property
    def element_state(self) -> tuple[str, ...]:
        """Names of the state tensors shaped like the parameter (they reshard with it)."""
        return tuple(s.name for s in self.state if s.per == "element")

    @property
    def block_state(self) -> tuple[str, ...]:
        """Names of the state tensors with one value per block of the flattened parameter."""
        return tuple(s.name for s in self.state if s.per == "block")

    @property
    def tensor_state(self) -> tuple[str, ...]:
        """Names of the state tensors holding one value per parameter tensor (copied, not cut)."""
        return tuple(s.name for s in self.state if s.per == "tensor")

    @property
    def bytes_per_param(self) -> int:
        """State bytes per parameter element (AdamW: two fp32 moments, 8)."""
        return sum(s.nbytes for s in self.state if s.per == "element")

    def state_bytes(self, numel: int, tensors: int, cfg: "OptimConfig | None" = None,
                    shapes: Iterable[tuple] = ()) -> float:
        """State bytes for ``numel`` elements held as ``tensors`` pieces (of parameters of full
        ``shapes``, for factored state): elements x bytes_per_param, plus blocks, plus per tensor."""
        total = numel * self.bytes_per_param + tensors * self.bytes_per_tensor
        if self.block_state and cfg is not None:
            per_block = sum(s.nbytes for s in self.state if s.per == "block")
            total += per_block * numel / self.block_size(cfg)
        if self.factored_bytes is not None:
            total += sum(self.factored_bytes(shape) for shape in shapes)
        return total

    @property
    def bytes_per_tensor(self) -> int:
        """State bytes per parameter tensor the optimizer is given (AdamW: its fp32 step, 4)."""
        return sum(s.nbytes for s in self.state if s.per == "tensor" and not s.factored)

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
