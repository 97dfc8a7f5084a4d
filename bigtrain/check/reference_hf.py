"""The independent reference for the Hugging Face family: the transformers model itself, trained in
one plain process.

It shares with the trainer only the model (the same ``config.json``, built by transformers; the
same initial values, by seed and name: :func:`bigtrain.models.hf_causal_lm.init_value`) and the
data sampler. Everything else is written again here: the model is called as transformers calls
it (``model(input_ids).logits``; no bigtrain adapter, no meta build, no plan), the loss is the
summed cross-entropy over the global batch divided by its counted targets, the gradient is
clipped by ``torch.nn.utils.clip_grad_norm_`` and the step is ``torch.optim.AdamW`` at the
reference schedule (:class:`bigtrain.check.reference.ReferenceRun`'s). fp32 only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bigtrain.check.reference import ReferenceRun
from bigtrain.config import Config
from bigtrain.data import TokenSampler, load_corpus
from bigtrain.models.hf_causal_lm import init_value


@dataclass
class HFReferenceRun:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step, by HF name (fp32)
    weights64: dict[str, torch.Tensor] = field(default_factory=dict)  # the same in float64 (dtype=float64)


def transformers_model(config_json: str | Path) -> torch.nn.Module:
    """The model a config.json describes, built by transformers on the CPU in fp32 (sdpa attention)."""
    import transformers

    path = Path(config_json)
    path = path / "config.json" if path.is_dir() else path
    fields = json.loads(path.read_text())
    conf = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32)


def reference_hf(cfg: Config, steps: int, dtype: torch.dtype = torch.float32) -> HFReferenceRun:
    """``steps`` optimizer steps of ``cfg`` (model.name = 'hf') in this process; ``dtype``
    float64 measures how far fp32's rounding alone moves each weight (the tests' noise floor)."""
    if cfg.precision.mode != "fp32":
        raise ValueError("the Hugging Face reference trains in fp32 only")
    model = transformers_model(cfg.model.hf_config).to(dtype)
    std, seed = model.config.initializer_range, cfg.train.seed
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(name, tuple(p.shape), seed, std))
    params = list(model.parameters())
    o = cfg.optim
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    schedule = ReferenceRun.learning_rate  # reads only self.cfg
    holder = type("Schedule", (), {"cfg": cfg})()
    d, t = cfg.data, cfg.train
    sampler = TokenSampler(load_corpus(d), d.seq_len, t.global_batch, t.seed, d.ignore_target, d.val_fraction)
    out = HFReferenceRun()
    for step in range(steps):
        tokens, targets = sampler.batch(step, 0, t.global_batch)
        counted = max(1, int((targets != -100).sum()))
        loss_sum = 0.0
        for first in range(0, tokens.shape[0], t.micro_batch):
            logits = model(input_ids=tokens[first:first + t.micro_batch]).logits
            loss = F.cross_entropy(logits.to(dtype).flatten(0, 1), targets[first:first + t.micro_batch].flatten(),
                                   reduction="sum")
            loss_sum += float(loss.detach())
            (loss / counted).backward()
        max_norm = o.grad_clip if o.grad_clip > 0 else float("inf")
        out.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        for group in optimizer.param_groups:
            group["lr"] = schedule(holder, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.losses.append(loss_sum / counted)
    out.weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    if dtype != torch.float32:
        out.weights64 = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
