"""From a config and a mesh to this rank's part of the model, ready to train.

The order is the design's: build the plain model on the meta device; apply tensor / sequence
parallel plans (module structure, still meta); activation checkpointing; then materialize only
this rank's weights inside the gradient engine (full replicas, or ZeRO shards over the ranks that
hold replicas of each weight: dp, times sp under Ulysses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config import Config
from bigtrain.distributed.comm import AxisComm
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.activations import ActivationMemory, apply_activation_memory
from bigtrain.models.llama import build_model, init_value
from bigtrain.parallel.pipeline.partition import PipelineStage, StageGroup, stages_for_rank
from bigtrain.parallel.pipeline.schedules import Schedule, build_schedule
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.tensor.functional import local_chunk
from bigtrain.parallel.tensor.plan import TensorLayout, parallelize_llama
from bigtrain.parallel.tied import TiedCopies, shared_parameter_names
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.precision import DynamicLossScaler, Precision


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


@dataclass
class ParallelModel:
    model: nn.Module  # what this rank runs and its engine owns: the model, one pipeline stage, or a group
    engine: ReplicatedEngine | ZeroEngine
    layout: TensorLayout | None
    grad_comm: AxisComm  # the ranks holding replicas of every weight (dp, or dp x sp)
    sp: AxisComm
    pp: AxisComm
    checkpointed: list[int]
    stages: dict[int, PipelineStage] = field(default_factory=dict)
    schedule: Schedule | None = None
    tied: TiedCopies | None = None  # copies of tied weights whose twin is on another pipeline rank
    device: torch.device = torch.device("cpu")  # where this rank computes (and its collectives run)
    activations: ActivationMemory | None = None  # recomputation, offload, compression, fused head applied

    def finish_grad_sync(self) -> None:
        """Complete the gradient reduction (after the last micro-batch), tied copies included."""
        self.engine.finish_grad_sync()
        if self.tied is not None:
            self.tied.sum_grads(self.engine)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.activations is not None and self.activations.head is not None:
            return self.activations.head(logits, targets)  # fused: ``logits`` are the final norm's output
        parallel = self.layout.loss_sum(logits, targets) if self.layout is not None else None
        return parallel if parallel is not None else token_loss_sum(logits, targets)

    def sequence_chunk(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's part of the sequence (all of it without Ulysses) and its first position."""
        if self.sp.size == 1:
            return tokens, targets, 0
        start = self.sp.rank * tokens.shape[1] // self.sp.size
        return local_chunk(tokens, self.sp, 1), local_chunk(targets, self.sp, 1), start

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's summed loss over its tokens (its sequence chunk under Ulysses)."""
        tokens, targets, start = self.sequence_chunk(tokens, targets)
        return self.loss_sum(self.model(tokens, start_pos=start), targets)

    def gather_named(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors by parameter name (full over dp already) -> full tensors of the whole
        model, complete on the first rank of the pipeline (empty elsewhere); collective over tp and pp."""
        if self.layout is not None:
            tensors = self.layout.gather_full(tensors, self.device)
        if self.pp.size == 1:
            return tensors
        parts = self.pp.gather_objects(tensors)
        return {} if parts is None else {k: v for part in parts for k, v in part.items()}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 weights by name (see :meth:`gather_named`)."""
        return self.gather_named(self.engine.full_weights())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The whole model's reduced, unscaled, unclipped gradients by name (see :meth:`gather_named`)."""
        return self.gather_named(self.engine.full_grads())

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Full (unsharded) weights and optimizer state by name, complete on the first rank of the
        pipeline (its other stages' parts are gathered there); a collective on every rank."""
        weights, optim = self._stage_state()
        if self.pp.size == 1:
            return weights, optim
        spec = self.engine.optim_spec
        parts = self.pp.gather_objects((weights, optim))
        if parts is None:
            return {}, {"optimizer": spec.name, "state": {}}
        return ({k: v for w, _ in parts for k, v in w.items()},
                {"optimizer": spec.name, "state": {k: v for _, o in parts for k, v in o.get("state", {}).items()}})

    def _stage_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        spec = self.engine.optim_spec
        weights, optim = self.engine.full_state()
        state = optim.get("state", {})
        if self.tied is not None:
            weights, state = self.tied.to_canonical(weights), self.tied.to_canonical(state)
        if self.layout is not None:  # state shaped like a weight is sharded like it over tp
            gather = lambda tensors: self.layout.gather_full(tensors, self.device)  # noqa: E731
            weights = gather(weights)
            state = self._by_element_state(state, gather)
        return weights, {"optimizer": spec.name, "state": state}

    def load_full_state(self, weights: dict[str, torch.Tensor], optim: dict) -> None:
        spec = self.engine.optim_spec
        state = spec.saved_state(optim)  # before resharding: a foreign optimizer's state fails here, by name
        if self.tied is not None:
            weights, state = self.tied.with_aliases(weights), self.tied.with_aliases(state)
        if self.layout is not None:
            weights = self.layout.shard_full(weights)
            state = self._by_element_state(state, self.layout.shard_full)
        self.engine.load_full_state(weights, {"optimizer": spec.name, "state": state})

    # -- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------
    def _spec(self, name: str):
        return self.layout.specs.get(name) if self.layout is not None else None

    def _canonical(self, name: str) -> str:
        return self.tied.canonical_name(name) if self.tied is not None else name

    def _pieces(self):
        engine = self.engine
        if isinstance(engine, ZeroEngine):
            from bigtrain.parallel.zero.state import checkpoint_pieces
            return checkpoint_pieces(engine)
        return engine.checkpoint_pieces()

    def _load_batches(self, with_state: bool):
        engine = self.engine
        if isinstance(engine, ZeroEngine):
            from bigtrain.parallel.zero.state import checkpoint_load_batches
            return checkpoint_load_batches(engine, with_state)
        return engine.checkpoint_load_batches(with_state)

    def owned_chunks(self, copy: bool = False) -> list:
        """The chunks of full tensors this rank writes (:class:`SavedChunk`): one entry per parameter
        under its canonical name (a tied weight once) and ``optim/<name>/<state>`` per optimizer
        state tensor. Every element has one owner: its ZeRO shard's rank; among replicas (ZeRO stage
        0, the replicated engine) an even split of each parameter's range; tp rank 0 for weights
        tp does not cut; the canonical copy of a tied weight. Per-tensor state (a step count) is
        written whole by the owner of the parameter's first element. ``copy``: clone the data (a
        snapshot for a write that overlaps training); else views of the live shards."""
        from bigtrain.checkpoint.chunks import WEIGHT, chunks, full_shape, owned_range
        from bigtrain.checkpoint.sharded import SavedChunk

        tp_rank = self.layout.tp.rank if self.layout is not None else 0
        aliases = self.tied.aliases if self.tied is not None else set()
        out = []
        for batch in self._pieces():
            for piece in batch:
                spec = self._spec(piece.name)
                if piece.name in aliases or (spec is None and tp_rank != 0):
                    continue
                lo, hi = owned_range(piece)
                shape = full_shape(piece.shape, spec)
                for c in chunks(lo, hi, piece.shape, spec):
                    for key, flat in piece.tensors.items():
                        data = flat[c.start - piece.lo:c.stop - piece.lo].view(c.sizes)
                        fqn = piece.name if key == WEIGHT else f"optim/{piece.name}/{key}"
                        out.append(SavedChunk(fqn, shape, c.offsets, data.clone() if copy else data))
                if lo == 0 < hi and (spec is None or spec.index == 0):
                    out += [SavedChunk(f"optim/{piece.name}/{k}", tuple(v.shape), (0,) * v.dim(),
                                       v.detach().clone() if copy else v.detach()) for k, v in piece.scalars.items()]
        return out

    def load_sharded(self, path) -> None:
        """Fill this rank's shards (weights and optimizer state) from the sharded checkpoint at
        ``path``, whatever layout wrote it: each batch (a ZeRO unit, or one parameter) reads only the
        rectangles this rank's new layout holds. No collectives."""
        from bigtrain.checkpoint.chunks import WEIGHT, chunks
        from bigtrain.checkpoint.sharded import ChunkReader

        reader = ChunkReader(path)
        spec = self.engine.optim_spec
        with_state = any(k.startswith("optim/") for k in reader.entries)
        for batch in self._load_batches(with_state):
            requests = []
            for piece in batch:
                name, tp_spec = self._canonical(piece.name), self._spec(piece.name)
                for c in chunks(piece.lo, piece.hi, piece.shape, tp_spec):
                    for key, flat in piece.tensors.items():
                        fqn = name if key == WEIGHT else f"optim/{name}/{key}"
                        requests.append((fqn, c.offsets, flat[c.start - piece.lo:c.stop - piece.lo].view(c.sizes)))
                if with_state:
                    for k in spec.tensor_state:
                        piece.scalars[k] = reader.empty(f"optim/{name}/{k}")
                        requests.append((f"optim/{name}/{k}", (0,) * piece.scalars[k].dim(), piece.scalars[k]))
            reader.read(requests)

    def _by_element_state(self, state: dict[str, dict], reshard) -> dict[str, dict]:
        """``reshard`` ({param name: tensor} -> same, as for the weights) applied to each of the
        optimizer's per-element state tensors; per-tensor state (a step count) is kept as it is."""
        names = self.engine.optim_spec.element_state
        moved = {k: reshard({n: s[k] for n, s in state.items()}) for k in names}
        return {n: {**s, **{k: moved[k][n] for k in names}} for n, s in state.items()}


def parallelize(cfg: Config, mesh: Mesh, device: torch.device | str = "cpu") -> ParallelModel:
    """This rank's model, weights and optimizer for ``cfg`` on ``mesh``."""
    device = torch.device(device)
    p = cfg.parallel
    model = build_model(cfg.model)  # meta: no memory yet
    tp, sp, pp, grad_comm = mesh.comm("tp"), mesh.comm("sp"), mesh.comm("pp"), mesh.comm("dp_sp")
    layout = None
    if tp.size > 1 or sp.size > 1:
        layout = parallelize_llama(model, cfg.model, tp, sp, p.sequence_parallel)
    ties = shared_parameter_names(model)  # after tensor parallelism, which shards a tied weight once
    activations = apply_activation_memory(model, cfg, layout)
    stages, schedule, unit_modules = {}, None, None
    if pp.size > 1:
        stages = stages_for_rank(model, pp.size, pp.rank, p.pp_virtual, p.pp_balance, p.split_points)
        schedule = build_schedule(p.pp_schedule, pp.size, cfg.train.grad_accum(p.dp), p.pp_virtual)
        if len(stages) == 1:
            model = next(iter(stages.values()))  # the stage is the root unit, its blocks the others
            unit_modules = list(model.layers.values())
        else:  # one engine over all chunks; ZeRO-3 gathers per chunk, the modules the executor calls
            model, unit_modules = StageGroup(stages.values()), list(stages.values())
    tied = TiedCopies.of(model, ties, mesh.comm("pp_ends")) if ties else None
    if tied is not None and tied.names:
        unit_modules = _units_isolating(model, unit_modules, tied.names)
    unit_modules = activations.zero_units(model, unit_modules)

    def full_init(name: str, shape: tuple) -> torch.Tensor:
        # A tied copy starts as the weight it copies: the values depend on the canonical name.
        return init_value(ties.get(name, name), shape, cfg.train.seed, cfg.model)

    init_fn = layout.local_init(full_init) if layout is not None else full_init
    tp_sharded = set(layout.specs) if layout is not None else set()
    counted_elsewhere = tied.aliases if tied is not None else set()
    engine = _build_engine(cfg, model, grad_comm, tp, pp, tp_sharded, counted_elsewhere, init_fn, device,
                           unit_modules)
    if tied is not None:
        tied.check_layout(engine)
    for module in stages.values() or [model]:  # after to_empty, which would leave them uninitialized
        module.init_buffers(device)
    if layout is not None:
        layout.register_grad_hooks(model)
    return ParallelModel(model, engine, layout, grad_comm, sp, pp, activations.checkpointed, stages, schedule, tied,
                         device, activations)


def _units_isolating(model: nn.Module, unit_modules: list[nn.Module], names: list[str]) -> list[nn.Module]:
    """ZeRO units in which each of the weights ``names`` is alone, so that the two copies of a tied
    weight are cut into the same dp shards and can be summed shard by shard (see
    ``TiedCopies.check_layout``). The module holding the weight becomes a unit, placed before the
    unit module that would otherwise take it along (the first chunk of an interleaved rank), or
    last when it would share the root unit (the head beside the final norm; the embedding is alone
    in its stage's root already)."""
    units = list(unit_modules)
    for name in names:
        param, owner = model.get_parameter(name), model.get_submodule(name.rpartition(".")[0])
        holder = next((i for i, m in enumerate(units) if any(q is param for q in m.parameters())), None)
        if holder is not None:
            units.insert(holder, owner)
        elif any(q is not param for q in _root_parameters(model, units)):
            units.append(owner)
    return units


def _root_parameters(model: nn.Module, unit_modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters no unit module holds: ZeRO's root unit."""
    taken = {id(q) for m in unit_modules for q in m.parameters()}
    return [q for q in model.parameters() if id(q) not in taken]


def _build_engine(cfg: Config, model: nn.Module, grad_comm: AxisComm, tp: AxisComm, pp: AxisComm,
                  tp_sharded: set[str], counted_elsewhere: set[str], init_fn, device: torch.device,
                  unit_modules: list[nn.Module] | None) -> ReplicatedEngine | ZeroEngine:
    # Pipeline stages hold different weights: their squared gradient norms add up over pp.
    disjoint = [pp] if pp.size > 1 else []
    if cfg.parallel.zero == 0 and cfg.precision.mode == "fp32":
        model.to_empty(device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init_fn(name, tuple(p.shape)))
        return ReplicatedEngine(model, grad_comm, cfg.optim, cfg.parallel.bucket_mb, tp=tp, tp_sharded=tp_sharded,
                                disjoint=disjoint, counted_elsewhere=counted_elsewhere)
    return ZeroEngine(
        model, grad_comm, cfg.parallel.zero, Precision.from_config(cfg.precision), cfg.optim, init_fn=init_fn,
        device=device, unit_modules=unit_modules, reshard_after_forward=cfg.parallel.reshard_after_forward,
        prefetch=cfg.parallel.prefetch, scaler=DynamicLossScaler.from_config(cfg.precision), tp=tp,
        tp_sharded=tp_sharded, disjoint=disjoint, counted_elsewhere=counted_elsewhere)
