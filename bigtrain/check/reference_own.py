"""The independent reference for a family of one's own (``register_family``) on the Trainer's
decoder step: the family's model, trained in one plain process.

It shares with the trainer only the model (the family's ``build_meta``, materialized on the CPU in
fp32), its initial values (:func:`bigtrain.families.own.initial_values`, the one function the
Trainer gives ``parallelize``: the family's ``init_fn``, the model's own ``initial_value``, or the
draws by seed and name) and the data sampler. The rest is stated again here with torch's own
pieces, as :mod:`bigtrain.check.reference` states it for bigtrain's Llama: no engine, plan or
parallel model, no bigtrain optimizer, schedule, clipping or loss helper.

The recipe it states:
- the model called as ``model(tokens)`` -> logits (batch, seq, vocabulary), the Trainer's decoder step;
- loss: the summed next-token cross-entropy (fp32) over the global batch, divided by the number of
  targets the loss counts (masked targets are left out), accumulated over micro-batches of
  ``train.micro_batch`` sequences;
- precision: fp32; or bf16/fp16 compute weights that are a copy of fp32 masters, gradients accumulated
  in fp32 on the masters (FSDP's ``param_dtype`` + fp32 ``reduce_dtype`` recipe); fp16 with a dynamic
  loss scale that skips overflowing steps (:class:`bigtrain.core.reference_step.ReferenceLossScale`);
- ``torch.nn.utils.clip_grad_norm_`` over the trainable parameters, then the reference's optimizer
  of ``optim.name`` (``torch.optim.AdamW``, ...: :func:`bigtrain.check.reference.reference_optimizer_of`)
  with decay on matrices only, at the learning rate of linear warm-up then ``optim.schedule``'s decay; a
  parameter the forward did not reach steps with a zero gradient, as the trainer's flat buffers do.

What it does not state, :meth:`OwnReference.problems` names and ``bigtrain check`` refuses before
launch: float8 and int8 activation compression (they change the blocks'
linears), the delays of ZeRO-Offload's delayed update and of asynchronous pipelines, local SGD, and
bigtrain's MoE blocks (their routers' bias updates and balance loss).

The outputs compared (:func:`captured_of`): each of the family's ``blocks``, its ``final_norm`` and
its ``head``, where the family names them (a family may give ``captured`` instead); outputs that
are no single tensor are not compared.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bigtrain.check.reference import REFERENCE_OPTIMIZERS, copy_buffers, exact_problem, reference_optimizer_of
from bigtrain.config import Config
from bigtrain.core.reference_step import (ReferenceLossScale, ReferenceStep, copy_masters_to, decay_groups,
                                          next_token_loss_backward, recorded_outputs,
                                          reference_learning_rate)
from bigtrain.core.targets import IGNORE_INDEX
from bigtrain.data.load import run_sampler
from bigtrain.families import Family, family_of
from bigtrain.families.hf_reference import parameters_in
from bigtrain.families.own import initial_values
from bigtrain.models.moe import MoEFeedForward
from bigtrain.parallel.pipeline.schedules import ASYNC_KINDS

# precision.mode -> the compute copy's dtype (None: the masters)
MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def materialized(family: Family, cfg: Config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The family's whole model on the CPU in ``dtype``, each parameter (and buffer its constructor
    computed on the meta device) at the trainer's initial value by name."""
    model = family.build_meta(cfg)
    values = initial_values(family, cfg, model)
    if values is None:  # the model's own (parallelize's default)
        values = lambda name, shape: model.initial_value(name, shape, cfg.train.seed)  # noqa: E731
    computed = [name for name, b in model.named_buffers() if b.is_meta]
    held = {name: b.clone() for name, b in model.named_buffers() if not b.is_meta}  # to_empty would drop them
    first: dict[int, str] = {}  # each parameter's first name: a tied weight's other names copy it
    ties = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    # A new tensor for each name: a tied weight is tied again below. Stated here, not by
    # parallel/tied.py's to_empty_keeping_ties: a tie the trainer's materialization broke must show.
    model.to_empty(device="cpu")
    for name, tied_to in ties.items():
        if name != tied_to:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(tied_to))
    for name, value in held.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied weight once, by the name the trainer saves
            p.data = values(name, tuple(p.shape)).to(dtype).reshape(p.shape).clone()
        if hasattr(model, "init_buffers"):
            model.init_buffers("cpu")
        else:
            for name in computed:
                owner, _, leaf = name.rpartition(".")
                buffer = model.get_buffer(name)
                model.get_submodule(owner)._buffers[leaf] = values(name, tuple(buffer.shape)).to(buffer.dtype)
    if dtype == torch.float64:  # the exact twin: its floating buffers too (as ReferenceRun.exact's model.double())
        model.double()
    return model


def captured_of(family: Family, cfg: Config) -> Callable[[str], bool]:
    """The modules whose outputs ``bigtrain check`` compares for a family of one's own: its
    ``captured``, else each of its blocks, its final norm and its head, where it names them (whole
    hidden states or logits, which any layout's pieces assemble into); none where it names none."""
    if family.captured is not None:
        return family.captured
    model = family.build_meta(cfg)  # the meta device: names only
    names = {name for name in (family.final_norm, family.head) if name}
    if family.blocks is not None:
        blocks = family.blocks(model)
        prefix = next((name for name, m in model.named_modules() if m is blocks), None)
        if prefix is not None:  # else not the model's own module: nothing of it can be named
            names |= {f"{prefix}.{child}" if prefix else child for child, _ in blocks.named_children()}
    return names.__contains__


class OwnReference:
    """``train_step(capture)`` as :class:`bigtrain.check.reference.ReferenceRun`'s; ``dtype``
    float64 (:meth:`exact`) measures how far fp32's rounding alone moves each tensor."""

    @staticmethod
    def problems(cfg: Config) -> list[str]:
        """What this reference does not state (``bigtrain check`` refuses it before launch, naming the field)."""
        p, name = cfg.parallel, cfg.model.family
        why = f"the reference of a family of one's own (model.family = '{name}') does not state it"
        out = []
        if cfg.optim.name not in REFERENCE_OPTIMIZERS:
            out.append(f"optim.name = '{cfg.optim.name}': the reference steps with "
                       f"{', '.join(repr(o) for o in REFERENCE_OPTIMIZERS)} only")
        if cfg.precision.fp8 != "none":
            out.append(f"precision.fp8 = '{cfg.precision.fp8}': {why} (float8 linears); set precision.fp8 = 'none'")
        if cfg.memory.activation_compression != "none":
            out.append(f"memory.activation_compression = '{cfg.memory.activation_compression}': {why} (the int8 "
                       f"weight gradients); set memory.activation_compression = 'none'")
        if cfg.offload.delayed_update:
            out.append(f"offload.delayed_update = true: {why} (a gradient one update old); set "
                       f"offload.delayed_update = false")
        if p.pp > 1 and p.pp_schedule in ASYNC_KINDS:
            out.append(f"parallel.pp_schedule = '{p.pp_schedule}': {why} (gradients of older weights); use a "
                       f"flushing schedule such as '1f1b'")
        if p.dp_sync != "sync":
            out.append(f"parallel.dp_sync = '{p.dp_sync}': {why} (replicas apart between averages); set "
                       f"parallel.dp_sync = 'sync'")
        family = family_of(cfg)
        if family.build_meta is not None and any(isinstance(m, MoEFeedForward)
                                                 for m in family.build_meta(cfg).modules()):
            out.append(f"model.family = '{name}': its model has bigtrain's MoE blocks, whose balance loss and "
                       f"router biases {why}; give the family its own Family.reference")
        return out

    @staticmethod
    def exact_problem(cfg: Config) -> str | None:
        return exact_problem(cfg)

    @classmethod
    def exact(cls, cfg: Config, device: torch.device | str = "cpu") -> "OwnReference":
        """The same loop in float64: ``bigtrain check``'s measure of fp32's own rounding."""
        return cls(cfg, device, torch.float64)

    def __init__(self, cfg: Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if problems := self.problems(cfg):
            raise ValueError("; ".join(problems))
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.model = materialized(family_of(cfg), cfg, dtype)  # the masters
        low = MODES[cfg.precision.mode]
        # bf16 / fp16: a copy of the weights in it computes (buffers as they are), its gradients
        # summed into the fp32 masters the optimizer steps.
        self.compute = parameters_in(self.model, low) if low is not None else self.model
        self.model.to(self.device)
        self.compute.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # a tied weight once
        o = cfg.optim
        self.optimizer = reference_optimizer_of(decay_groups(self.params, o.weight_decay), o)
        self.sampler = run_sampler(cfg)
        self.captured = captured_of(family_of(cfg), cfg)
        self.loss_scale = ReferenceLossScale(cfg.precision)
        self.step = 0

    def learning_rate(self, step: int) -> float:
        return reference_learning_rate(self.cfg, step)

    def train_step(self, capture: bool = False) -> ReferenceStep:
        t = self.cfg.train
        tokens, targets = self.sampler.batch(self.step, 0, t.global_batch)
        counted = max(1, int((targets != IGNORE_INDEX).sum()))
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        captured = self.captured if capture else (lambda name: False)
        with recorded_outputs(self.compute, captured, lambda out: out.to(self.dtype)) as outputs:
            loss_sum = next_token_loss_backward(self.compute, tokens, targets, t.micro_batch, counted, self.dtype,
                                                self.loss_scale.scale, self.model, self.compute)
        for p in self.params:  # not reached by this step's forward: a zero gradient, as in a flat buffer
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif self.loss_scale.scale != 1.0:
                p.grad.div_(self.loss_scale.scale)
        grads = {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()
                 if capture and p.requires_grad}
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        skipped = self.loss_scale.skips(norm)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate(self.step)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.compute is not self.model:
            copy_masters_to(self.compute, self.model)
        self.step += 1
        result = ReferenceStep(loss=loss_sum / counted, grad_norm=norm, skipped=skipped, grads=grads)
        if capture:
            result.outputs = {name: torch.cat(parts) for name, parts in outputs.items()}
            result.weights = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        return result

    @torch.no_grad()
    def at_weights(self, weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> bool:
        """Set the master weights to ``weights`` (full tensors by name, a layout's) so that the next
        step computes its gradient at them, and the model state outside them to ``buffers`` (the
        layout's, by the same names); whether it will: not where ``weights`` lacks one of the
        model's, nor where ``buffers`` names state this model does not hold."""
        held = dict(self.model.named_parameters())
        state = {n for m in (self.model, self.compute) for n, _ in m.named_buffers()}
        if any(name not in weights for name in held) or any(name not in state for name in buffers or {}):
            return False
        for name, p in held.items():
            p.copy_(weights[name].reshape(p.shape))
        if self.compute is not self.model:
            copy_masters_to(self.compute, self.model)
        copy_buffers({id(m): m for m in (self.model, self.compute)}.values(), buffers or {})
        return True
