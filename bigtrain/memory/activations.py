"""The ``memory`` section applied to a plain (possibly tensor-parallel) Llama: one call for ``parallelize``.

In this order, each on the module structure before any weight exists: int8 compression of the
linear layers' saved inputs (innermost: a wrapper that changes how a linear computes), recomputation
(full, every k-th or selective), the fused head (``model.fused_loss``), and offload around every module
(outermost: its hooks also see the checkpoints' inputs). Each is a wrapper (``bigtrain/wrappers.py``)
or hooks; none of them changes a parameter name, a module's ``forward`` or its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from bigtrain.core.blocks import default_unit_modules
from bigtrain.distributed.comm import AxisComm
from bigtrain.memory.checkpointing import apply_activation_checkpointing
from bigtrain.memory.compression import compress_linear_inputs
from bigtrain.memory.fused_loss import fuse_head_into_loss
from bigtrain.memory.offload import ActivationOffloader
from bigtrain.memory.selective import apply_selective_recomputation, selective_parts
from bigtrain.models.moe import MoEFeedForward
from bigtrain.wrappers import name_in

if TYPE_CHECKING:
    from bigtrain.parallel.parallel_plan import ActivationPlan
    from bigtrain.parallel.tensor.plan import TensorLayout


@dataclass
class ActivationMemory:
    """What was applied: the blocks recomputed, the offloader (its stats), the fused head."""

    checkpointed: list[int]  # fully checkpointed blocks (their parameters are eager in a split backward)
    selective: bool
    offloader: ActivationOffloader | None = None
    head: nn.Module | None = None  # with model.fused_loss: call head(hidden, targets) for the loss sum
    compressed: int = 0  # linear layers saving int8 inputs

    def zero_units(self, model: nn.Module, unit_modules: list[nn.Module] | None) -> list[nn.Module] | None:
        """ZeRO units with the fused head as one of its own, where ``model`` holds it: the loss
        calls the head after the model's forward, when ZeRO-3 has released the root unit, so the
        head's own hooks must gather (and, in backward, gather again) its weight."""
        if self.head is None or not any(m is self.head for m in model.modules()):
            return unit_modules
        units = default_unit_modules(model) if unit_modules is None else list(unit_modules)
        if any(m is self.head for m in units):
            return units
        # Before the unit module that holds it (an interleaved rank's last chunk), which would
        # otherwise take its weight along (units take parameters first come, first served).
        holder = next((i for i, m in enumerate(units) if any(sub is self.head for sub in m.modules())), None)
        if holder is None:
            return units + [self.head]
        return units[:holder] + [self.head] + units[holder:]


def offloaded_modules(model: nn.Module, blocks=None) -> list[nn.Module]:
    """The modules whose saved tensors activation offload moves, in forward order: a Llama's
    embedding, blocks, final norm and head; another family's blocks (``blocks``, the plan's: a
    Hugging Face decoder's layers, where nearly all of its saved activations are)."""
    if blocks is not None:
        return list(blocks(model))
    parts = ("tok_embeddings", "layers", "norm", "output")
    if not all(hasattr(model, part) for part in parts):
        raise ValueError(f"ActivationPlan(offload=True): a {type(model).__name__} is not bigtrain's Llama (no "
                         f"{', '.join(p for p in parts if not hasattr(model, p))}); give the modules whose "
                         f"saved tensors move: ActivationPlan(blocks=lambda model: model.<its nn.ModuleList>)")
    return [model.tok_embeddings, *model.layers, model.norm, model.output]


def has_default_blocks(model: nn.Module) -> bool:
    """Whether ``model`` has the blocks :func:`block_list` takes where a plan names none (a Llama's)."""
    return isinstance(getattr(model, "layers", None), nn.Module)


def block_list(model: nn.Module, plan: "ActivationPlan", what: str = "ActivationPlan") -> nn.Module:
    """The container of ``model``'s blocks: the family's (``plan.blocks``), else a Llama's ``layers``;
    a model with neither is named with the fix (``what``: the plan that asked)."""
    if plan.blocks is not None:
        return plan.blocks(model)
    if not has_default_blocks(model):
        raise ValueError(f"{what} needs the blocks of a {type(model).__name__}, which has no 'layers' (bigtrain's "
                         f"Llama's): give {what}(blocks=lambda model: model.<its nn.ModuleList of blocks>)")
    return model.layers


def head_module(model: nn.Module, plan: "ActivationPlan", why: str) -> str:
    """``plan.head`` (the dotted name of the output projection), checked: a model of another shape
    gets the fix named rather than an AttributeError from deep inside a wrapper."""
    if not _has_submodule(model, plan.head):
        raise ValueError(f"ActivationPlan({why}) wraps the model's output projection, ActivationPlan.head = "
                         f"{plan.head!r}, which a {type(model).__name__} does not have: give "
                         f"ActivationPlan(head='<the dotted name of its output nn.Linear>')")
    return plan.head


def rows_split_over(model: nn.Module, layout: "TensorLayout | None") -> dict[str, AxisComm]:
    """The linear layers whose weight tensor parallelism cut along the input features (row-parallel:
    each rank sees a share of every input row), each with the tp group that holds the rest of the row."""
    if layout is None or layout.tp.size == 1:
        return {}
    out = {}
    for name, module in model.named_modules():
        spec = layout.specs.get(f"{name}.weight") if isinstance(module, nn.Linear) else None
        if spec is not None and spec.dim == 1 and spec.parts > 1:
            if spec.axis != "tp":
                raise ValueError(f"int8 compression: {name}'s input features are cut over {spec.axis}; it "
                                 f"agrees row scales over tp only")
            out[name] = layout.tp
    return out


def compressed_linears(blocks: nn.Module) -> list[str]:
    """The linear layers of ``blocks`` (names in it) whose inputs int8 compression keeps: all but the
    MoE routers. A router's logits are computed in fp32 by its block from ``router.weight`` (models/
    moe.py), never by calling the module, so a wrapper around it would be bypassed; and its input is
    the block's, which the router keeps exactly all the same (the reference and the planner say so too)."""
    routers = {id(m.router) for m in blocks.modules() if isinstance(m, MoEFeedForward)}
    return [n for n, m in blocks.named_modules() if isinstance(m, nn.Linear) and id(m) not in routers]


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def apply_activation_memory(model: nn.Module, plan: "ActivationPlan", layout=None) -> ActivationMemory:
    """Apply ``plan`` to ``model`` (after tensor parallelism: ``layout`` is its TensorLayout, or None)."""
    compressed = 0
    if plan.compression == "int8":
        blocks = block_list(model, plan)
        root = name_in(model, blocks)
        linears = [f"{root}.{n}" for n in compressed_linears(blocks)]
        if not plan.fused_loss:
            linears.append(head_module(model, plan, "compression='int8'"))
        compressed = compress_linear_inputs(model, linears, rows_split_over(model, layout))
    if plan.policy == "selective":
        blocks = block_list(model, plan)
        for block in blocks:
            missing = (["feed_forward"] if not _has_submodule(block, "feed_forward") else
                       [part for part in selective_parts(block, plan.selective_attention)
                        if not _has_submodule(block, part)])
            if missing:  # the parts are a Llama block's, by name: a block of another shape is refused
                raise ValueError(f"ActivationPlan(policy='selective') recomputes the parts of bigtrain's Llama "
                                 f"block by name; a {type(block).__name__} has no {', '.join(missing)}: use "
                                 f"policy='full' or policy='every'")
        apply_selective_recomputation(blocks, plan.selective_attention)
        checkpointed = []
    elif plan.policy == "none":  # a model of any shape (no blocks asked for)
        checkpointed = []
    else:
        checkpointed = apply_activation_checkpointing(block_list(model, plan), plan.policy, plan.every)
    head = None
    if plan.fused_loss:
        vocab = layout.vocab if layout is not None else None
        head = fuse_head_into_loss(model, plan.fused_loss_chunk, layout.tp if vocab is not None else None, vocab,
                                   name=head_module(model, plan, "fused_loss=True"))
    offloader = (ActivationOffloader(offloaded_modules(model, plan.blocks), plan.offload_min_bytes)
                 if plan.offload else None)
    return ActivationMemory(checkpointed, plan.policy == "selective", offloader, head, compressed)
