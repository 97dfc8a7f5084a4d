"""bigtrain's own decoder (:mod:`bigtrain.models.llama`), dense or with MoE blocks: the reference
model every layout was built around, so most of its slots are the defaults."""

from __future__ import annotations

import dataclasses

from bigtrain.config import Config, ModelConfig
from bigtrain.families.spec import Family
from bigtrain.families.tokens import token_batch_problems, token_data_problems
from bigtrain.model_fields import llama_field_problems


# The model's modules (torch) are imported when a model is built, not with the family: validating a
# config (bigtrain config) imports no torch.
def build_meta(cfg: Config):
    from bigtrain.models.llama import build_model

    return build_model(cfg.model)


def parameter_count(cfg: Config) -> int:
    from bigtrain.models.llama import build_model, count_parameters

    return count_parameters(build_model(cfg.model))


def attach_context_parallel(*args, **kwargs) -> list:
    from bigtrain.parallel.context import attach_to_cores

    return attach_to_cores(*args, **kwargs)


def check_llama(cfg: Config) -> list[str]:
    m = cfg.model
    fixed_by = ""
    if m.init_from.startswith("hf:"):  # its config.json sets the [model] shape, max_seq_len too
        from bigtrain.checkpoint.hf import hf_folder  # imports torch: only for a run that starts from a folder

        fixed_by = f"model.init_from's {hf_folder(m.init_from) / 'config.json'} (max_position_embeddings)"
    return (token_batch_problems(cfg) + token_data_problems(cfg, m.vocab_size, m.max_seq_len, seq_fixed_by=fixed_by)
            + llama_field_problems(cfg))  # head size, rotary scaling, biases


LLAMA = Family(
    name="llama",
    summary="the decoder (the [model] fields: dim, n_layers, heads, rotary, MoE)",
    check_config=check_llama,
    build_meta=build_meta,
    # init_fn None: model.init_from's weights, else the model's own initial_value (by seed and name)
    parameter_count=parameter_count,
    model_fields=True,
    model_keys=tuple(f.name for f in dataclasses.fields(ModelConfig)
                     if f.name != "hf_config" and not f.name.startswith("dlrm_")),
    compiles=True,
    document_mask=True,  # Llama.forward(documents=, positions=): AttentionCore's block-causal mask
    ring_documents=True,  # RingAttention takes DocumentIds in its AttentionCore's place
    flex_attention=True,  # AttentionCore: a BlockMask goes to FlexAttention (bigtrain/models/flex.py)
    block_linears=True,
    context_parallel=attach_context_parallel,  # ring or all-to-all around its AttentionCore modules
    head="output",
    final_norm="norm",
    llama_fallbacks=True,  # the implementations the None slots fall back to are its own
)
