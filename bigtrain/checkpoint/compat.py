"""What a resumed run may change of the run that wrote its checkpoint.

A checkpoint's manifest holds the whole config it was written under. A resumed run compares its
own config with it, field by field:

- the fields that give the parameters their shapes (and the model its meaning): a checkpoint of
  another architecture cannot serve the run. Loading by name would fill what matches and drop or
  leave the rest (a 4-layer checkpoint "loaded" into 2 layers): an error naming each field.
- the data, the learning-rate schedule and the optimizer's settings: the checkpoint serves, but the
  run no longer continues the loss curve it was on. A warning naming each field and what changes.
- the layout (parallel.*), precision, logging, checkpointing, timeouts: free; checkpoints reshard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bigtrain.config import Config, ModelConfig, canonical_keys
from bigtrain.core.tables import ROW_STATE_OPTIMIZERS, parse_sizes
from bigtrain.optim import get_optimizer  # plain data: imports no torch

# The model's parameter shapes (compared on effective values: ffn_hidden 0 means a computed size).
SHAPE_FIELDS = ("model.family", "model.family_module", "model.vocab_size", "model.dim", "model.n_layers",
                "model.n_heads", "model.n_kv_heads", "model.ffn_hidden", "model.tie_embeddings", "model.attention_head_dim",
                "model.attention_bias", "model.qkv_bias", "model.mlp_bias", "model.qk_norm",
                "model.moe_experts",
                # DLRM: its tables (rows each, compared as a list: '2x10' is '10,10') and MLPs
                "embedding.tables", "embedding.dim", "model.dlrm_dense_features", "model.dlrm_bottom_mlp",
                "model.dlrm_top_mlp")
# The experts' shapes (their blocks, MLP size, a shared expert, the router's bias), compared where both
# the checkpoint and the run have experts (in a dense model they mean nothing).
EXPERT_FIELDS = ("model.moe_every", "model.moe_dense_layers", "model.moe_ffn_hidden", "model.moe_shared_expert",
                 "model.moe_shared_expert_hidden", "model.moe_shared_expert_gate", "model.moe_router")
# The shape fields whose 0 means a size computed from other fields, and those fields: where the
# field's own value is unchanged (0 in both) but its size moved, it follows from them, and the
# message names the field the user changed, with this one shown as following from it.
DERIVED_FROM = {
    "model.n_kv_heads": ("model.n_heads",),
    "model.ffn_hidden": ("model.dim",),
    "model.attention_head_dim": ("model.dim", "model.n_heads"),
    "model.moe_ffn_hidden": ("model.ffn_hidden",),
    "model.moe_shared_expert_hidden": ("model.moe_ffn_hidden",),
}
CHANGES = {
    "model.rope_theta": "the positional encoding the weights were trained with",
    "model.norm_eps": "the normalization the weights were trained with",
    "model.max_seq_len": "the rotary tables",
    **{f"model.{name}": "the rotary frequencies the weights were trained with" for name in (
        "rope_scaling", "rope_factor", "rope_original_max_len", "rope_low_freq_factor", "rope_high_freq_factor",
        "rope_beta_fast", "rope_beta_slow", "rope_attention_factor")},
    "model.attn_mask": "what each token attends to (its whole window, or its own document)",
    "model.reset_positions": "the rotary positions of the tokens after a document's first",
    "data.tokenizer": "the token ids the embedding rows stand for",
    "data.text_field": "the text the run trains on",
    "data.source": "the data the run trains on",
    "data.seq_len": "the sequences the run trains on (and the activations' shapes)",
    "data.max_bytes": "the corpus the run samples from",
    "data.ignore_target": "which targets count in the loss",
    "data.document_end": "the tokens the run trains on (a token between documents, or none)",
    "data.val_fraction": "the training part and the held-out slice (a smaller one trains on tokens earlier "
                         "evaluations held out; eval_loss before and after differ) and the order of the data "
                         "from here on",
    "data.val_source": "the held-out data (eval_loss before and after differ)",
    "data.blend": "the corpora the run trains on and the order of the data from here on",
    "train.seed": "the order of the data from here on",
    "train.global_batch": "the data per step and the learning rate's meaning",
    "train.steps": "the learning-rate schedule: its decay ends at the new step count",
    "optim.lr": "the learning-rate schedule",
    "optim.min_lr_ratio": "the learning-rate schedule",
    "optim.schedule": "the learning-rate schedule",
    "optim.decay_fraction": "the learning-rate schedule (with optim.schedule = 'wsd')",
    "optim.warmup_steps": "the learning-rate schedule",
    "optim.lr_scaling": "the learning-rate schedule",
    "optim.base_batch": "the learning-rate schedule (with optim.lr_scaling)",
    "optim.weight_decay": "the optimizer's update",
    "optim.beta1": "the optimizer's update",
    "optim.beta2": "the optimizer's update",
    "optim.eps": "the optimizer's update",
    "optim.grad_clip": "the optimizer's update",
    "optim.adafactor_decay": "the optimizer's update",
    "optim.adafactor_clip": "the optimizer's update",
    "optim.adafactor_eps": "the optimizer's update",
    "model.moe_top_k": "the routing of tokens to the experts",
    "model.moe_capacity_factor": "the routing of tokens to the experts (which ones are dropped)",
    "model.moe_aux_loss_coef": "the experts' load-balancing loss",
    "embedding.hotness": "the ids per sample the run trains on",
    "embedding.optimizer": "the tables' optimizer (their per-row state is dropped)",
    "embedding.lr": "the tables' optimizer's update",
    "embedding.eps": "the tables' optimizer's update",
}
# The rest of the model, data, train, optim and embedding fields, free on resume, and why: a new
# field goes in one of the three (tests/test_resume_safety.py checks that each field is in one).
FREE_FIELDS = {
    "model.hf_config": "the file's shapes are compared through the checkpoint's entries (resume.check_same_entries)",
    "model.init_std": "a resumed run starts from its checkpoint, not an init",
    "model.init_from": "a resumed run starts from its checkpoint, not an init",
    "model.fused_loss": "the same loss, computed in chunks", "model.fused_loss_chunk": "the same loss",
    "model.attention": "the same attention, computed by sdpa's dense mask or FlexAttention's tiles",
    "data.cache_dir": "where the same tokens are cached",
    "train.micro_batch": "the same global batch, accumulated differently", "train.device": "where it computes",
    "train.max_bad_steps": "the NaN policy",
    "train.eval_every": "evaluation only", "train.eval_batches": "evaluation only",
    "optim.name": "compared on its own (the checkpoint's optimizer state must be the run's)",
    "optim.block_size": "compared on its own for an optimizer with per-block state",
    "embedding.sharding": "a layout: checkpoints reshard", "embedding.budget_gb": "the planner's memory budget",
}


def _model(values: dict[str, Any]) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in values.items() if k in known})


def _effective(section: str, name: str, values: dict[str, Any]) -> Any:
    if section == "embedding" and name == "tables" and isinstance(values.get(name), str):
        return parse_sizes(values[name])
    if section == "model" and name in ("n_kv_heads", "ffn_hidden"):
        model = _model(values)
        return model.kv_heads if name == "n_kv_heads" else model.ffn_dim
    if section == "model" and name.startswith("moe_"):
        model = _model(values)  # a checkpoint older than a field has its default
        if name == "moe_shared_expert_hidden":  # its size when there is one: 0 means the expert size
            return model.moe_shared_ffn_dim if model.moe_shared_expert else 0
        if name == "moe_dense_layers":  # '1,0' is '0,1'
            return tuple(sorted(set(model.moe_dense_blocks)))
        return model.moe_ffn_dim if name == "moe_ffn_hidden" else getattr(model, name)
    if section == "model" and name == "family_module":  # the module that registers a family of one's own
        return (values.get(name) or "").strip()  # a checkpoint older than the field: none
    if section == "model" and name in ("attention_head_dim", "attention_bias", "qkv_bias", "mlp_bias", "qk_norm"):
        model = _model(values)  # a checkpoint older than these fields has their defaults
        return model.head_dim if name == "attention_head_dim" else getattr(model, name)
    return values.get(name)


def compare_configs(saved: dict[str, dict[str, Any]], run: Config, where: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for resuming ``run`` from a checkpoint written under config ``saved``
    (a ``Config.to_dict()``); ``where`` names the checkpoint in the messages."""
    current = run.to_dict()
    # An older manifest spells model.family model.name: read under the field's name.
    saved = {section: canonical_keys(section, values, f"the checkpoint {where}") if isinstance(values, dict)
             else values for section, values in saved.items()}
    errors, changes = _shape_errors(saved, current, where), []
    for dotted, what in CHANGES.items():
        section, name = dotted.split(".")
        if name not in saved.get(section, {}):
            continue  # a field newer than the checkpoint: nothing to compare
        before, after = saved[section][name], current[section][name]
        if before != after:
            changes.append(f"{dotted} = {after!r} differs from the checkpoint's {before!r}: this changes {what}")
    if errors:
        errors.append("a checkpoint of another model cannot serve this run: resume with the run's own model "
                      "settings (bigtrain train --output-dir RUN --resume reads RUN/config.toml), or start a "
                      "new run in another --output-dir")
    optim = saved.get("optim", {})
    return (errors + _optimizer_errors(optim, run, where) + _block_errors(optim, run, where)
            + _table_state_errors(saved.get("embedding", {}), run, where)), changes


def _shape_errors(saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], where: str) -> list[str]:
    """One line per shape field the run changed. A field computed from others (ffn_hidden 0: from
    dim) whose size moved only because they did is shown after the field it follows from, not as a
    change of its own: the user set model.dim, not model.ffn_hidden."""
    experts = _effective("model", "moe_experts", saved.get("model", {})) and current["model"]["moe_experts"]
    moved = {}  # dotted -> (before, after), in SHAPE_FIELDS order
    for dotted in SHAPE_FIELDS + (EXPERT_FIELDS if experts else ()):
        section, name = dotted.split(".")
        before = _effective(section, name, saved.get(section, {}))
        after = _effective(section, name, current[section])
        if before != after:
            moved[dotted] = (before, after)

    def set_the_same(dotted: str) -> bool:  # the field's own value (0: computed) is the checkpoint's
        section, name = dotted.split(".")
        default = getattr(ModelConfig(), name)  # a checkpoint older than the field has its default
        return saved.get(section, {}).get(name, default) == current[section][name]

    def cause(dotted: str) -> str | None:  # the changed field a computed size follows from
        if dotted not in DERIVED_FROM or not set_the_same(dotted):
            return None
        for source in DERIVED_FROM[dotted]:
            if source in moved:
                return cause(source) or source
        return None

    follows: dict[str, list[str]] = {}
    for dotted in moved:
        if (root := cause(dotted)) is not None:
            follows.setdefault(root, []).append(dotted)
    shown_after = {d for derived in follows.values() for d in derived}
    lines = []
    for dotted, (before, after) in moved.items():
        if dotted in shown_after:
            continue
        line = f"{dotted} = {after!r}, but the checkpoint {where} was written with {dotted} = {before!r}"
        if dotted in follows:
            line += " (and so " + ", ".join(f"{d} {moved[d][0]!r} -> {moved[d][1]!r}" for d in follows[dotted]) + ")"
        lines.append(line)
    return lines


def _optimizer_errors(saved: dict[str, Any], run: Config, where: str) -> list[str]:
    """A checkpoint's optimizer state serves only the optimizer that wrote it. The ranks refuse
    another (from the manifest's "optimizer"), but only once launched, each rank printing it: the
    checks before launch say it too."""
    name = saved.get("name")
    if name is None or name == run.optim.name:
        return []
    return [f"optim.name = '{run.optim.name}', but the checkpoint {where} holds {name}'s optimizer state; resume "
            f"with optim.name = '{name}', or start a new run in another --output-dir"]


def _table_state_errors(saved: dict[str, Any], run: Config, where: str) -> list[str]:
    """Tables saved by an optimizer without per-row state (SGD) hold none for one that keeps it
    (row-wise Adagrad's accumulators): the ranks' load finds it missing and gives up every checkpoint
    as broken. The other way the state is dropped (a warning, CHANGES)."""
    name, now = saved.get("optimizer"), run.embedding.optimizer
    if name is None or name == now or now not in ROW_STATE_OPTIMIZERS or name in ROW_STATE_OPTIMIZERS:
        return []
    return [f"embedding.optimizer = '{now}', but the checkpoint {where} was written with embedding.optimizer = "
            f"'{name}', which keeps no per-row state for it to go on from; resume with embedding.optimizer = "
            f"'{name}', or start a new run in another --output-dir"]


def _block_errors(saved: dict[str, Any], run: Config, where: str) -> list[str]:
    """An optimizer whose state is kept per block (8-bit AdamW's scales, one per optim.block_size
    elements) cannot be read in other blocks: the checkpoint would load, each scale applied to the
    wrong elements."""
    name, block = run.optim.name, saved.get("block_size")
    if saved.get("name") != name or block is None or block == run.optim.block_size \
            or not get_optimizer(name).block_state:
        return []
    return [f"optim.block_size = {run.optim.block_size}, but the checkpoint {where} holds {name}'s state in blocks "
            f"of {block} (one scale per block: read in other blocks, each would scale the wrong elements); "
            f"resume with optim.block_size = {block}"]
