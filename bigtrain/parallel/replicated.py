"""The plain layout behind the engine interface: full fp32 replicas, our bucketed data parallel,
and the configured optimizer on whole parameters (so it may need their shapes: it need not be
elementwise). The trainer drives it exactly like a :class:`ZeroEngine`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.memory.accounting import model_state_bytes
from bigtrain.optim import build_optimizer, get_optimizer
from bigtrain.optim.by_name import load_optimizer_state_by_name, optimizer_state_by_name
from bigtrain.optim.clip import clip_, global_norm, square_sums
from bigtrain.optim.loading import declared_dtypes, load_state
from bigtrain.parallel.data import DataParallel
from bigtrain.parallel.local_sgd import ParameterAveraging
from bigtrain.parallel.placement import NORM_AXIS, Placements
from bigtrain.parallel.chunks import WEIGHT, Piece

if TYPE_CHECKING:  # a section of the config, read here; the config module is the caller's
    from bigtrain.config import OptimConfig


class ReplicatedEngine:
    """``placements``: where each parameter lives (default: replicated over ``comm`` and nothing
    else); it names the group reducing each gradient and the parts this rank counts in the norm."""

    def __init__(self, model: nn.Module, comm: AxisComm, optim: OptimConfig, bucket_mb: float,
                 placements: Placements | None = None, local_sgd_every: int = 1):
        self.model, self.comm = model, comm
        self.placements = placements if placements is not None else Placements.data_parallel(model, comm)
        self._named = dict(model.named_parameters())
        local = local_sgd_every > 1
        # Local SGD: each replica clips by its own gradients' norm (validation keeps it to pure dp).
        # Frozen parameters (``requires_grad = False``) have no gradient: not in the norm, not updated.
        self._in_norm = [p for n, p in self._named.items()
                         if p.requires_grad and (local or self.placements.counted_in_norm(n))]
        self._norm_comm = None if local else self.placements.comm(NORM_AXIS)
        self.dp = DataParallel(model, comm, bucket_mb, self.placements, reduce=not local)
        self.averaging = ParameterAveraging(self.dp.params, comm, local_sgd_every) if local else None
        self.optim_spec = get_optimizer(optim.name)
        self.block = self.optim_spec.alignment(optim)
        self.optimizer = build_optimizer(model, optim, self.optim_spec)
        self._tell_optimizer_the_cuts()
        self.scaler = None

    def _tell_optimizer_the_cuts(self) -> None:
        """Tensor parallelism cuts some parameters: a shape-needing optimizer learns where each part
        sits and which groups hold the rest; a blocked one is refused a cut that splits a block."""
        from bigtrain.optim.pieces import ParamPiece
        from bigtrain.parallel.blocks import block_cuts

        cut = {n: p for n, p in self._named.items() if self.placements[n].shards}
        if self.optim_spec.needs == "blocks":
            for n, p in cut.items():
                block_cuts(n, self.placements[n], tuple(p.shape), self.block)
        elif self.optim_spec.needs == "shapes" and cut:
            self.optimizer.attach_pieces({
                id(p): ParamPiece(tuple(p.shape), cuts=self.placements[n].shards,
                                  comms=tuple(self.placements.comm(c.axis) for c in self.placements[n].shards))
                for n, p in cut.items()})
        elif self.optim_spec.needs == "whole" and cut:
            raise ValueError(f"optim.name = '{self.optim_spec.name}' needs whole parameters (needs = 'whole'), "
                             f"but tensor or expert parallelism cuts {next(iter(cut))}; use parallel.tp = 1")

    @property
    def params(self) -> list[nn.Parameter]:
        return self.dp.params

    def no_sync(self):
        return self.dp.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_grad_sync(self) -> None:
        self.dp.finish_grad_sync()

    def grad_piece(self, name: str) -> tuple[torch.Tensor, int]:
        """The gradient of parameter ``name`` (all of it, reduced once gradients are synchronized) and
        the index of its first element in the parameter (0): as :meth:`ZeroEngine.grad_piece`."""
        return self._named[name].grad, 0

    def editable_grad_piece(self, name: str) -> contextlib.AbstractContextManager[tuple[torch.Tensor, int]]:
        """:meth:`grad_piece` to change in place (always in memory here): as :meth:`ZeroEngine.editable_grad_piece`."""
        return contextlib.nullcontext(self.grad_piece(name))

    def step(self, lr: float, max_norm: float, skip: torch.Tensor | None = None) -> tuple[float, bool]:
        """Clip and update; returns (grad norm, skipped). A non-finite norm, or a non-zero ``skip``
        (a flag every rank shares, e.g. a non-finite loss), skips the update on every rank."""
        parts = self.norm_parts()
        if skip is not None:
            parts[1] += skip
        norm, found_inf = global_norm(parts, self._norm_comm)
        self.update(lr, max_norm, norm, found_inf)
        return norm, found_inf

    # The three parts of ``step``, for a caller that reduces the norm asynchronously (2BW's deferred
    # update, bigtrain/parallel/pipeline/deferred.py): local sums, the collective, clip and update.
    def norm_parts(self) -> torch.Tensor:
        """[this rank's sum of squares of the gradients it counts in the global norm, overflow flag]."""
        return square_sums((p.grad for p in self._in_norm), self.dp.params[0].grad.device)

    def post_norm(self, parts: torch.Tensor):
        """Start summing ``parts`` over every rank; the work handle (None: nothing to sum)."""
        if self._norm_comm is None:
            return None
        return self._norm_comm.all_reduce(parts, async_op=True, tag="grad_norm")

    def update(self, lr: float, max_norm: float, norm: float, found_inf: bool) -> None:
        """Clip the current ``.grad`` by the global ``norm`` and step, unless ``found_inf``."""
        if not found_inf:  # summed over every rank: every replica sees the same flag (local SGD: its own)
            clip_([p.grad for p in self.dp.params], norm, max_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        if self.averaging is not None:  # also after a skipped step: every replica joins each average
            self.averaging.after_step()

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self.model, self.optimizer)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Reduced gradients by name, before clipping (call between finish_grad_sync and step)."""
        return {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return self.full_weights(), optimizer_state_by_name(self.model, self.optimizer, self.optim_spec)

    def load_full_state(self, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        with torch.no_grad():
            for n, p in self._trained():
                p.copy_(weights[n])
        load_optimizer_state_by_name(self.model, self.optimizer, self.optim_spec, optim_state)

    def _trained(self):
        """(name, parameter) of what trains: a frozen parameter (``requires_grad = False``) is, as
        under ZeRO, neither saved nor loaded (its value is init_fn's, every run), and has no
        gradient group (saving it failed on that lookup)."""
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    # -- sharded checkpoints ------------------------------------------------------------------------
    def checkpoint_pieces(self):
        """One batch per parameter: all of it (a replica over ``comm``), with its optimizer state."""

        spec = self.optim_spec
        for name, p in self._trained():
            state = self.optimizer.state.get(p)
            tensors, scalars, blocks = {WEIGHT: p.detach().reshape(-1)}, {}, {}
            if state:
                spec.check_state(state, f"the optimizer's state of {name}")
                tensors.update({k: state[k].detach().reshape(-1) for k in spec.element_state})
                scalars = {k: state[k] for k in spec.tensor_state}
                blocks = {k: state[k].detach().reshape(-1) for k in spec.block_state}
            replicas = self.dp.grad_comm(p)  # they hold the same range: each writes a part of it
            yield [Piece(name, tuple(p.shape), 0, p.numel(), tensors, scalars, replicas.size, replicas.rank,
                         blocks, self.block)]

    def checkpoint_load_batches(self, with_state: bool):
        """One batch per parameter: the parameter itself and fresh (zero) state tensors to fill."""

        spec, states = self.optim_spec, {}
        dtype = declared_dtypes(spec)
        if with_state:  # replaced below: do not hold the old and the loaded state at once
            self.optimizer.state.clear()
        for name, p in self._trained():
            fresh = {k: torch.zeros(p.shape, dtype=dtype[k], device=p.device) for k in spec.element_state} \
                if with_state else {}
            blocks = {k: torch.zeros(-(-p.numel() // self.block), dtype=dtype[k], device=p.device)
                      for k in spec.block_state} if with_state else {}
            piece = Piece(name, tuple(p.shape), 0, p.numel(),
                          {WEIGHT: p.detach().view(-1), **{k: v.view(-1) for k, v in fresh.items()}},
                          blocks=blocks, block=self.block)
            fresh.update(blocks)
            yield [piece]
            if with_state:
                states[p] = {**{k: piece.scalars[k].clone() for k in spec.tensor_state}, **fresh}
        if states:
            load_state(self.optimizer, states, spec)
