"""Weights tied between modules (the input embedding and the output head), under every layout.

A tied weight is one parameter registered under two names (``tok_embeddings.weight`` and
``output.weight``). Its *canonical* name is the first, the one ``named_parameters()`` keeps: the
model initializes it under that name and checkpoints store it under that name, once.

On one rank the tie is kept as it is: one tensor, one gradient (the sum of both uses), one optimizer
state. Pipeline stages split it: the first stage holds the embedding, the last the head, so each of
those two ranks holds a copy (Megatron's "embedding group"). The placement record says so
(:func:`record_tied_copies`): both copies are replicas over the mesh's ``pp_ends`` axis with
gradients partial there, and the head's copy names the canonical weight it copies. From that
record the copies start equal (both are initialized, or loaded, from the canonical name), their
gradients are summed over the two ranks after backward (:class:`TiedCopies`), so both take the
same update and stay equal; the gradient norm counts the first replica only (the canonical name)
and checkpoints write it once.
"""

from __future__ import annotations

import zlib
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.parallel.placement import Placements

ENDS_AXIS = "pp_ends"  # the first and last pipeline rank: where the two copies of a tied weight live


def shared_parameter_names(model: nn.Module) -> dict[str, str]:
    """{alias: canonical name} for every parameter registered under more than one name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def to_empty_keeping_ties(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device=device)`` with every tie kept. ``nn.Module.to_empty`` gives each
    registration of a meta parameter a tensor of its own, so a tied weight would silently become
    two weights trained apart (a tied Hugging Face head at ZeRO 0 did, found by the layout fuzzer,
    seed 20261312 sample 94): each alias is pointed at its canonical parameter again."""
    aliases = shared_parameter_names(model)
    model.to_empty(device=device)
    for alias, canonical in aliases.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(canonical))


def record_tied_copies(model: nn.Module, canonical: dict[str, str], placements: Placements) -> None:
    """Mark in ``placements`` the weights of ``model`` (this rank's part) whose tie ``canonical``
    ({alias: canonical name}) the pipeline split: held here under one of the two names only, the
    other end of the pipeline holding the other copy."""
    registered = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    held_once = []
    for alias, name in canonical.items():
        held = [n for n in (name, alias) if n in registered]
        if len(held) == 1:  # both held: one parameter here, tied as in the plain model
            held_once += held
    if held_once and placements.comm(ENDS_AXIS).size == 1:
        raise ValueError(f"weights tied across pipeline ranks ({', '.join(held_once)}) must sit on the first and "
                         f"last stage; this rank is neither")
    for name in held_once:
        placements.update(name, placements[name].with_copy(ENDS_AXIS, canonical.get(name)))


class GradientEngine(Protocol):
    def grad_piece(self, name: str) -> tuple[torch.Tensor, int]: ...

    def editable_grad_piece(self, name: str) -> AbstractContextManager[tuple[torch.Tensor, int]]: ...


class TiedCopies:
    """This rank's copies of weights tied to a copy on the other end of the pipeline.

    ``names``: this rank's parameter names that have a twin on the other end rank (the canonical
    name on the first stage, the alias on the last); ``canonical``: alias -> canonical name;
    ``comm``: the two end ranks (the mesh's ``pp_ends``).
    """

    def __init__(self, names: list[str], canonical: dict[str, str], comm: AxisComm):
        # Both ends must walk their copies in the same order: sort by the name they share.
        self.names = sorted(names, key=lambda n: canonical.get(n, n))
        self.canonical, self.comm = canonical, comm

    @classmethod
    def from_placements(cls, placements: Placements) -> "TiedCopies":
        """The copies the placement record marks (gradients partial over ``pp_ends``)."""
        return cls(placements.names_partial_over(ENDS_AXIS), placements.copies(), placements.comm(ENDS_AXIS))

    def canonical_name(self, name: str) -> str:
        return self.canonical.get(name, name)

    def check_layout(self, engine: GradientEngine) -> None:
        """Both ends must hold the same part of each tied gradient (same tensor-parallel shard, same
        ZeRO range), or summing them would silently add unrelated numbers: fail at build time (each
        end names the part it holds). A collective over the two ends."""
        if self.comm.size == 1:
            return
        pieces = []
        for n in self.names:
            with engine.editable_grad_piece(n) as (piece, start):  # in memory, if kept in a file
                pieces.append((self.canonical_name(n), start, piece.numel(), piece.device))
        described = ";".join(f"{c}:{start}+{numel}" for c, start, numel, _ in pieces)
        # The engine's device (NCCL: not the CPU; offload keeps gradients on the host), else the gradients'.
        device = getattr(engine, "device", None) or (pieces[0][3] if pieces else torch.device("cpu"))
        mine = torch.tensor([len(pieces), zlib.crc32(described.encode())], dtype=torch.int64, device=device)
        both = torch.empty(2 * self.comm.size, dtype=torch.int64, device=device)
        self.comm.all_gather(both, mine, tag="layout_check")
        first, last = both.view(self.comm.size, 2).tolist()
        if first != last:
            raise RuntimeError(f"tied weights: the first and last pipeline stages hold different parts of the tied "
                               f"gradients (this rank: {described or 'none'}); each copy must be alone in its "
                               f"ZeRO unit and sharded alike over tp")

    def sum_grads(self, engine: GradientEngine) -> None:
        """After the data-parallel reduction: add the other end's gradient into each copy's."""
        if self.comm.size == 1:
            return
        for name in self.names:
            with engine.editable_grad_piece(name) as (piece, _):  # ZeRO-Infinity: read from its file
                if piece.numel():  # the layout check made both ends agree on empty pieces
                    device = getattr(engine, "device", piece.device)
                    summed = piece if piece.device == device else piece.to(device)  # a host gradient (offload)
                    self.comm.all_reduce(summed, tag="tied_grads")
                    if summed is not piece:
                        piece.copy_(summed)
