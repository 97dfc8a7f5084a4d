"""Weights tied between modules (the input embedding and the output head), under every layout.

A tied weight is one parameter registered under two names (``tok_embeddings.weight`` and
``output.weight``). Its *canonical* name is the first, the one ``named_parameters()`` keeps: the
model initializes it under that name and checkpoints store it under that name, once.

On one rank the tie is kept as it is: one tensor, one gradient (the sum of both uses), one optimizer
state. Pipeline stages split it: the first stage holds the embedding, the last the head, so each of
those two ranks holds a copy (Megatron's "embedding group"). The copies start equal (both are
initialized, or loaded, from the canonical name), and after backward their gradients are summed
over the two ranks, so both take the same update and stay equal. The gradient norm counts the
weight once, on the rank holding the canonical name.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm


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


class GradientEngine(Protocol):
    def grad_piece(self, name: str) -> tuple[torch.Tensor, int]: ...


class TiedCopies:
    """This rank's copies of weights tied to a copy on the other end of the pipeline.

    ``names``: this rank's parameter names that have a twin on the other end rank (the canonical
    name on the first stage, the alias on the last); ``canonical``: alias -> canonical name for the
    whole model; ``comm``: the two end ranks (the mesh's ``pp_ends``).
    """

    def __init__(self, names: list[str], canonical: dict[str, str], comm: AxisComm):
        # Both ends must walk their copies in the same order: sort by the name they share.
        self.names = sorted(names, key=lambda n: canonical.get(n, n))
        self.canonical, self.comm = canonical, comm

    @classmethod
    def of(cls, model: nn.Module, canonical: dict[str, str], ends: AxisComm) -> "TiedCopies":
        """The copies ``model`` (this rank's part) holds of the ties ``canonical`` describes."""
        registered = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names = []
        for alias, name in canonical.items():
            held = [n for n in (name, alias) if n in registered]
            if len(held) == 1:  # both held: one parameter here, tied as in the plain model
                names += held
        if names and ends.size == 1:
            raise ValueError(f"weights tied across pipeline ranks ({', '.join(names)}) must sit on the first and "
                             f"last stage; this rank is neither")
        return cls(names, canonical, ends)

    def canonical_name(self, name: str) -> str:
        return self.canonical.get(name, name)

    @property
    def aliases(self) -> set[str]:
        """Copies held under an alias: the other end holds the canonical name, counts the weight in the
        gradient norm and saves it in checkpoints."""
        return {n for n in self.names if n in self.canonical}

    def check_layout(self, engine: GradientEngine) -> None:
        """Both ends must hold the same part of each tied gradient (same tensor-parallel shard, same
        ZeRO range), or summing them would silently add unrelated numbers: fail at build time (each
        end names the part it holds). A collective over the two ends."""
        if self.comm.size == 1:
            return
        pieces = [(self.canonical_name(n), engine.grad_piece(n)) for n in self.names]
        described = ";".join(f"{c}:{start}+{piece.numel()}" for c, (piece, start) in pieces)
        device = pieces[0][1][0].device if pieces else torch.device("cpu")  # the gradients' (NCCL: not the CPU)
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
            piece, _ = engine.grad_piece(name)
            if piece.numel():  # the layout check made both ends agree on empty pieces
                self.comm.all_reduce(piece, tag="tied_grads")

    def to_canonical(self, tensors: dict[str, object]) -> dict[str, object]:
        """A stage's state by name without the aliases: the first stage saves the weight once."""
        return {n: t for n, t in tensors.items() if n not in self.aliases}

    def with_aliases(self, tensors: dict[str, object]) -> dict[str, object]:
        """Saved state by canonical name, plus the entries this rank's aliases load from."""
        out = dict(tensors)
        for name in self.aliases:
            if self.canonical[name] in tensors:
                out[name] = tensors[self.canonical[name]]
        return out
