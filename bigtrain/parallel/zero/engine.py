"""ZeRO stages 0-3 with mixed precision over the data-parallel axis.

Memory per rank with P parameters, N ranks, bf16/fp16 compute and AdamW (fp32 master 4P and
moments 8P; another optimizer's state is its declared ``bytes_per_param`` instead of 8, see
:mod:`bigtrain.optim.spec`) (bytes):

    stage 0: params 2P  grads 4P    master+moments 12P     = 18P
    stage 1: params 2P  grads 4P    12P/N                  = 6P + 12P/N
    stage 2: params 2P  grads 4P/N  12P/N                  = 2P + 16P/N
    stage 3: params 2P/N grads 4P/N 12P/N                  = 18P/N

(in fp32 the master weights are the parameters themselves: 16P, 8P + 8P/N, 4P + 12P/N, 16P/N).
An elementwise optimizer runs on (at most two) flat pieces of each unit's master shard; one that
needs blocks (8-bit AdamW) or shapes (Adafactor) gets one piece per parameter in the shard, the
unit laid out so cuts fall on block boundaries, and a shape-needing one is told where each piece
sits in its parameter (:mod:`bigtrain.optim.pieces`).
Gradients are kept in fp32 whatever the compute dtype, 2 bytes per parameter more than the ZeRO
paper's 16P, as Megatron's ``main_grad`` and DeepSpeed's bf16 optimizer do: micro-batches then
accumulate without bf16 rounding (a bf16 sum of 4 micro-batches is ~1e-3 off), and a reduction in
fp32 reaches the optimizer unrounded. In stages 0-1 a compute-dtype gradient is added into the fp32
buffer as it arrives and then dropped (``param.grad`` stays None: clear with :meth:`zero_grad`);
in fp32 ``param.grad`` is a view of the buffer, so autograd accumulates in place. With offload on a
GPU no fp32 gradient stays on the device: every unit's reduced gradient of every micro-batch goes
through a few device buckets to its fp32 accumulator in host memory (:mod:`.grad_stream`).
Without offload, where autograd's gradient is a tensor of its own (not fp32 compute at stages 0-1)
and below stage 3, the fp32 buffers hold memory only from a step's first gradient to its update
(:mod:`.lazy_grads`): the forward of a one-micro-batch step runs without them.

Each unit (a transformer block, plus a root unit for the rest) is a :class:`FlatUnit`. Gradients
are reduced per unit (:mod:`.grad_sync`) as soon as the unit's last gradient arrives in backward, so communication
overlaps the rest of backward: all-reduce in stage 0, reduce-scatter in stages 1-3, in the reduce
dtype (a compute-dtype copy of the fp32 gradient when that is narrower). Stages 0 and 1 keep full
gradients and skip reduction on non-final micro-batches; stages 2 and 3 keep only the gradient
shard, so they reduce on every micro-batch (as DeepSpeed and FSDP do). Stage 3 also gathers parameters around each
unit's forward and backward (:mod:`bigtrain.parallel.zero.gather`).

The loss must be normalized by the global token count: gradients are summed over ranks.
"""

from __future__ import annotations

import tempfile
import zlib
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from bigtrain.distributed.comm import AxisComm
from bigtrain.optim import OptimizerSpec, decay_groups, get_optimizer
from bigtrain.optim.clip import clip_, global_norm, square_sums
from bigtrain.parallel.blocks import block_cuts
from bigtrain.parallel.grad_hooks import on_grad_ready
from bigtrain.parallel.placement import NORM_AXIS, Placements
from bigtrain.parallel.zero.allocate import allocate_units
from bigtrain.parallel.zero.flat import FlatUnit
from bigtrain.parallel.zero.gather import ParameterGatherer
from bigtrain.parallel.zero.grad_sync import GradSync
from bigtrain.parallel.zero.lazy_grads import gradient_buffers
from bigtrain.parallel.zero.offload import OffloadPlan, UnitOffload
from bigtrain.core.blocks import default_unit_modules
from bigtrain.parallel.zero.tiers import held_bytes, state_bytes
from bigtrain.parallel.zero.units import build_units, replace_parameters
from bigtrain.precision import DynamicLossScaler, Precision

if TYPE_CHECKING:  # a section of the config, read here; the config module is the caller's
    from bigtrain.config import OptimConfig

InitFn = Callable[[str, tuple], torch.Tensor]  # (name, shape) -> full fp32 value


class ZeroEngine(GradSync):
    """Owns a model's parameters, gradients and optimizer state, partitioned as ``stage`` says."""

    def __init__(self, model: nn.Module, comm: AxisComm, stage: int, precision: Precision, optim: OptimConfig,
                 init_fn: InitFn, device: torch.device | str = "cpu", unit_modules: list[nn.Module] | None = None,
                 reshard_after_forward: bool = True, prefetch: bool = True,
                 scaler: DynamicLossScaler | None = None, placements: Placements | None = None,
                 offload: "OffloadPlan | None" = None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero = {stage}: must be 0, 1, 2 or 3")
        self.optim_spec = _servable(get_optimizer(optim.name), stage)
        self.block = self.optim_spec.alignment(optim)  # every cut of a parameter is a multiple of it
        self.model, self.comm, self.stage, self.precision = model, comm, stage, precision
        self.device, self.scaler = torch.device(device), scaler
        # Where each parameter lives (default: replicated over ``comm``): which group reduces its
        # gradient and cuts its unit, which parts this rank counts in the norm. ZeRO records its cut.
        self.placements = placements if placements is not None else Placements.data_parallel(model, comm)
        if self.optim_spec.needs == "blocks":  # before any state exists: a cut must not split a block
            _check_block_cuts(model, self.placements, self.block)
        if stage >= 1:
            for name in list(self.placements):
                self.placements.update(name, self.placements[name].sharded_flat())
        modules = default_unit_modules(model) if unit_modules is None else unit_modules
        self.units, self.unit_modules = build_units(model, modules, self.placements.grad_comm, sharded=stage >= 1,
                                                    align=self.block)
        for unit in self.units:  # HSDP: the group whose ranks hold the same shard, reduced there once more
            unit.replicas = _replica_comm(unit, self.placements)
        self._check_same_layout()
        self.offload = None
        if offload is not None and offload.active:
            directory = offload.nvme_dir or tempfile.mkdtemp(prefix="bigtrain-offload-")
            self.offload = UnitOffload(self, offload, directory)
        # Offload on a GPU: each unit's gradient leaves the device as the backward produces it, into
        # its fp32 accumulator on the host (every micro-batch, at any stage: :mod:`.grad_stream`).
        self._host_grads = self.offload.host_grads if self.offload is not None else None
        # Autograd accumulates straight into the fp32 gradient buffer only when it computes in fp32.
        self._grads_in_place = stage <= 1 and not precision.mixed and self._host_grads is None
        self._allocate(init_fn)
        # fp32 gradient buffers freed between an update and the next gradient, where that applies
        self._lazy = gradient_buffers(self.units, stage, self._grads_in_place, self.offload is not None)
        self.optimizer = self._build_optimizer(optim)
        if self.offload is not None:  # up front: the first step should cost what the others do
            self.offload.allocate_state()
        self._sync = True
        self._pending: list[tuple[FlatUnit, object, torch.Tensor]] = []
        self._remaining = {id(u): len(u.params) for u in self.units}
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._grad_home = {id(p): view for u in self.units for p, view in zip(u.params, getattr(u, "grad_views", ()))}
        on_grad_ready(self._unit_of_params(), self._on_grad_ready)
        self.gatherer = ParameterGatherer(self, reshard_after_forward, prefetch) if stage == 3 else None

    def _groups(self) -> list[tuple[AxisComm, list[FlatUnit]]]:
        """The units by the group that reduces (and shards) them, groups in order of first unit."""
        groups: dict[int, tuple[AxisComm, list[FlatUnit]]] = {}
        for unit in self.units:
            groups.setdefault(id(unit.comm), (unit.comm, []))[1].append(unit)
        return list(groups.values())

    def _check_same_layout(self) -> None:
        """Fail loudly, naming the ranks, if the ranks of a group built different units: a mismatch
        would otherwise surface as a collective that never completes."""
        for comm, units in self._groups():
            if comm.size == 1:
                continue
            names = ";".join(f"{s.name}:{s.shape}" for u in units for s in u.slots)
            mine = torch.tensor([len(units), sum(u.numel for u in units), zlib.crc32(names.encode())],
                                dtype=torch.int64, device=self.device)  # NCCL: device tensors only
            everyone = torch.empty(comm.size * 3, dtype=torch.int64, device=self.device)
            comm.all_gather(everyone, mine, tag="layout_check")
            rows = everyone.view(comm.size, 3).tolist()
            differ = [r for r, row in enumerate(rows) if row != rows[0]]
            if differ:
                detail = ", ".join(f"rank {r}: {row[1]} parameters in {row[0]} units" for r, row in enumerate(rows))
                raise RuntimeError(f"ZeRO: ranks {differ} of the {comm.axis} group built a different model than "
                                   f"its rank 0 ({detail}); every rank must build the same model")

    # -- allocation -----------------------------------------------------------------------------
    @property
    def _separate_master(self) -> bool:
        """fp32 masters apart from the compute weights: in mixed precision, with the delayed update
        (its worker updates the masters while the forward reads the compute weights), and on the
        host apart from the device (offload on a GPU), unless the parameter shards are there too."""
        if self.precision.mixed or (self.offload is not None and self.offload.delayed is not None):
            return True
        return self.offload is not None and self.offload.link.separate and not self.offload.params_on_host

    @property
    def host_device(self) -> torch.device:
        """Where the masters and the optimizer's state live: the host with offload, else the device."""
        return self.offload.link.host if self.offload is not None and self.offload.link.separate else self.device

    def _allocate(self, init_fn: InitFn) -> None:
        allocate_units(self, init_fn)
        self._materialize_frozen(init_fn)

    def _materialize_frozen(self, init_fn: InitFn) -> None:
        """Parameters with ``requires_grad = False`` are in no unit (nothing to reduce, shard or
        update): each rank holds them whole, in the compute dtype, valued by ``init_fn`` as every
        other parameter is. Left alone they stayed on the meta device (a model built there failed
        in its forward, far from here) or kept the values of the model built on the CPU, which the
        trainable weights, taken from ``init_fn``, no longer match. Swapped wherever it is registered:
        a frozen tied weight (a GPT's embedding and head) replaced under one name only left the head
        its constructor's value, silently."""
        compute = self.precision.compute
        frozen = {id(p): nn.Parameter(init_fn(name, tuple(p.shape)).to(self.device, compute), requires_grad=False)
                  for name, p in self.model.named_parameters() if not p.requires_grad}
        replace_parameters(self.model, frozen)

    def _build_optimizer(self, cfg: OptimConfig) -> torch.optim.Optimizer:
        """The optimizer over at most two flat pieces of each unit's master shard (decayed / not),
        or, for an optimizer that is not elementwise, over one piece per parameter of the unit: the
        range of it in this rank's shard, empty where the shard holds none of it (so every rank of
        the group holds the same list of parameters, and sums over a parameter's pieces line up)."""
        decay, no_decay, where = [], [], {}
        for unit in self.units:
            for is_decay, (_, _, view) in zip(unit.piece_decay, unit.pieces):
                (decay if is_decay else no_decay).append(view)
            if self.optim_spec.needs == "shapes":
                where.update(self._param_pieces(unit))
        optimizer = self.optim_spec.build(decay_groups(decay, no_decay, cfg), cfg)
        if where:
            optimizer.attach_pieces(where)
        return optimizer

    def _param_pieces(self, unit: FlatUnit) -> dict:
        """{id(piece view): ParamPiece} for each parameter of the unit: its range of the (tensor-
        parallel) local parameter held in this rank's shard, the cuts, the groups holding the rest."""
        from bigtrain.optim.pieces import ParamPiece

        out = {}
        for slot, (a, b, view) in zip(unit.piece_slots, unit.pieces):
            cuts = self.placements[slot.name].shards
            comms = tuple(self.placements.comm(c.axis) for c in cuts) + ((unit.comm,) if unit.shards > 1 else ())
            start = min(max(unit.shard_start + a - slot.offset, 0), slot.numel)
            out[id(view)] = ParamPiece(slot.shape, start, b - a, cuts, comms)
        return out

    def _unit_of_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    @property
    def params(self) -> list[nn.Parameter]:
        return self._unit_of_params()

    # -- the step --------------------------------------------------------------------------------
    def step(self, lr: float, max_norm: float, skip: torch.Tensor | None = None) -> tuple[float, bool]:
        """Unscale, check for overflow, clip and update; returns (grad norm, skipped). A non-zero
        ``skip`` (a flag every rank shares, e.g. a non-finite loss) skips like an overflow."""
        self.drop_gathered()
        if self.offload is not None:
            self.offload.before_step()  # a delayed update: the last step's, published now
        if self.offload is not None and self.offload.grads_in_files:
            return self.offload.step_streaming(lr, max_norm, skip)
        self._lazy.ensure_all()  # a step with no backward since the last: zeros, as before
        grads = [u.grad_shard for u in self.units]  # fp32 (on the host with offload): unscaled and clipped in place
        if self.scaler is not None:
            torch._foreach_div_(grads, self.scaler.scale)
        counted = self.placements.counted_in_norm
        where = grads[0].device if grads else self.device
        parts = square_sums((grad[a:b] for unit, grad in zip(self.units, grads)
                             for slot, a, b in unit.shard_slot_ranges() if counted(slot.name)), where)
        parts = parts.to(self.device)  # the collective agreeing on the norm takes device tensors
        norm, found_inf = self.agree_on_norm(parts, skip)
        if found_inf:
            return norm, True
        clip_(grads, norm, max_norm)
        if self.offload is not None:
            self.offload.step(grads, lr)  # unit by unit, each unit's weights published after its step
            return norm, False
        for unit, grad in zip(self.units, grads):
            for a, b, view in unit.pieces:
                view.grad = grad[a:b]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._publish_weights()
        return norm, False

    def agree_on_norm(self, parts: torch.Tensor, skip: torch.Tensor | None) -> tuple[float, bool]:
        """(global norm, skip) from this rank's [sum of squares, overflow] ``parts``: summed over every
        rank, so all agree on the norm and on skipping (an overflow, or a non-zero ``skip`` flag);
        the loss scaler, if any, learns of the overflow."""
        if skip is not None:
            parts[1] += skip
        norm, found_inf = global_norm(parts, self.placements.comm(NORM_AXIS))
        if self.scaler is not None:
            self.scaler.update(found_inf)
        return norm, found_inf

    def finish_update(self) -> None:
        """A delayed update still running (``offload.delayed_update``): finished, and its weights
        published (the end of training: the model then holds every update)."""
        if self.offload is not None:
            self.offload.before_step()

    def refresh_compute_weights(self) -> None:
        """Make the compute weights equal the (just loaded) masters on every rank."""
        self.drop_gathered()
        self._publish_weights()
        if self.offload is not None and self.offload.delayed is not None:
            self.offload.delayed.unpublished = False

    def drop_gathered(self) -> None:
        """ZeRO-3: a unit still gathered now (a prefetch that the model or a pipeline schedule
        never used) holds the weights of before the update; the next forward must gather anew."""
        if self.gatherer is not None:
            self.gatherer.free_all()

    def _publish_weights(self) -> None:
        """Copy updated masters into the compute weights and, below stage 3, gather them everywhere."""
        for unit in self.units:
            self.publish_unit(unit)

    def publish_unit(self, unit: FlatUnit, value: torch.Tensor | None = None) -> None:
        """The unit's compute weights from its masters (or from ``value``, an fp32 shard)."""
        value = unit.master if value is None else value
        link = self.offload.link if self.offload is not None else None
        if value is not unit.shard_param:
            if link is not None and link.separate and not self.offload.params_on_host:
                # Host -> device on the copy stream; the compute stream waits for it (the host does
                # not: it goes on with the next unit's step while the weights travel).
                link.to_device(value, unit.shard_param)
                link.wait()
            else:
                unit.shard_param.copy_(value)
        if self.stage in (1, 2) and unit.shards > 1:
            # Synchronous: on NCCL the current stream waits for the gather before the clone is
            # freed and before the next forward reads ``unit.full``.
            unit.comm.all_gather(unit.full, unit.shard_param.clone(), tag="params")

    def zero_grad(self) -> None:
        for unit in self.units:
            if self._host_grads is not None and not self.offload.grads_in_files:
                self._host_grads.reset(unit)  # the next step's first fold overwrites it: nothing to zero
                for p in unit.params:
                    p.grad = None
            elif self._lazy.active:  # the update has consumed it: no bytes until the next gradient
                self._lazy.release(unit)
                for p in unit.params:
                    p.grad = None
            elif self.stage <= 1:
                unit.full_grad.zero_()
                for p, view in zip(unit.params, unit.grad_views):
                    p.grad = view if self._grads_in_place else None
            else:
                if self.offload is not None and self.offload.grads_in_files:
                    self.offload.zero_grad(unit)
                else:
                    unit.grad_shard.zero_()
                for p in unit.params:
                    p.grad = None
            if self.offload is None:  # the offloaded step clears them itself (a delayed one is still running)
                for _, _, view in unit.pieces:
                    view.grad = None

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        from bigtrain.parallel.zero.state import full_state

        return full_state(self)

    def full_weights(self) -> dict[str, torch.Tensor]:
        from bigtrain.parallel.zero.state import full_weights

        frozen = {n: p.detach().float().cpu().clone() for n, p in self.model.named_parameters() if not p.requires_grad}
        return {**full_weights(self), **frozen}  # every parameter, as the replicated engine's

    def full_grads(self) -> dict[str, torch.Tensor]:
        from bigtrain.parallel.zero.state import full_grads

        self._lazy.ensure_all()
        return full_grads(self)

    def load_full_state(self, weights: dict[str, torch.Tensor], optim_state: dict) -> None:
        from bigtrain.parallel.zero.state import load_full_state

        load_full_state(self, weights, optim_state)

    # -- accounting ---------------------------------------------------------------------------------
    def tier_bytes(self) -> dict[str, int]:
        """Bytes this rank holds on the device, in host memory and in NVMe files, from where each
        buffer lives (:mod:`bigtrain.parallel.zero.tiers`)."""
        return held_bytes(self)

    def state_bytes(self) -> dict[str, int]:
        """Measured bytes of parameters, gradients and optimizer state (with masters) on this rank,
        the same buffers as :meth:`tier_bytes` counts: on the device only when offload keeps a host
        apart from it (the host's are in :meth:`tier_bytes`), else all of them (their sum is the
        device's and the host's)."""
        return state_bytes(self)


def _check_block_cuts(model: nn.Module, placements: Placements, block: int) -> None:
    """A blocked optimizer's state is the single-process one only where every tensor- or expert-
    parallel cut falls on a block boundary (ZeRO aligns its own cuts): refuse, naming the parameter
    and ``optim.block_size``, a cut that would quantize a block in two parts on two ranks. (The
    replicated engine and the checkpoint's block grid check the same; without this the engine
    trained with other blocks than the reference's and failed only at its first checkpoint.)"""
    for name, p in model.named_parameters():
        if name in placements:
            block_cuts(name, placements[name], tuple(p.shape), block)


def _replica_comm(unit: FlatUnit, placements: Placements) -> AxisComm:
    """The replica group of every parameter of ``unit`` (they share one: units are cut per group)."""
    comms = {id(c): c for c in (placements.replica_comm(slot.name) for slot in unit.slots)}
    if len(comms) > 1:
        raise ValueError(f"ZeRO unit {unit.name}: its parameters are replicated over different groups")
    return next(iter(comms.values())) if comms else placements.comm("none")


def _servable(spec: OptimizerSpec, stage: int) -> OptimizerSpec:
    """``spec``, if the ZeRO engine can run it: anything but an optimizer that needs whole parameters
    (elementwise ones on flat pieces, blocked ones on aligned pieces, shape-needing ones on pieces
    they are told the place of)."""
    if spec.needs == "whole":
        raise ValueError(f"optim.name = '{spec.name}' needs each parameter's shape (needs = 'whole'), but the "
                         f"ZeRO engine (parallel.zero = {stage}) hands it pieces of parameters; use "
                         f"parallel.zero = 0 with precision.mode = 'fp32' (the replicated engine), or declare "
                         f"needs = 'shapes' and take pieces (bigtrain.optim.pieces)")
    return spec
