"""Hugging Face decoders (``model.family = "hf"``): a local ``config.json`` (``model.hf_config``; no
hub access) of a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM``,
built by transformers (an optional dependency) on the meta device, initialized by (seed, name), cut
by the Megatron plan below and trained by bigtrain's Trainer. Parameter names are transformers' own, so a checkpoint exports to
a folder ``from_pretrained`` reads; but for the sparse-MoE blocks, which are bigtrain's own MoE block
(experts over ``parallel.ep`` included) under names converted once: bigtrain/families/hf_moe.py.

Supported layouts, fp32 or bf16: dp with ZeRO 0-3, tp (+ sequence parallelism without pipeline
stages; key/value heads fewer than tp replicated), Ulysses sp (with any of those and pp:
bigtrain/families/hf_attention.py, whose causal function every layer attends through), pp
(one stage per rank, 1f1b or gpipe: bigtrain/families/hf_stages.py), full or every-k-th
recomputation of the blocks, offload of the decoder layers' saved activations, regional
compilation of the layers (``compile.enabled``; 'auto' compiles on CUDA as for bigtrain's Llama),
the fused loss (``lm_head`` and the cross-entropy in chunks: memory/fused_loss.py), int8
compression of the decoder layers' linear inputs and float8 decoder-layer linears
(``precision.fp8``; both refused for the MoE architectures: they would take the router but not the
stacked experts); selective recomputation is refused by name (it reads bigtrain's own Llama
structure).

Context parallelism (``parallel.cp``: all-to-all, ring and hybrid, with dp/ZeRO, tp and pp) runs
through the family's own attention function too: bigtrain/families/hf_context.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch
from torch import nn

from bigtrain.checkpoint.hf import SafetensorsWeights, hf_folder, quantized_problem, weights_problem
from bigtrain.config import Config, ModelConfig
from bigtrain.families.spec import Family
from bigtrain.families.hf_attention import CAUSAL, register_attention, ulysses_problems, with_ulysses
from bigtrain.families.hf_context import attach_context_parallel, attention_window, context_problems
from bigtrain.families.hf_fields import dropout_problems, rotary_problems
from bigtrain.families.hf_moe import (MOE_ARCHITECTURES, MOE_DESCRIBED, MOE_SHAPE_KEYS, by_transformers_names,
                                      moe_problems, planner_moe_fields, sparse_blocks, swap_sparse_blocks,
                                      to_transformers_names)
from bigtrain.families.hf_reference import HFReference, captured_module
from bigtrain.families.hf_stages import split_causal_lm
from bigtrain.families.tokens import token_batch_problems, token_data_problems
from bigtrain.fp8.checks import kernel_shape_problems
from bigtrain.models.hf_causal_lm import CausalLM, init_value
from bigtrain.models.hf_moe import SparseMoE
from bigtrain.parallel.sequence_moe import SequencePartsOverSP, WholeSequenceOverTP
from bigtrain.parallel.tensor.entry_styles import EnterSequenceShards, PrepareKeywordInput, WholeSequenceEmbedding
from bigtrain.parallel.tensor.styles import (ColumnParallel, PartialGradient, PrepareInput, ReplicatedKVHeads,
                                             RowParallel, VocabParallelOutput)

NAME = "hf"
CONFIG_FILE = "config.json"
# architecture -> the model_type its config.json carries
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", **MOE_ARCHITECTURES}
# the architectures whose attention_bias puts biases on q, k, v and the output projection
ATTENTION_BIASED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# The layers attend through bigtrain's registered function (families/hf_attention.py: causal sdpa with
# no mask built by transformers); the reference runs transformers' own "sdpa".
ATTENTION = CAUSAL


def config_path(cfg: Config | ModelConfig) -> Path:
    """``model.hf_config``: a config.json, or the folder holding one."""
    model = cfg.model if isinstance(cfg, Config) else cfg
    path = Path(model.hf_config).expanduser()
    return path / CONFIG_FILE if path.is_dir() else path


def read_config(cfg: Config | ModelConfig) -> dict:
    return json.loads(config_path(cfg).read_text())


def architecture(fields: dict) -> str:
    """The ForCausalLM class a config.json describes (its ``architectures``, else its model_type)."""
    named = fields.get("architectures") or []
    if named:
        return named[0]
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    return by_type.get(fields.get("model_type", ""), f"model_type '{fields.get('model_type', '')}'")


def hf_config(cfg: Config | ModelConfig):
    """The transformers config object of ``model.hf_config`` (fp32, bigtrain's attention choice)."""
    import transformers  # optional: only runs of this family need it

    fields = read_config(cfg)
    model_type = ARCHITECTURES[architecture(fields)]
    for key in ("torch_dtype", "dtype", "model_type"):  # bigtrain keeps fp32 masters
        fields.pop(key, None)
    conf = transformers.AutoConfig.for_model(model_type, **fields)
    conf.use_cache = False
    return conf


def causal_lm(cfg: Config | ModelConfig, device: str) -> CausalLM:
    """The whole model built by transformers on ``device`` in fp32, its sparse-MoE blocks (if any)
    bigtrain's (families/hf_moe.py)."""
    import transformers

    conf = hf_config(cfg)
    register_attention()
    with torch.device(device):
        built = getattr(transformers, architecture(read_config(cfg)))._from_config(
            conf, attn_implementation=ATTENTION, dtype=torch.float32)
    blocks = sparse_blocks(conf)
    if blocks is not None:
        swap_sparse_blocks(built, blocks)
    return CausalLM(built)


def build_meta(cfg: Config) -> CausalLM:
    """The whole model on the meta device: no memory until ``parallelize`` materializes its part."""
    return causal_lm(cfg, "meta")


def generation_model(model: ModelConfig) -> tuple[CausalLM, int, int]:
    """``bigtrain generate``'s model: on the CPU, its rotary tables computed by transformers; the
    checkpoint's weights replace transformers' initial values."""
    built = causal_lm(model, "cpu")
    return built, built.config.vocab_size, built.config.max_position_embeddings


def init_fn(cfg: Config, model: nn.Module):
    """Each parameter's full initial value by name: ``model.init_from``'s safetensors (read one
    tensor at a time, lazily), else drawn by (seed, name); an expert bank's value is its experts'
    by their transformers names (families/hf_moe.py)."""
    folder = hf_folder(cfg.model.init_from)
    blocks = sparse_blocks(model.config)
    if folder is not None:
        return by_transformers_names(SafetensorsWeights(folder), blocks)
    std, seed = model.config.initializer_range, cfg.train.seed
    return by_transformers_names(lambda name, shape: init_value(name, shape, seed, std), blocks)


# The config.json fields that decide every parameter's name and shape.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias",
              *MOE_SHAPE_KEYS)  # qkv_bias: Qwen2-MoE's q, k and v biases
# An architecture's config fields that change nothing its weights compute: token ids, the random
# init, and training-only settings the family checks on model.hf_config's own values.
NOT_COMPUTED = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout",
                "output_router_logits", "router_aux_loss_coef", "router_jitter_noise")


# The fields a context extension changes on purpose (a longer max_position_embeddings, another
# rotary base or scaling: YaRN or ABF fine-tuning of a folder's weights): a difference in these
# alone is said before launch (:func:`init_from_position_changes`), not refused.
POSITION_KEYS = ("max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters")


def computed_fields(path: Path) -> dict:
    """The fields of the config.json at ``path`` that decide what its weights compute (rotary base and
    scaling, norm epsilon, activation, sliding windows, routing, shapes), as transformers resolves
    them: its architecture's defaults filled in, transformers 4's and 5's spellings made one. Raises
    ImportError without transformers."""
    import transformers

    generic = transformers.PretrainedConfig().to_dict()  # transformers' bookkeeping (dtype, version, labels)
    resolved = hf_config(ModelConfig(hf_config=str(path))).to_dict()
    return {k: v for k, v in resolved.items() if k not in generic and k not in NOT_COMPUTED}


def init_from_problems(cfg: Config, fields: dict) -> list[str]:
    """``model.init_from = "hf:PATH"``: a folder with safetensors of the model model.hf_config describes."""
    folder = hf_folder(cfg.model.init_from)
    where = cfg.model.init_from
    if folder is None:
        return [f"model.init_from = {where!r}: write 'hf:PATH' (a Hugging Face folder), or '' for a random init"]
    if not (folder / CONFIG_FILE).is_file():
        return [f"model.init_from = {where!r}: {folder} holds no {CONFIG_FILE} and *.safetensors; give a folder "
                f"that does (bigtrain export RUN OUT --format hf writes one)"]
    if missing := weights_problem(folder):
        return [f"model.init_from = {where!r}: {missing}"]
    try:
        theirs = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        return [f"model.init_from = {where!r}: cannot read {folder / CONFIG_FILE} ({e})"]
    if quantized := quantized_problem(theirs):
        return [f"model.init_from = {where!r}: {folder / CONFIG_FILE} has {quantized}"]
    ours, other = _compared_fields(cfg, fields, folder)
    differ = [k for k in sorted(set(ours) | set(other)) if ours.get(k) != other.get(k)]
    if architecture(theirs) != architecture(fields) or [k for k in differ if k not in POSITION_KEYS]:
        what = ", ".join(f"{k} {ours.get(k)!r} vs {other.get(k)!r}" for k in differ) or "the architecture"
        return [f"model.init_from = {where!r}: its {CONFIG_FILE} describes another model than model.hf_config "
                f"({what}); point model.hf_config at {folder / CONFIG_FILE}"]
    return []


def _compared_fields(cfg: Config, fields: dict, folder: Path) -> tuple[dict, dict]:
    """model.hf_config's and the init_from folder's fields that init_from compares: what their
    weights compute, as transformers resolves them (:func:`computed_fields`), for one architecture;
    else (another architecture, or no transformers: check_hf says so) the files' own shape fields."""
    theirs = json.loads((folder / CONFIG_FILE).read_text())
    if architecture(theirs) == architecture(fields) and architecture(fields) in ARCHITECTURES:
        # Not the shapes alone: a folder of equal shapes and another rope_theta, rms_norm_eps,
        # sliding_window or activation loaded silently into the model model.hf_config describes.
        try:
            return computed_fields(config_path(cfg)), computed_fields(folder / CONFIG_FILE)
        except ImportError:
            pass
    return ({k: fields.get(k) for k in SHAPE_KEYS}, {k: theirs.get(k) for k in SHAPE_KEYS})


def init_from_position_changes(cfg: Config) -> list[str]:
    """The positional fields (:data:`POSITION_KEYS`) in which model.hf_config differs from model.init_from's
    folder, otherwise the same model: the run trains the folder's weights with model.hf_config's
    positions (a context extension), said before launch; [] where they agree or the pair is refused."""
    folder = hf_folder(cfg.model.init_from)
    if cfg.model.family != "hf" or folder is None or init_from_problems(cfg, read_config(cfg.model)):
        return []
    ours, other = _compared_fields(cfg, read_config(cfg.model), folder)
    differ = [k for k in POSITION_KEYS if ours.get(k) != other.get(k)]
    if not differ:
        return []
    what = ", ".join(f"{k} {other.get(k)!r} -> {ours.get(k)!r}" for k in differ)
    return [f"model.init_from = {cfg.model.init_from!r}: model.hf_config changes the folder's positions ({what}): "
            f"its weights train with model.hf_config's (a context extension); to keep the folder's, point "
            f"model.hf_config at {folder / CONFIG_FILE}"]


def tp_plan(model: nn.Module, tp: int, sequence_parallel: bool, ulysses: bool) -> dict:
    """Megatron's layout on the Hugging Face names: q, k, v and the MLP's gate and up projections
    split by output (heads), o and down by input, vocabulary-parallel embedding and head. The
    embedding returns the whole sequence and the first block cuts it (parallel/tensor/entry_styles.py).
    Qwen3's per-head q/k norms see this rank's heads only: their gradients are partial over tp.
    Ulysses (``ulysses``): every layer's attention through bigtrain/families/hf_attention.py.
    Sparse-MoE blocks (families/hf_moe.py) are left whole on every tp rank, as bigtrain's Llama
    leaves its MoE blocks (they route the same whole hidden states: docs/moe.md), so no tp region
    surrounds them; where the sequence is cut they see it whole (sequence parallelism) or add the
    other parts' routing statistics (Ulysses), as parallel/sequence_moe.py does for the Llama."""
    sparse = [name for name, m in model.named_modules() if isinstance(m, SparseMoE)]
    whole_sequences = {f"{name}.moe": [WholeSequenceOverTP(), SequencePartsOverSP()]
                       for name in sparse if (tp > 1 and sequence_parallel) or ulysses}
    if tp == 1:
        return with_ulysses(whole_sequences) if ulysses else whole_sequences
    conf = model.config
    heads = conf.num_attention_heads
    kv_heads = conf.num_key_value_heads or heads
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // heads  # Qwen3 gives its own
    # More ranks than key/value heads (a divisor of tp): each rank keeps the whole k and v
    # projections and uses the head its query heads attend to, as bigtrain's Llama does.
    kv = ColumnParallel() if kv_heads % tp == 0 else ReplicatedKVHeads(heads, kv_heads, head_dim)
    plan = {"model.embed_tokens": WholeSequenceEmbedding()}
    if sequence_parallel:
        plan["model.layers.0"] = EnterSequenceShards()
    plan.update({
        "model.layers.*.self_attn": PrepareKeywordInput("hidden_states"),
        "model.layers.*.self_attn.q_proj": ColumnParallel(),
        "model.layers.*.self_attn.k_proj": kv,
        "model.layers.*.self_attn.v_proj": kv,
        "model.layers.*.self_attn.o_proj": RowParallel(),
        "lm_head": VocabParallelOutput(),
    })
    layers = model.model.layers
    dense = [str(i) for i, layer in enumerate(layers)
             if not isinstance(getattr(layer, "mlp", None), (SparseMoE, type(None)))]
    for i in ["*"] if len(dense) == len(layers) else dense:  # dense MLPs only (Qwen3-MoE's mlp_only_layers)
        plan.update({f"model.layers.{i}.mlp": PrepareInput(),
                     f"model.layers.{i}.mlp.gate_proj": ColumnParallel(),
                     f"model.layers.{i}.mlp.up_proj": ColumnParallel(),
                     f"model.layers.{i}.mlp.down_proj": RowParallel()})
    plan.update(whole_sequences)
    if any(name.endswith("self_attn.q_norm") for name, _ in model.named_modules()):
        plan["model.layers.*.self_attn.[qk]_norm"] = PartialGradient()
    if sequence_parallel:  # norms see a sequence shard: their weight gradients are partial
        plan["model.layers.*.*_layernorm"] = PartialGradient()
        plan["model.norm"] = PartialGradient()
    return with_ulysses(plan) if ulysses else plan


PIPELINE_SCHEDULES = ("1f1b", "gpipe")
REFUSED = (  # (field, its value here, the value it must have, why)
    ("parallel.pp_virtual", lambda c: c.parallel.pp_virtual, 1, "one stage per pipeline rank is supported"),
)


def check_hf(cfg: Config) -> list[str]:
    """model.hf_config names a readable config.json of a supported architecture, transformers is
    installed, the layout is one this family supports and divides its shapes."""
    where = cfg.model.hf_config
    if not where.strip():
        folder = hf_folder(cfg.model.init_from)  # the model's folder is named already: say to name it here too
        return [f"model.family = '{NAME}' needs model.hf_config: the path of a config.json (or its folder)"
                + (f"; set model.hf_config = '{folder}', the folder model.init_from reads" if folder else "")]
    path = config_path(cfg)
    try:
        fields = read_config(cfg)
    except (OSError, ValueError) as e:
        return [f"model.hf_config = '{where}': cannot read {path} ({type(e).__name__}: {e}); give a config.json "
                f"or the folder holding one"]
    problems = []
    arch = architecture(fields)
    if arch not in ARCHITECTURES:
        return [f"model.hf_config = '{where}': {arch} is not supported; use one of {', '.join(ARCHITECTURES)}"]
    try:
        import transformers  # noqa: F401
        transformers_found = True
    except ImportError:
        transformers_found = False
        problems.append(f"model.family = '{NAME}' needs the transformers package (pip install transformers)")
    for field, value, wanted, why in REFUSED:
        if value(cfg) != wanted:
            problems.append(f"{field} = {value(cfg)!r} with model.family = '{NAME}': {why}; set {field} = {wanted!r}")
    p = cfg.parallel
    if p.pp > 1 and p.pp_schedule not in PIPELINE_SCHEDULES:
        problems.append(f"parallel.pp_schedule = '{p.pp_schedule}' with model.family = '{NAME}': the schedules "
                        f"proved for it are {', '.join(PIPELINE_SCHEDULES)}; use parallel.pp_schedule = '1f1b'")
    if p.pp > 1 and p.sequence_parallel and p.tp > 1:
        problems.append(f"parallel.sequence_parallel with parallel.pp = {p.pp} and model.family = '{NAME}': its "
                        f"stages make rotary tables from the sequence they receive, which is cut under sequence "
                        f"parallelism; set parallel.sequence_parallel = false or parallel.pp = 1")
    if cfg.memory.checkpointing == "selective":
        problems.append(f"memory.checkpointing = 'selective' with model.family = '{NAME}': it names the parts of "
                        f"bigtrain's Llama block; use 'full' or 'every'")
    if cfg.model.init_from:
        problems += init_from_problems(cfg, fields)
    if cfg.precision.fp8 != "none" and not cfg.precision.fp8_emulate and transformers_found and not problems:
        problems += kernel_shape_problems(planner_config(cfg))  # the config.json's widths, cut by tp
    conf = hf_config(cfg) if transformers_found else None
    if conf is not None:
        problems += moe_problems(cfg, conf, str(path))
    tp = cfg.parallel.tp
    heads, kv = fields.get("num_attention_heads", 0), fields.get("num_key_value_heads") or fields.get(
        "num_attention_heads", 0)
    blocks = sparse_blocks(conf) if conf is not None else None
    split = [("num_attention_heads", heads)]
    if blocks is None or len(blocks.layers) < conf.num_hidden_layers:  # dense MLPs: cut by tp (experts are not)
        split.append(("intermediate_size", fields.get("intermediate_size", 0)))
    for key, size in split:
        if tp > 0 and size % tp:
            problems.append(f"parallel.tp = {tp} does not divide {key} = {size} of {path}; use a tp that divides it")
    if tp > 0 and kv > 0 and kv % tp and tp % kv:  # fewer key/value heads than ranks: replicated if they divide tp
        problems.append(f"parallel.tp = {tp}: num_key_value_heads = {kv} of {path} must divide by tp (split) or "
                        f"divide it (each rank keeps the head its query heads attend to); use a tp that does")
    if cfg.parallel.sequence_parallel and tp > 1 and cfg.data.seq_len % tp:
        problems.append(f"parallel.sequence_parallel: data.seq_len = {cfg.data.seq_len} does not divide by "
                        f"parallel.tp = {tp}; change data.seq_len or turn sequence_parallel off")
    problems += ulysses_problems(cfg, heads, kv, str(path))
    if p.cp > 1:  # context parallelism: bigtrain/families/hf_context.py
        window = attention_window(conf) if conf is not None else None
        problems += context_problems(cfg, heads, kv, str(path), window)
    if conf is not None:  # fields some layouts cannot honour: bigtrain/families/hf_fields.py
        problems += dropout_problems(conf, str(path)) + rotary_problems(cfg, conf, str(path))
    vocab, positions = fields.get("vocab_size", 0), fields.get("max_position_embeddings", 0)
    problems += token_batch_problems(cfg)
    problems += token_data_problems(cfg, vocab, positions, vocab_field=f"vocab_size of {path}",
                                    seq_field=f"max_position_embeddings of {path}")
    return problems


# The config.json fields the planner reads, as transformers resolves them: a field left out of the
# file takes its architecture's default (Qwen2's and Qwen3's 32 kv heads, Qwen3's head_dim of 128,
# Mistral's 8 kv heads), which is what the model built from it has.
DESCRIBED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "tie_word_embeddings", "head_dim", "attention_bias", *MOE_DESCRIBED)


def described_fields(cfg: Config) -> dict:
    """The config.json's fields with its architecture's defaults filled in (by transformers, when
    it is installed; without it the family is refused by check_hf and the file's own are read).
    Read once per version of the file: validation and the planner ask for every layout they weigh."""
    path = config_path(cfg)
    stat = path.stat()
    return dict(_described_at(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _described_at(path: str, mtime_ns: int, size: int) -> dict:
    fields = json.loads(Path(path).read_text())
    try:
        conf = hf_config(ModelConfig(hf_config=path))
    except ImportError:
        return fields
    return {**fields, **{k: getattr(conf, k) for k in DESCRIBED if getattr(conf, k, None) is not None}}


# The architectures whose attention norms each query and key head (Qwen3Attention's q_norm and k_norm)
QK_NORMED = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def planner_config(cfg: Config) -> Config:
    """``cfg`` with bigtrain's Llama of the config.json's shapes in place of the model: what the
    planner prices before launch (the same GEMMs, attention and saved activations up to the
    architectures' small differences: head_dim, q/k/v and output biases and Qwen3's q/k norms are
    counted, Llama's mlp_bias is not). Fields the file leaves out take the architecture's
    defaults (:func:`described_fields`)."""
    fields = described_fields(cfg)
    heads = fields["num_attention_heads"]
    model = dataclasses.replace(
        cfg.model, family="llama", hf_config="", init_from="", dim=fields["hidden_size"],
        n_layers=fields["num_hidden_layers"], n_heads=heads, n_kv_heads=fields.get("num_key_value_heads") or heads,
        ffn_hidden=fields["intermediate_size"], vocab_size=fields["vocab_size"], max_seq_len=cfg.data.seq_len,
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)), attention_head_dim=fields.get("head_dim") or 0,
        # Mistral and Qwen2 read no attention_bias (Qwen2 has q, k, v biases; Qwen2-MoE by qkv_bias)
        qkv_bias=architecture(fields) == "Qwen2ForCausalLM" or (architecture(fields) == "Qwen2MoeForCausalLM"
                                                                and bool(fields.get("qkv_bias", True))),
        attention_bias=architecture(fields) in ATTENTION_BIASED and bool(fields.get("attention_bias", False)),
        qk_norm=architecture(fields) in QK_NORMED,
        attention="sdpa",  # its attention functions take sdpa's dense document mask only (no flex)
        **planner_moe_fields(fields, architecture(fields)))
    return dataclasses.replace(cfg, model=model)


def vocabulary(cfg: Config) -> tuple[int, str]:
    """The config.json's vocab_size (the embedding transformers builds; model.vocab_size is not
    read) and the field that sets it: what the tokenizer and the token ids are checked against."""
    return described_fields(cfg)["vocab_size"], f"vocab_size of {config_path(cfg)}"


def parameter_count(cfg: Config) -> int:
    model = build_meta(cfg)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def export_folder(model: ModelConfig, weights: dict, out) -> Path:
    """A folder ``from_pretrained`` loads: the run's config.json (``model.hf_config``: the
    checkpoint's recorded copy, bigtrain.checkpoint.hf.model_as_trained) and ``model.safetensors`` holding ``weights`` (full tensors under the Hugging Face names
    the model trained with, as they are, each expert bank cut into transformers' per-expert weights)."""
    from safetensors.torch import save_file

    out = Path(out)
    weights = to_transformers_names(weights, sparse_blocks(hf_config(model)))  # experts' banks cut per expert
    fields = read_config(model)
    fields.setdefault("architectures", [architecture(fields)])
    # The weights are fp32. transformers 5 writes (and loads by) "dtype", before "torch_dtype": a
    # config.json it saved as bf16 loaded this export in bf16 by default (logits 1e-2 off the run's).
    fields.pop("dtype", None)
    fields["torch_dtype"] = "float32"
    out.mkdir(parents=True, exist_ok=True)  # once the conversion went through: a refusal writes nothing
    (out / CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


HF = Family(
    name=NAME,
    summary="a Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE from a local config.json "
            "(model.hf_config)",
    check_config=check_hf,
    build_meta=build_meta,
    init_fn=init_fn,
    tp_plan=tp_plan,
    split_stages=split_causal_lm,
    context_parallel=attach_context_parallel,
    blocks=lambda model: model.model.layers,
    head="lm_head",
    final_norm="model.norm",
    compiles=True,
    document_mask=True,  # CausalLM.forward(documents=): the family's attention functions build the mask
    ring_documents=True,  # hf_context.py: the ring masks its pairs by the DocumentIds it is given
    block_linears=True,
    reference=HFReference,
    captured=captured_module,
    parameter_count=parameter_count,
    description=read_config,
    export=export_folder,
    planner_config=planner_config,
    vocabulary=vocabulary,
    generation_model=generation_model,
    model_keys=("family", "hf_config", "init_from", "fused_loss", "fused_loss_chunk", "attn_mask", "reset_positions"),
    llama_fallbacks=True,  # the planner prices it as bigtrain's Llama of its shapes (planner_config)
)
