"""What a family of one's own (registered with ``register_family``, ``Family.llama_fallbacks``
False) gets by default and is refused: the Trainer's decoder step (tokens in, logits out, the
summed next-token cross-entropy), token batches and data checked as any decoder's, (seed, name)
initial values, and, for each slot it leaves None, a refusal before launch of what needs the slot,
naming it (where bigtrain's Llama's implementation would otherwise have run on another model).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from bigtrain.config import Config
from bigtrain.families.spec import Family, InitFn, vocabulary_of
from bigtrain.families.tokens import token_batch_problems, token_data_problems

if TYPE_CHECKING:
    from torch import nn


def owns_slots(family: Family) -> bool:
    """A decoder of one's own on the Trainer's step: its None slots mean none, not Llama's."""
    return not family.llama_fallbacks and family.own_step is None


def none_for(family: Family, slot: str, what: str, fix: str) -> str:
    """The one way a missing slot is said: what needed it, that the family has none, the fix."""
    return (f"{what}: none for this family (model.family = '{family.name}' has no Family.{slot}); {fix}, or give "
            f"the family a {slot} (docs/families.md, 'A family of your own')")


def own_step_unpriced(family: Family, what: str) -> str:
    """Why ``what`` (bigtrain plan, --parallel auto), whose planner prices decoders, cannot price a
    family with its own step (Family.own_step): said the same by both. A family with a planner of
    its own (Family.plan_command) is priced by ``bigtrain plan --config``."""
    why = (f"{what} prices decoders (bigtrain's Llama of their shapes), and model.family = '{family.name}' trains "
           f"by its own step")
    by_hand = "choose its layout by hand (parallel.dp, parallel.zero)"
    if family.plan_command is not None:
        return (f"{why}: its own planner (Family.plan_command) prices it, run by bigtrain plan --config; "
                f"{by_hand}")
    return none_for(family, "plan_command", why, by_hand)


def slot_problems(cfg: Config, family: Family) -> list[str]:
    """The layouts and features ``cfg`` asks for that need a slot ``family`` leaves None."""
    p, m, mem = cfg.parallel, cfg.model, cfg.memory
    problems = []
    if family.tp_plan is None and p.tp > 1:
        problems.append(none_for(family, "tp_plan", f"parallel.tp = {p.tp} (tensor parallelism cuts the modules by "
                                 f"the family's plan of styles)", "set parallel.tp = 1"))
    if p.sp > 1:  # whatever its tp_plan: a plan that ignored `ulysses` would attend within each shard, silently
        problems.append(f"parallel.sp = {p.sp}: Ulysses attention is built for bigtrain's Llama and the hf family's "
                        f"attention (an all-to-all around it), not for model.family = '{family.name}': set "
                        f"parallel.sp = 1")
    if family.split_stages is None and p.pp > 1:
        problems.append(none_for(family, "split_stages", f"parallel.pp = {p.pp} (pipeline stages)",
                                 "set parallel.pp = 1"))
    if p.ep > 1 and m.moe_experts > 0:  # without experts the generic rule says so already
        problems.append(f"parallel.ep = {p.ep}: expert parallelism shards bigtrain's own MoE blocks; "
                        f"model.family = '{family.name}' has none of them: set parallel.ep = 1")
    if family.blocks is None:
        needs = [(f"memory.checkpointing = '{mem.checkpointing}' (recomputation, block by block)",
                  "set memory.checkpointing = 'none'") if mem.checkpointing in ("full", "every") else None,
                 ("memory.activation_offload = true (the blocks' saved tensors)",
                  "set memory.activation_offload = false") if mem.activation_offload else None,
                 # Without block_linears validation refuses these two already (check_block_linears).
                 (f"precision.fp8 = '{cfg.precision.fp8}' (the blocks' linear layers)",
                  "set precision.fp8 = 'none'") if family.block_linears and cfg.precision.fp8 != "none" else None,
                 (f"memory.activation_compression = '{mem.activation_compression}' (the blocks' linear inputs)",
                  "set memory.activation_compression = 'none'")
                 if family.block_linears and mem.activation_compression != "none" else None]
        problems += [none_for(family, "blocks", what, fix) for what, fix in filter(None, needs)]
    if mem.checkpointing == "selective":
        problems.append(f"memory.checkpointing = 'selective' recomputes the parts of bigtrain's Llama blocks by "
                        f"name; model.family = '{family.name}' has other blocks: use 'full' or 'every'")
    if family.head is None:
        if m.fused_loss:
            problems.append(none_for(family, "head", "model.fused_loss = true (the output projection computed in "
                                     "the loss)", "set model.fused_loss = false"))
        if family.block_linears and mem.activation_compression != "none":
            problems.append(none_for(family, "head", f"memory.activation_compression = "
                                     f"'{mem.activation_compression}' (it keeps the head's input)",
                                     "set memory.activation_compression = 'none'"))
    if family.init_fn is None and m.init_from:
        problems.append(none_for(family, "init_fn", f"model.init_from = {m.init_from!r} (reading initial weights "
                                 f"from a folder is the family's init_fn's to do)", "set model.init_from = ''"))
    return problems


def decoder_problems(cfg: Config, family: Family) -> list[str]:
    """The rules every decoder of one's own shares: whole sequences in micro-batches that divide
    the global batch over dp, and a corpus of the model's vocabulary within model.max_seq_len."""
    if not family.reads_tokens:
        return []
    vocab, field = vocabulary_of(family, cfg)
    return token_batch_problems(cfg) + token_data_problems(cfg, vocab, cfg.model.max_seq_len, field)


def own_family_problems(cfg: Config, family: Family) -> list[str]:
    """Validation's rules for a family of one's own (after its own check_config)."""
    return decoder_problems(cfg, family) + slot_problems(cfg, family) if owns_slots(family) else []


NORMS = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d")


def seeded_init(cfg: Config, model: "nn.Module") -> InitFn:
    """Initial values by (train.seed, name) alone, the same on every rank and layout: a norm's
    weight one, every bias zero, every other weight normal with model.init_std (bigtrain's Llama's
    and the Hugging Face family's draw). The model's types say which parameters are norms' weights,
    since a family of one's own names them as it likes (GPT-2's ``ln_1``)."""
    import torch

    norm_weights = {f"{name}.weight" if name else "weight" for name, module in model.named_modules()
                    if type(module).__name__ in NORMS}
    seed, std = cfg.train.seed, cfg.model.init_std

    def init_fn(name: str, shape: tuple) -> torch.Tensor:
        if name in norm_weights:
            return torch.ones(shape)
        if name == "bias" or name.endswith(".bias"):
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen) * std

    return init_fn


def initial_values(family: Family, cfg: Config, model: "nn.Module") -> InitFn | None:
    """Each parameter's (and computed buffer's) full initial value by name, as the Trainer gives it
    to ``parallelize`` and ``bigtrain check``'s reference of a family of one's own draws it (one
    function, so the two cannot start apart): the family's ``init_fn``; else, for a model with its
    own ``initial_value`` (bigtrain's Llama) or a built-in decoder, model.init_from's weights, None
    without it (then ``model.initial_value(name, shape, train.seed)``); else :func:`seeded_init`."""
    if family.init_fn is not None:
        return family.init_fn(cfg, model)
    if family.llama_fallbacks or hasattr(model, "initial_value"):
        from bigtrain.checkpoint.hf import initial_weights  # torch: validation imports this module

        return initial_weights(cfg.model)
    return seeded_init(cfg, model)  # a family of one's own (validation refused model.init_from for it)


def parameter_count(family: Family, cfg: Config) -> int:
    """The whole model's parameters (each tied weight once), from its family's slot, else counted on
    the meta device."""
    if family.parameter_count is not None:
        return family.parameter_count(cfg)
    model = family.build_meta(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
