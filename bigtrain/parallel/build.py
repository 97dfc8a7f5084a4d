"""From a config and a mesh to this rank's part of the model, ready to train.

The order is the design's: build the plain model on the meta device; apply tensor / sequence
parallel plans (module structure, still meta); activation checkpointing; then materialize only
this rank's weights inside the gradient engine (full replicas, or ZeRO shards over the ranks that
hold replicas of each weight: dp, times sp under Ulysses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config import Config
from bigtrain.distributed.comm import AxisComm
from bigtrain.distributed.mesh import Mesh
from bigtrain.memory.checkpointing import apply_activation_checkpointing
from bigtrain.models.llama import build_model, init_value
from bigtrain.parallel.replicated import ReplicatedEngine
from bigtrain.parallel.tensor.functional import local_chunk
from bigtrain.parallel.tensor.plan import TensorLayout, parallelize_llama
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.parallel.zero.state import MOMENTS
from bigtrain.precision import DynamicLossScaler, Precision


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


@dataclass
class ParallelModel:
    model: nn.Module
    engine: ReplicatedEngine | ZeroEngine
    layout: TensorLayout | None
    grad_comm: AxisComm  # the ranks holding replicas of every weight (dp, or dp x sp)
    sp: AxisComm
    checkpointed: list[int]

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        parallel = self.layout.loss_sum(logits, targets) if self.layout is not None else None
        return parallel if parallel is not None else token_loss_sum(logits, targets)

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's summed loss over its tokens (its sequence chunk under Ulysses)."""
        start = 0
        if self.sp.size > 1:
            start = self.sp.rank * tokens.shape[1] // self.sp.size
            tokens, targets = local_chunk(tokens, self.sp, 1), local_chunk(targets, self.sp, 1)
        return self.loss_sum(self.model(tokens, start_pos=start), targets)

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Full (unsharded) weights and optimizer state by name; a collective on every rank."""
        weights, optim = self.engine.full_state()
        if self.layout is None:
            return weights, optim
        weights = self.layout.gather_full(weights)
        state = optim.get("state", {})
        moments = {k: self.layout.gather_full({n: s[k] for n, s in state.items()}) for k in MOMENTS}
        optim = {"state": {n: {**s, **{k: moments[k][n] for k in MOMENTS}} for n, s in state.items()}}
        return weights, optim

    def load_full_state(self, weights: dict[str, torch.Tensor], optim: dict) -> None:
        if self.layout is not None:
            weights = self.layout.shard_full(weights)
            state = optim.get("state", {})
            moments = {k: self.layout.shard_full({n: s[k] for n, s in state.items()}) for k in MOMENTS}
            optim = {"state": {n: {**s, **{k: moments[k][n] for k in MOMENTS}} for n, s in state.items()}}
        self.engine.load_full_state(weights, optim)


def parallelize(cfg: Config, mesh: Mesh, device: torch.device | str = "cpu") -> ParallelModel:
    """This rank's model, weights and optimizer for ``cfg`` on ``mesh``."""
    device = torch.device(device)
    model = build_model(cfg.model)  # meta: no memory yet
    tp, sp, grad_comm = mesh.comm("tp"), mesh.comm("sp"), mesh.comm("dp_sp")
    layout = None
    if tp.size > 1 or sp.size > 1:
        layout = parallelize_llama(model, cfg.model, tp, sp, cfg.parallel.sequence_parallel)
    checkpointed = apply_activation_checkpointing(model.layers, cfg.memory.checkpointing,
                                                  cfg.memory.checkpoint_every)

    def full_init(name: str, shape: tuple) -> torch.Tensor:
        return init_value(name, shape, cfg.train.seed, cfg.model)

    init_fn = layout.local_init(full_init) if layout is not None else full_init
    tp_sharded = set(layout.specs) if layout is not None else set()
    engine = _build_engine(cfg, model, grad_comm, tp, tp_sharded, init_fn, device)
    if layout is not None:
        layout.register_grad_hooks(model)
    return ParallelModel(model, engine, layout, grad_comm, sp, checkpointed)


def _build_engine(cfg: Config, model: nn.Module, grad_comm: AxisComm, tp: AxisComm, tp_sharded: set[str],
                  init_fn, device: torch.device) -> ReplicatedEngine | ZeroEngine:
    if cfg.parallel.zero == 0 and cfg.precision.mode == "fp32":
        model.to_empty(device=device)
        model.init_buffers(device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init_fn(name, tuple(p.shape)))
        return ReplicatedEngine(model, grad_comm, cfg.optim, cfg.parallel.bucket_mb, tp=tp, tp_sharded=tp_sharded)
    model.init_buffers(device)
    return ZeroEngine(
        model, grad_comm, cfg.parallel.zero, Precision.from_config(cfg.precision), cfg.optim, init_fn=init_fn,
        device=device, reshard_after_forward=cfg.parallel.reshard_after_forward, prefetch=cfg.parallel.prefetch,
        scaler=DynamicLossScaler.from_config(cfg.precision), tp=tp, tp_sharded=tp_sharded)
