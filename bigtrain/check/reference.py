"""The independent reference: a plain single-process PyTorch training loop.

Every layout is proved against this loop. It shares only two things with the trainer: the model
class (``Llama``, whose initial values depend on the seed and each parameter's name; with experts,
its MoE blocks route and run every expert in one plain loop, no all-to-all) and the data sampler. Everything else is written here again with torch's own pieces, on purpose: no engine, no
``parallelize``, no bigtrain optimizer, schedule, clipping or loss helper. A bug on the trainer's
shared path therefore cannot hide in the reference too.

The recipe it states:
- loss: summed next-token cross-entropy (fp32) over the global batch, divided by the number of
  targets the loss counts (masked targets are left out), accumulated over micro-batches of
  ``train.micro_batch`` sequences;
- precision: fp32; or bf16/fp16 compute weights that are a copy of fp32 masters, gradients
  accumulated in fp32 on the masters (FSDP's ``param_dtype`` + fp32 ``reduce_dtype`` recipe);
  fp16 with a dynamic loss scale that skips overflowing steps;
- ``torch.nn.utils.clip_grad_norm_``, then ``torch.optim.AdamW`` with decay on matrices only, at the
  learning rate of linear warm-up then ``optim.schedule``'s decay to ``min_lr_ratio`` of the peak;
- ``optim.name = 'sgd_momentum'`` (the tests' optimizer, plugged into the trainer through
  ``bigtrain.optim.register_optimizer``): ``torch.optim.SGD`` with momentum ``optim.beta1``, no
  dampening, and its L2 weight decay (added to the gradient) on matrices only;
- ``adafactor``, ``lion``, ``adamw8bit``: ``torch.optim.Adafactor``, and plain transcriptions of
  Lion and 8-bit AdamW (:mod:`bigtrain.check.reference_optim`);
- ``memory.activation_compression = 'int8'``: each linear layer of the blocks (and the head, unless
  ``model.fused_loss``) computes its output and input gradient from its exact input, and its weight
  gradient from that input rounded to int8 with one scale per row (token) over all the row's
  features, s = max|row| / 127 (:mod:`bigtrain.core.int8_reference`). The rule is what the layout must apply
  to the same tensors and rows whatever its cut, so a compressed layout is held to the fp32 bounds.
- ``precision.fp8``: the blocks' linears are :class:`bigtrain.fp8.linear.Float8Linear` on the
  emulated backend, whatever the device: float8 is part of the model under test here, as the
  model class is (its numerics are proved on their own against torchao's float8 training and a
  transcription of the recipe, tests/test_fp8.py), and the kernel a layout runs on is not.

It computes on ``device`` (the CPU by default; a GPU run is compared with the reference on the same
GPU, in the same precision). The initial values are drawn on the CPU whatever the device, and what
a captured step returns (outputs, gradients, weights) is copied to the CPU.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F

from bigtrain.config import Config
from bigtrain.core.int8_reference import int8_weight_gradients
# every family's reference writes a ReferenceStep
from bigtrain.core.reference_step import (ReferenceLossScale, ReferenceStep, accumulate_into_masters, decay_groups,
                                          copy_masters_to, reference_learning_rate)
from bigtrain.core.reference_documents import each_document_alone, join_pieces, spans_as_documents, spans_as_positions
from bigtrain.data.boundaries import boundary_ids
from bigtrain.data.load import run_sampler
from bigtrain.fp8.linear import convert_to_float8
from bigtrain.fp8.scaling import Float8Recipe
from bigtrain.models.llama import Llama
from bigtrain.models.moe import moe_blocks, set_aux_loss_scale, update_router_biases
from bigtrain.models.widen import at_least_fp32

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def captured_module(name: str) -> bool:
    """The modules whose outputs ``bigtrain check`` compares: embedding, each block and its two
    sub-blocks, the final norm and the output head (their outputs are whole hidden states or
    logits, so any layout's pieces can be put back together)."""
    parts = name.split(".")
    if name in ("tok_embeddings", "norm", "output"):
        return True
    return parts[0] == "layers" and (len(parts) == 2 or (len(parts) == 3 and parts[2] in ("attention", "feed_forward")))


class ReferenceRun:
    """``replica = (i, n)``: train on the i-th of n equal slices of each global batch, its loss the
    mean over that slice (a data-parallel replica stepping alone, for local SGD).

    ``gradient_delay`` (steps, or a function of the parameter's name): step t computes its loss and
    gradient with each weight as it was ``delay`` steps before (the first weights for t < delay; a
    skipped step counts as a step that changed nothing) and applies that gradient, at step t's
    learning rate, to the current weights, W(t+1) = W(t) - lr(t) * grad(W(t - delay)): the
    asynchronous pipelines' rule, and ZeRO-Offload's delayed update at a delay of 1. In mixed
    precision the delayed weights are the fp32 masters of then, rounded to the compute dtype, whose
    gradients add into the current masters' in fp32 (the same recipe as without the delay). None
    takes it from the config's schedule (:func:`config_gradient_delay`)."""

    def __init__(self, cfg: Config, device: torch.device | str = "cpu", replica: tuple[int, int] = (0, 1),
                 gradient_delay: int | Callable[[str], int] | None = None, exact: bool = False):
        self.cfg, self.device = cfg, torch.device(device)
        self.replica = replica
        if gradient_delay is None:
            gradient_delay = config_gradient_delay(cfg)
        self.delay = gradient_delay if callable(gradient_delay) else (lambda name: gradient_delay)
        if exact and (problem := exact_problem(cfg)):
            raise ValueError(f"exact reference: {problem}")
        with self.device:
            self.master = Llama(cfg.model)  # fp32
        self.master.init_weights(cfg.train.seed)
        if cfg.model.init_from:  # the run starts from these, not the seed's (the check compared a random init)
            load_init_from(self.master, cfg.model)
        mode = cfg.precision.mode
        self.mixed = mode != "fp32"
        self.compute = copy.deepcopy(self.master).to(COMPUTE_DTYPES[mode]) if self.mixed else self.master
        self.compute.init_buffers()  # rotary tables stay fp32, as in the model's own init
        if exact:  # the same initial values and tables in float64: fp32's own rounding left out
            self.master.double()
        delayed = any(self.delay(n) for n, _ in self.master.named_parameters())
        # Computes with the delayed weights, in the compute dtype: a copy of the compute model (in fp32,
        # of the masters), whose weights _delayed_model sets from the masters' history.
        self.stale = copy.deepcopy(self.compute) if delayed else None
        if cfg.memory.activation_compression == "int8":
            for model in (self.compute, self.stale):
                if model is not None:
                    int8_weight_gradients(model.layers, None if cfg.model.fused_loss else model.output,
                                          exact=[block.router for _, block in moe_blocks(model.layers)])
        self.history = [self._weights()] if delayed else []  # history[t]: the fp32 weights after t steps
        if cfg.precision.fp8 != "none":
            for model in {id(m): m for m in (self.compute, self.stale) if m is not None}.values():
                convert_to_float8(model, Float8Recipe(cfg.precision.fp8), "emulated")
        for model in {id(m): m for m in (self.compute, self.stale) if m is not None}.values():
            set_aux_loss_scale(model, 1.0 / cfg.train.global_batch)  # MoE: balance loss, batch mean
        params = list(self.master.parameters())  # de-duplicated: a tied weight once
        self.optimizer = reference_optimizer_of(decay_groups(params, cfg.optim.weight_decay), cfg.optim)
        self.sampler = run_sampler(cfg)
        # block-causal attention: the corpus's document delimiters (a fact of the data, as the sampler is)
        self.boundaries = boundary_ids(cfg.data) if cfg.model.attn_mask == "block_causal" else None
        self.loss_scale = ReferenceLossScale(cfg.precision)
        self.step = 0

    @classmethod
    def exact(cls, cfg: Config, device: torch.device | str = "cpu") -> "ReferenceRun":
        """The same loop in float64 (``bigtrain check``'s measure of fp32's own rounding)."""
        return cls(cfg, device, exact=True)

    @staticmethod
    def exact_problem(cfg: Config) -> str | None:
        return exact_problem(cfg)

    def learning_rate(self, step: int) -> float:
        return reference_learning_rate(self.cfg, step)

    def train_step(self, capture: bool = False) -> ReferenceStep:
        index, replicas = self.replica
        per_replica = self.cfg.train.global_batch // replicas
        tokens, targets = self.sampler.batch(self.step, index * per_replica, per_replica)
        counted = max(1, int((targets != -100).sum()))
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        outputs: dict[str, list[torch.Tensor]] = {}
        model = self._delayed_model() if self.stale is not None else self.compute
        handles = self._capture_outputs(outputs, model) if capture else []
        loss_sum = 0.0
        micro = self.cfg.train.micro_batch
        try:
            for first in range(0, tokens.shape[0], micro):
                logits = self._logits(model, tokens[first:first + micro], outputs if capture else None)
                loss = F.cross_entropy(at_least_fp32(logits).flatten(0, 1), targets[first:first + micro].flatten(),
                                       reduction="sum")
                loss_sum += float(loss.detach())
                (loss / counted * self.loss_scale.scale).backward()
                if self.mixed:  # with a delay, the gradient of the delayed weights into the current masters
                    accumulate_into_masters(self.master, model)
        finally:
            for h in handles:
                h.remove()
        if self.stale is not None and not self.mixed:  # the delayed weights' gradient, onto the current ones
            for master, stale in zip(self.master.parameters(), self.stale.parameters()):
                master.grad, stale.grad = stale.grad, None
        result = self._update()
        if self.stale is not None:
            self.history.append(self._weights())
        result.loss = loss_sum / counted
        if capture:
            result.outputs = {name: at_least_fp32(torch.cat(parts)).cpu() for name, parts in outputs.items()}
            result.weights = {n: p.detach().cpu().clone() for n, p in self.master.named_parameters()}
        self.step += 1
        return result

    def _weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}

    def _logits(self, model: torch.nn.Module, tokens: torch.Tensor, outputs: dict | None) -> torch.Tensor:
        """The micro-batch's logits: causal over each window; block-causal (model.attn_mask) as each
        document run alone (core/reference_documents.py), or, where MoE blocks route a sequence as a
        whole (capacity, balance loss: a document alone would route otherwise), the window whole
        with its documents written out by that module's own loop."""
        if self.cfg.model.attn_mask != "block_causal":
            return model(tokens)
        starts, ends = self.boundaries
        if self._routes_whole_sequences():
            positions = spans_as_positions(tokens, starts, ends) if self.cfg.model.reset_positions else None
            return model(tokens, positions=positions, documents=spans_as_documents(tokens, starts, ends))
        join = (lambda pieces: join_pieces(outputs, pieces)) if outputs is not None else None
        return each_document_alone(lambda doc, first: model(doc, start_pos=first), tokens, starts, ends,
                                   self.cfg.model.reset_positions, join)

    def _routes_whole_sequences(self) -> bool:
        m = self.cfg.model
        return m.moe_experts > 0 and (m.moe_capacity_factor > 0 or m.moe_aux_loss_coef > 0)

    @torch.no_grad()
    def at_weights(self, weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> bool:
        """Set the master weights to ``weights`` (full tensors by name, a layout's), and the model
        state outside them to ``buffers`` (a sigmoid-bias router's bias, which moves by the sign of
        its expert's load: a layout whose routing parted moves it otherwise), so that the next step
        computes its gradient at them; whether it will: not with a gradient delay (it computes at
        the history's weights), nor where ``weights`` lacks one of the model's."""
        held = dict(self.master.named_parameters())
        if self.stale is not None or any(name not in weights for name in held):
            return False
        for name, p in held.items():
            p.copy_(weights[name].reshape(p.shape))
        if self.mixed:
            copy_masters_to(self.compute, self.master)
        copy_buffers({id(m): m for m in (self.master, self.compute)}.values(), buffers or {})
        return True

    def restart_delays(self) -> None:
        """From here on, as a run resumed now: its asynchronous pipeline starts empty (the stashed
        versions are not saved, docs/async.md), so the next steps compute with the current weights
        until ``delay`` updates have been made, as the first steps do."""
        if self.stale is not None:
            self.history = [self._weights()] * (self.step + 1)

    def set_gradient_delay(self, gradient_delay: int | Callable[[str], int]) -> None:
        """From here on, step with ``gradient_delay`` (as the constructor's) as a run resumed now:
        the delayed weights restart at the current ones (:meth:`restart_delays`). A resumed check
        replays the steps before its checkpoint with the delay of the run that saved it, then takes
        the resumed run's: a resume across a change of schedule (2BW saved, 1F1B resumed, or the
        other way round) replayed them with the resumed run's delay, a reference on another
        trajectory, and every such resume diverged at its first step."""
        self.delay = gradient_delay if callable(gradient_delay) else (lambda name: gradient_delay)
        delayed = any(self.delay(n) for n, _ in self.master.named_parameters())
        if delayed and self.stale is None:
            self.stale = copy.deepcopy(self.compute)  # carries the compute model's int8 / float8 conversion
        elif not delayed:
            self.stale = None
        self.history = [self._weights()] * (self.step + 1) if delayed else []

    @torch.no_grad()
    def _delayed_model(self) -> torch.nn.Module:
        for name, p in self.stale.named_parameters():
            p.copy_(self.history[max(self.step - self.delay(name), 0)][name])
        return self.stale

    def _capture_outputs(self, into: dict[str, list[torch.Tensor]], model: torch.nn.Module) -> list:
        handles = []
        for name, module in model.named_modules():
            if captured_module(name):
                handles.append(module.register_forward_hook(
                    lambda m, args, out, name=name: into.setdefault(name, []).append(out.detach().clone())))
        return handles

    def _update(self) -> ReferenceStep:
        params = [p for p in self.master.parameters() if p.grad is not None]
        if self.loss_scale.scale != 1.0:
            for p in params:
                p.grad.div_(self.loss_scale.scale)
        grads = {n: p.grad.detach().cpu().clone() for n, p in self.master.named_parameters() if p.grad is not None}
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        skipped = self.loss_scale.skips(norm)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate(self.step)
            self.optimizer.step()
        # MoE: this process saw every token. The routers' statistics are those of the model that ran
        # the forward (with a delay, the stale copy), and their biases move there at once: they are
        # model state outside the optimizer, not delayed (as the trainer moves them after each step).
        ran = self.stale if self.stale is not None else self.compute
        routing = update_router_biases(ran, move_biases=not skipped)
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            copy_masters_to(self.compute, self.master)
        return ReferenceStep(loss=0.0, grad_norm=norm, skipped=skipped, grads=grads,
                             routing={name: block["load"] for name, block in routing.items()})


@torch.no_grad()
def copy_buffers(models, buffers: dict[str, torch.Tensor]) -> None:
    """Each of ``models``' buffers named in ``buffers`` set to its value there (in its own dtype)."""
    for model in models:
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name].reshape(b.shape))


@torch.no_grad()
def load_init_from(model: Llama, m) -> None:
    """``model.init_from``'s weights (a Hugging Face folder) into the whole ``model``, each
    parameter as the folder holds it under its Hugging Face name (a tied head is one parameter)."""
    from bigtrain.checkpoint.hf import HFWeights, hf_folder

    weights = HFWeights(hf_folder(m.init_from), m)
    for name, param in model.named_parameters():
        param.copy_(weights(name, tuple(param.shape)))


def exact_problem(cfg: Config) -> str | None:
    """Why ``cfg`` has no float64 twin of its reference (None: it has one). The twin runs the same
    loop in float64 to measure fp32's own rounding; what quantizes or rounds on purpose (low
    precision, float8, 8-bit state) would not be the same function in float64.
    Lion's sign and int8's codes are the same function in float64, only discontinuous: where c is a
    rounding error from 0 (a gradient that is rounding alone, as the key third of a fused qkv bias:
    softmax ignores a constant per query) fp32 and float64 step an element by +-lr each their own
    way, and an input a rounding error from a code boundary rounds to either code; the twin's
    distance measures exactly that (a fixed bound cannot: 0.56 relative on GPT-2's key bias, layout
    against fp32 reference, dp 2 x ZeRO-2, at step 2; wq's and wk's gradients 100% apart under int8
    where a sequence of one repeated token leaves attention's scores no gradient but rounding, fuzz
    seed 20261454 sample 8)."""
    if cfg.precision.mode != "fp32":
        return f"precision.mode = '{cfg.precision.mode}' rounds on purpose"
    if cfg.precision.fp8 != "none":
        return f"precision.fp8 = '{cfg.precision.fp8}' quantizes on purpose"
    if cfg.optim.name == "adamw8bit":
        return f"optim.name = '{cfg.optim.name}' quantizes its state on purpose"
    return None


def replay_to_checkpoint(reference, steps: int, saved_delay: int | None, restart: bool) -> None:
    """Step ``reference`` (at step 0) up to a checkpoint after ``steps`` steps, as the run that saved it
    took them (with ``saved_delay`` where given), then as the resumed run goes on: with its own
    delay (``config_gradient_delay``), or, ``restart`` (an asynchronous pipeline resumed at its
    own schedule), with its delays restarted (it starts empty)."""
    if saved_delay is not None:
        if not hasattr(reference, "set_gradient_delay"):
            raise ValueError(f"{type(reference).__name__} cannot replay a resume across a change of gradient "
                             f"delay (parallel.pp_schedule, offload.delayed_update)")
        reference.set_gradient_delay(saved_delay)
    for _ in range(steps):
        reference.train_step()
    if saved_delay is not None:
        reference.set_gradient_delay(config_gradient_delay(reference.cfg))
    elif restart:
        reference.restart_delays()


def config_gradient_delay(cfg: Config) -> int:
    """The gradient delay (in steps) of the config's pipeline schedule: 1 for PipeDream-2BW (a step's
    gradient is taken at the weights of one step before), pp - 1 for PipeDream with vertical sync
    (one micro-batch per step, every stage at the first stage's version), 0 for a flushing schedule.
    PipeDream without vertical sync delays each stage differently; pass ``gradient_delay`` by name.
    ZeRO-Offload's delayed update (``offload.delayed_update``) is a delay of 1 too."""
    p = cfg.parallel
    if cfg.offload.delayed_update:
        return 1
    if p.pp < 2 or p.pp_schedule not in ("pipedream-2bw", "pipedream"):
        return 0
    if p.pp_schedule == "pipedream-2bw":
        return 1
    if p.pp_vertical_sync:
        return p.pp - 1
    raise ValueError("parallel.pp_schedule = 'pipedream' without vertical sync delays each stage by its own "
                     "count; give ReferenceRun a gradient_delay per parameter name, or set "
                     "parallel.pp_vertical_sync = true")


# The optimizers the references state (optim.name); any other is the trainer's alone.
REFERENCE_OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "lion", "sgd_momentum")


def reference_optimizer_of(groups: list[dict], o) -> torch.optim.Optimizer:
    """The reference's own optimizer of ``optim.name`` (one of REFERENCE_OPTIMIZERS) over ``groups``."""
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if o.name == "sgd_momentum":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.beta1)
    from bigtrain.check.reference_optim import reference_optimizer

    optimizer = reference_optimizer(groups, o)
    if optimizer is None:
        raise ValueError(f"optim.name = '{o.name}': the reference knows 'adamw', 'adamw8bit', 'adafactor', 'lion' "
                         f"and 'sgd_momentum' only")
    return optimizer


def reference_losses(cfg: Config, steps: int, device: torch.device | str = "cpu") -> list[float]:
    """Per-step losses of the reference over ``steps`` steps."""
    return reference_trajectory(cfg, steps, device)[0]


def reference_trajectory(cfg: Config, steps: int, device: torch.device | str = "cpu"
                         ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(per-step losses, per-step gradient norms, fp32 weights by name on the CPU after the last step)."""
    run = ReferenceRun(cfg, device)
    records = [run.train_step() for _ in range(steps)]
    weights = {n: p.detach().cpu().clone() for n, p in run.master.named_parameters()}
    return [r.loss for r in records], [r.grad_norm for r in records], weights
