"""The independent reference for the Hugging Face family: the transformers model itself, trained in
one plain process.

It shares with the trainer only the model (the same ``config.json``, built by transformers; the
same initial values, by seed and name: :func:`bigtrain.models.hf_causal_lm.init_value`) and the
data sampler. Everything else is written again here: the model is called as transformers calls
it (``model(input_ids).logits``; no bigtrain adapter, no meta build, no plan, no stages), the loss
is the summed cross-entropy over the global batch divided by its counted targets (accumulated over
micro-batches of ``train.micro_batch`` sequences), the gradient is clipped by
``torch.nn.utils.clip_grad_norm_``, and the step is ``torch.optim.AdamW`` (decay on matrices only)
at linear warm-up then ``optim.schedule``'s decay to ``optim.min_lr_ratio`` of the peak; a parameter no token
reached this step (an expert of an MoE model) steps with a zero gradient, as it is. AdamW only; fp32, or
bf16 as the trainer's mixed precision computes it (a bf16 copy of the weights runs forward and
backward, its gradients summed in fp32 into the fp32 masters the optimizer steps); with
ZeRO-Offload's delayed update, each step computes at the weights from before the last update.
The fused loss needs nothing here (it is the same cross-entropy); int8 compression and float8
decoder-layer linears are stated as for bigtrain's Llama (check/reference.py): the int8 rule of
:mod:`bigtrain.core.int8_reference`, and :class:`bigtrain.fp8.linear.Float8Linear` on the
emulated backend as part of the model under test.

A mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE) runs transformers' own sparse blocks here (its
loop over experts); only its gradients and weights are reported under the names the trainer's
model has (each expert's matrices stacked into a bank: families/hf_moe.py's conversion, the one
the trainer's initialization uses), so they are compared name by name. A wrong conversion cannot
hide: the trainer would then compute with other values than the reference and the losses differ.

``bigtrain check`` compares a layout with it step by step (:class:`HFReference`, the family's
``reference``); the tests compare whole runs (:func:`reference_hf`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bigtrain.checkpoint.hf import SafetensorsWeights, hf_folder
from bigtrain.config import Config
from bigtrain.core.int8_reference import int8_weight_gradients
from bigtrain.core.reference_step import (ReferenceStep, copy_masters_to, decay_groups, next_token_loss_backward,
                                          recorded_outputs, reference_learning_rate)
from bigtrain.core.reference_documents import each_document_alone, join_pieces
from bigtrain.data.boundaries import boundary_ids
from bigtrain.data.load import run_sampler
from bigtrain.families.hf_moe import (file_views, from_transformers_names, sparse_blocks, to_transformers_names,
                                      transformers_major)
from bigtrain.fp8.linear import convert_to_float8
from bigtrain.fp8.scaling import Float8Recipe
from bigtrain.models.hf_causal_lm import init_value

IGNORED = -100  # the target id cross-entropy leaves out (the sampler's masked targets)
MODES = {"fp32": None, "bf16": torch.bfloat16}  # precision.mode -> the compute copy's dtype (None: the masters)


def captured_module(name: str) -> bool:
    """The modules whose outputs ``bigtrain check`` compares: the embedding, each block, the final
    norm and the head (whole hidden states or logits, which any layout's pieces assemble into)."""
    parts = name.split(".")
    return name in ("model.embed_tokens", "model.norm", "lm_head") or (
        len(parts) == 3 and parts[:2] == ["model", "layers"])


def transformers_model(config_json: str | Path) -> torch.nn.Module:
    """The model a config.json describes, built by transformers on the CPU in fp32 (sdpa attention;
    an MoE model's experts in transformers' own loop over experts: transformers 5 would otherwise
    take torch's grouped GEMM, which has no float64 for the tests' noise floor)."""
    import transformers

    path = Path(config_json).expanduser()
    path = path / "config.json" if path.is_dir() else path
    fields = json.loads(path.read_text())
    for key in ("torch_dtype", "dtype"):
        fields.pop(key, None)
    conf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    loop = {"experts_implementation": "eager"} if sparse_blocks(conf) is not None and transformers_major() >= 5 else {}
    return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32, **loop)


class HFReference:
    """``train_step(capture)`` as :class:`bigtrain.check.reference.ReferenceRun`'s; ``dtype``
    float64 measures how far fp32's rounding alone moves each weight (the tests' noise floor)."""

    @staticmethod
    def problems(cfg: Config) -> list[str]:
        """What this reference does not state (``bigtrain check`` refuses it before launch)."""
        out = []
        if cfg.precision.mode not in MODES:
            out.append(f"precision.mode = '{cfg.precision.mode}': the Hugging Face reference trains in fp32 or bf16 "
                       f"(fp16's loss scaling is not stated here)")
        if cfg.optim.name != "adamw":
            out.append(f"optim.name = '{cfg.optim.name}': the Hugging Face reference steps with AdamW only")
        return out

    @classmethod
    def exact(cls, cfg: Config, device: torch.device | str = "cpu") -> "HFReference":
        """The same loop in float64: ``bigtrain check``'s measure of fp32's own rounding."""
        return cls(cfg, device, torch.float64)

    def __init__(self, cfg: Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if self.problems(cfg):
            raise ValueError("; ".join(self.problems(cfg)))
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.model = transformers_model(cfg.model.hf_config).to(dtype)  # the master weights (fp32)
        self.blocks = sparse_blocks(self.model.config)  # None for a dense model
        std = self.model.config.initializer_range
        folder = hf_folder(cfg.model.init_from)
        if folder is not None:  # the run starts from these, not the seed's (the check compared a random init)
            initial = SafetensorsWeights(folder)
        else:  # drawn on the CPU by their names in a checkpoint file, as the trainer's
            initial = lambda name, shape: init_value(name, shape, cfg.train.seed, std)  # noqa: E731
        with torch.no_grad():
            for name, p in file_views(dict(self.model.named_parameters()), self.blocks).items():
                p.copy_(initial(name, tuple(p.shape)))
        # bf16: the forward and backward run on a bf16 copy of the weights (the rotary tables, buffers,
        # stay fp32), whose gradients are summed into the fp32 masters, as ZeRO's mixed precision does.
        # ZeRO-Offload's one-step delayed update (offload.delayed_update): step t computes at the
        # weights from before step t - 1's update, W(t + 1) = W(t) - lr(t) * g(W(t - 1)) (steps 0 and
        # 1 at W(0)), so the computing copy is apart from the masters in fp32 too and takes their
        # values just before each step, one update behind.
        self.mixed = MODES[cfg.precision.mode] is not None
        self.delayed = cfg.offload.delayed_update
        apart = self.mixed or self.delayed
        self.compute = parameters_in(self.model, MODES[cfg.precision.mode] or dtype) if apart else self.model
        if cfg.memory.activation_compression == "int8":  # the rule stated again, not the trainer's wrapper
            int8_weight_gradients(self.compute.model.layers, None if cfg.model.fused_loss else self.compute.lm_head)
        if cfg.precision.fp8 != "none":  # float8 is part of the model under test (as in check/reference.py)
            convert_to_float8(self.compute, Float8Recipe(cfg.precision.fp8), "emulated", root="model.layers")
        self.model.to(self.device)
        self.compute.to(self.device)
        self.params = list(self.model.parameters())
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(decay_groups(self.params, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                           eps=o.eps)
        self.sampler = run_sampler(cfg)
        self.boundaries = boundary_ids(cfg.data) if cfg.model.attn_mask == "block_causal" else None
        self.step = 0

    def learning_rate(self, step: int) -> float:
        return reference_learning_rate(self.cfg, step)

    def train_step(self, capture: bool = False) -> ReferenceStep:
        t = self.cfg.train
        tokens, targets = self.sampler.batch(self.step, 0, t.global_batch)
        counted = max(1, int((targets != IGNORED).sum()))
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        captured = captured_module if capture else (lambda name: False)
        with recorded_outputs(self.compute, captured, lambda out: out.float()) as outputs:
            loss_sum = next_token_loss_backward(lambda ids: self._logits(ids, outputs), tokens, targets,
                                                t.micro_batch, counted, self.dtype, masters=self.model, low=self.compute)
        for p in self.params:
            # An expert no token of the step reached has no gradient (autograd leaves it None) and
            # torch's AdamW would skip it: no decay, no moment update. Its gradient is zero, which
            # is what the trainer's stacked banks (and any flat-buffer engine) step with.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = from_transformers_names(file_views({n: p.grad.detach().float().cpu().clone() for n, p in
                                                    self.model.named_parameters() if capture and p.grad is not None},
                                                   self.blocks), self.blocks)
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        if self.delayed:  # the next step computes at the weights from before this update
            copy_masters_to(self.compute, self.model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.compute is not self.model and not self.delayed:
            copy_masters_to(self.compute, self.model)
        self.step += 1
        result = ReferenceStep(loss=loss_sum / counted, grad_norm=norm, skipped=False, grads=grads)
        if capture:
            result.outputs = {name: torch.cat(parts) for name, parts in outputs.items()}
            result.weights = self.weights()
        return result

    def _logits(self, ids: torch.Tensor, outputs: dict) -> torch.Tensor:
        """transformers' logits of a micro-batch; block-causal (model.attn_mask) as each document
        run alone, a sequence of its own at its position (core/reference_documents.py): transformers'
        own causal attention, no mask of bigtrain's. Its MoE blocks route each token alone (no
        capacity), so a document alone routes as in the window."""
        if self.boundaries is None:
            return self.compute(input_ids=ids).logits

        def alone(doc: torch.Tensor, first: int) -> torch.Tensor:
            positions = torch.arange(first, first + doc.shape[1], device=doc.device)[None]
            return self.compute(input_ids=doc, position_ids=positions).logits

        starts, ends = self.boundaries
        return each_document_alone(alone, ids, starts, ends, self.cfg.model.reset_positions,
                                   lambda pieces: join_pieces(outputs, pieces))

    @torch.no_grad()
    def at_weights(self, weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> bool:
        """Set the master weights to ``weights`` (full tensors under the trainer's names, a
        layout's) so that the next step computes its gradient at them; whether it will: not with the
        delayed update (it computes at the weights from before the last update), nor where
        ``weights`` lacks one of the model's, nor where the layout holds model state outside them
        (``buffers``: transformers' models keep no such state a step moves, so none is placed)."""
        views = file_views(dict(self.model.named_parameters()), self.blocks)
        theirs = to_transformers_names(weights, self.blocks)
        if buffers or self.delayed or any(name not in theirs for name in views):
            return False
        for name, view in views.items():
            view.copy_(theirs[name].reshape(view.shape))
        if self.compute is not self.model:
            copy_masters_to(self.compute, self.model)
        return True

    def weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The master weights, on the CPU, under the trainer's names."""
        return from_transformers_names(file_views({n: p.detach().to(dtype).cpu().clone() for n, p in
                                                   self.model.named_parameters()}, self.blocks), self.blocks)


def parameters_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are in ``dtype`` and whose buffers are as they were (a
    tied weight stays one parameter: ``parameters()`` lists it once)."""
    low = copy.deepcopy(model)
    for p in low.parameters():
        p.data = p.data.to(dtype)
    return low


@dataclass
class HFReferenceRun:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step, by name, fp32
    weights64: dict[str, torch.Tensor] = field(default_factory=dict)  # the same in float64 (dtype=float64)


def reference_hf(cfg: Config, steps: int, dtype: torch.dtype = torch.float32) -> HFReferenceRun:
    """``steps`` optimizer steps of ``cfg`` (model.family = 'hf') in this process."""
    run, out = HFReference(cfg, dtype=dtype), HFReferenceRun()
    for _ in range(steps):
        step = run.train_step()
        out.losses.append(step.loss)
        out.grad_norms.append(step.grad_norm)
    out.weights = run.weights()
    if dtype != torch.float32:
        out.weights64 = run.weights(dtype)
    return out
