"""One validation pass over a whole config, before any process starts.

Each rule is a small function that returns the problems it finds; :func:`validate` runs them all
and raises one :class:`ConfigError` listing every problem, each naming the dotted field and a fix,
so a user fixes a config in one round instead of one error per launch.
"""

from __future__ import annotations

import math
from typing import Callable

from bigtrain.async_checks import check_async  # imports no torch
from bigtrain.config import Config, ConfigError
from bigtrain.context_checks import check_context_parallel, divisor_near as _divisor_near  # imports no torch
from bigtrain.document_checks import check_attention_device, check_documents  # imports no torch
from bigtrain.embedding_checks import check_embedding  # imports no torch
from bigtrain.field_checks import non_negative, one_of, path_exists, positive, step_window_problems
from bigtrain.hsdp_checks import check_hybrid_sharding  # imports no torch
from bigtrain.data.blend_spec import blend_problems, parse_blend  # imports no torch
from bigtrain.data.fields import data_field_problems
from bigtrain.families import family_names, import_family_module, registered_family
from bigtrain.families.own import own_family_problems
from bigtrain.fp8.checks import check_fp8, check_fp8_device  # imports no torch
from bigtrain.offload_checks import check_offload  # imports no torch
from bigtrain.shape_checks import check_expert_parallel, check_model_split, check_pipeline, model_shapes  # imports no torch
from bigtrain.optim import get_optimizer, optimizer_names  # plain data: imports no torch
from bigtrain.optim.schedule import SCHEDULES, peak_lr  # imports no torch

CHECKPOINTING_POLICIES = ("none", "full", "every", "selective")
MINUTES_MAX = 1e7  # checkpoint.every_minutes: 19 years; a larger one only risks overflowing the step count
ACTIVATION_COMPRESSIONS = ("none", "int8")
PRECISIONS = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("auto", "fp32")
LR_SCALINGS = ("none", "linear")
DEVICES = ("auto", "cpu", "cuda")
MODELS = family_names()  # the built-in families (none imported); model.family is checked against the live registry
MOE_ROUTERS = ("softmax", "sigmoid-bias")  # bigtrain.models.moe.ROUTERS (this module imports no torch)

Rule = Callable[[Config], list[str]]


def check_model(cfg: Config) -> list[str]:
    m = cfg.model
    problems = positive(cfg, ["model.vocab_size", "model.dim", "model.n_layers", "model.n_heads",
                              "model.max_seq_len", "model.rope_theta", "model.norm_eps", "model.init_std"])
    problems += non_negative(cfg, ["model.n_kv_heads", "model.ffn_hidden"])
    # The module of one's own first, once (check_model is the first rule): the family it registers is
    # then one of the choices, which the other rules look up without importing it again.
    problems += import_family_module(m) or one_of("model.family", m.family, family_names())
    if problems:
        return problems
    family = registered_family(m.family)
    if m.attention_head_dim:
        pass  # a head size of its own: bigtrain.model_fields checks it
    elif m.dim % m.n_heads:
        problems.append(f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; "
                        f"use a head count that divides it (e.g. {_divisor_near(m.dim, m.n_heads)}), "
                        f"or set model.attention_head_dim")
    elif m.head_dim % 2 and (family is None or family.llama_fallbacks):  # a family of one's own may have no rotary
        problems.append(f"model.dim / model.n_heads = {m.head_dim} must be even for rotary embeddings")
    if m.n_heads % m.kv_heads:
        problems.append(f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads}; "
                        f"e.g. {_divisor_near(m.n_heads, m.kv_heads)}")
    return problems + (check_init_from(m) if family is not None and family.model_fields else [])


def check_init_from(m) -> list[str]:
    """``model.init_from``: '' or a local Hugging Face folder whose architecture is the model's."""
    if not m.init_from:  # first: the checkpoint package imports torch
        return []
    from bigtrain.checkpoint.hf import (HFFormatError, architecture_problems, hf_folder, other_family_hint,
                                       weights_problem)

    folder = hf_folder(m.init_from)
    if folder is None:
        return [f"model.init_from = {m.init_from!r}: write 'hf:PATH' (a local Hugging Face Llama folder), "
                f"or '' for a random init"]
    if not folder.is_dir():
        return [f"model.init_from = {m.init_from!r}: {folder} is not a folder; give the folder that holds "
                f"config.json and model.safetensors (bigtrain export RUN OUT --format hf writes one)"]
    try:
        problems = architecture_problems(m, folder)
    except HFFormatError as e:
        return [f"model.init_from = {m.init_from!r}: {e}{other_family_hint(folder)}"]
    missing = weights_problem(folder)
    return problems + ([f"model.init_from = {m.init_from!r}: {missing}"] if missing else [])


def check_parallel(cfg: Config) -> list[str]:
    p = cfg.parallel
    problems = positive(cfg, ["parallel.dp", "parallel.tp", "parallel.pp", "parallel.sp", "parallel.ep",
                              "parallel.bucket_mb"])
    problems += check_expert_parallel(cfg)
    if p.zero not in (0, 1, 2, 3):
        problems.append(f"parallel.zero = {p.zero}: must be 0, 1, 2 or 3")
    elif p.zero < 3 and not (p.reshard_after_forward and p.prefetch):
        problems.append(f"parallel.reshard_after_forward / parallel.prefetch apply only to ZeRO-3 (parameters are "
                        f"not partitioned at parallel.zero = {p.zero}); set parallel.zero = 3 or leave them true")
    return problems


def check_moe(cfg: Config) -> list[str]:
    """The mixture-of-experts keys (bigtrain/models/moe.py), when model.moe_experts > 0."""
    m = cfg.model
    # Checked for a dense model too: a value no MoE model could take is a mistake either way.
    problems = non_negative(cfg, ["model.moe_experts", "model.moe_capacity_factor", "model.moe_aux_loss_coef",
                                  "model.moe_ffn_hidden", "model.moe_shared_expert_hidden"])
    problems += positive(cfg, ["model.moe_top_k", "model.moe_every"])
    problems += one_of("model.moe_router", m.moe_router, MOE_ROUTERS)
    if problems or m.moe_experts == 0:
        return problems
    if m.moe_top_k > m.moe_experts:
        problems.append(f"model.moe_top_k = {m.moe_top_k} > model.moe_experts = {m.moe_experts}: a token cannot "
                        f"go to more experts than there are; use model.moe_top_k <= {m.moe_experts} "
                        f"(1 or 2 are usual)")
    for key, value in (("moe_shared_expert_hidden", m.moe_shared_expert_hidden),
                       ("moe_shared_expert_gate", m.moe_shared_expert_gate)):
        if value and not m.moe_shared_expert:
            problems.append(f"model.{key} = {value} without model.moe_shared_expert: it shapes the shared expert, "
                            f"and there is none; set model.moe_shared_expert = true or leave model.{key} unset")
    try:
        dense = m.moe_dense_blocks
    except ValueError:
        return problems + [f"model.moe_dense_layers = '{m.moe_dense_layers}': write block indices from 0 like '0,1'"]
    outside = [i for i in dense if not 0 <= i < m.n_layers]
    if outside:
        problems.append(f"model.moe_dense_layers = '{m.moe_dense_layers}': block {outside[0]} is not one of the "
                        f"model.n_layers = {m.n_layers} blocks (0 to {m.n_layers - 1})")
    if m.mlp_bias and not outside and any(m.is_moe_block(i) for i in range(m.n_layers)):
        # The experts and the shared expert are bias-free SwiGLUs (models/moe.py): only the dense
        # blocks would get the biases, and no supported architecture is shaped so (Llama's
        # mlp_bias has no experts; Mixtral's, Qwen-MoE's and DeepSeek's MLPs have no biases).
        problems.append(f"model.mlp_bias = true with model.moe_experts = {m.moe_experts}: the experts and the "
                        f"shared expert have no biases, so only the dense blocks would get them; set "
                        f"model.mlp_bias = false (or model.moe_experts = 0 for a dense model with MLP biases)")
    if m.moe_every > m.n_layers:
        problems.append(f"model.moe_every = {m.moe_every} > model.n_layers = {m.n_layers}: no block would have "
                        f"experts; use model.moe_every <= {m.n_layers}")
    elif not outside and not any(m.is_moe_block(i) for i in range(m.n_layers)):
        problems.append(f"model.moe_dense_layers = '{m.moe_dense_layers}' keeps every block with experts "
                        f"(model.moe_every = {m.moe_every}) dense: no block would have experts; leave one out of "
                        f"model.moe_dense_layers")
    if cfg.precision.mode == "fp16" and m.moe_aux_loss_coef > 0 and m.moe_router == "softmax":
        problems.append("precision.mode = 'fp16' with model.moe_aux_loss_coef > 0: the balance loss's gradient "
                        "joins outside the loss and would miss the loss scale; use bf16, fp32, "
                        "model.moe_router = 'sigmoid-bias' or model.moe_aux_loss_coef = 0")
    return problems


def check_batch(cfg: Config) -> list[str]:
    problems = positive(cfg, ["train.steps", "train.global_batch", "train.micro_batch"])
    problems += positive(cfg, ["train.max_bad_steps"])
    return problems  # how the global batch divides is the family's rule (check_family)


def check_data(cfg: Config) -> list[str]:
    """The domains of the token corpus fields; the data against the model is the family's rule."""
    family = registered_family(cfg.model.family)
    if family is None or not family.reads_tokens:
        if cfg.data.blend and family is not None:
            return [f"data.blend: model.family = '{cfg.model.family}' reads data of its own, not token corpora; "
                    f"leave data.blend = ''"]
        return []
    problems = positive(cfg, ["data.seq_len"]) + non_negative(cfg, ["data.max_bytes"]) + blend_problems(cfg.data.blend)
    if not problems and cfg.data.blend:
        problems += [f"data.blend's {path}: no such file or folder; give an existing corpus"
                     for path, _ in parse_blend(cfg.data.blend) if path != "stdlib" and not path_exists(path)]
    return problems


def check_family(cfg: Config) -> list[str]:
    """The model family's own rules (bigtrain/families): its config fields, its batches and data,
    and the layouts it supports (check_model names an unknown family)."""
    family = registered_family(cfg.model.family)
    return family.check_config(cfg) + own_family_problems(cfg, family) if family is not None else []


def check_optim(cfg: Config) -> list[str]:
    o = cfg.optim
    problems = positive(cfg, ["optim.lr", "optim.eps", "optim.base_batch"])
    problems += non_negative(cfg, ["optim.warmup_steps", "optim.weight_decay", "optim.grad_clip"])
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        if not 0.0 <= value < 1.0:
            problems.append(f"optim.{name} = {value}: must be in [0, 1), e.g. 0.9")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        problems.append(f"optim.min_lr_ratio = {o.min_lr_ratio}: must be in [0, 1]")
    if 0 < o.lr < math.inf and 0 < o.weight_decay < math.inf and cfg.train.global_batch > 0 and o.base_batch > 0:
        # decoupled decay multiplies each weight by 1 - lr x weight_decay a step: at 1 it zeroes them,
        # above it flips their sign, and nothing else would say so
        lr = peak_lr(o, cfg.train.global_batch)
        if lr * o.weight_decay >= 1.0:
            problems.append(f"optim.weight_decay = {o.weight_decay} at the peak rate {lr:g} (optim.lr"
                            f"{', scaled by optim.lr_scaling' if lr != o.lr else ''}): each step multiplies the "
                            f"weights by 1 - lr x weight_decay = {1 - lr * o.weight_decay:g}, which zeroes or "
                            f"flips them; keep lr x weight_decay well under 1 (e.g. weight_decay = 0.1)")
    problems += one_of("optim.lr_scaling", o.lr_scaling, LR_SCALINGS)
    problems += one_of("optim.schedule", o.schedule, SCHEDULES)
    if not 0.0 < o.decay_fraction <= 1.0:
        problems.append(f"optim.decay_fraction = {o.decay_fraction}: must be in (0, 1], the fraction of train.steps "
                        f"that schedule = 'wsd' decays over, e.g. 0.2")
    problems += one_of("optim.name", o.name, optimizer_names())
    problems += positive(cfg, ["optim.block_size", "optim.adafactor_clip", "optim.adafactor_eps"])
    if not -1.0 <= o.adafactor_decay <= 0.0:
        problems.append(f"optim.adafactor_decay = {o.adafactor_decay}: must be in [-1, 0] (1 - beta2 at step t is "
                        f"t ** adafactor_decay; the paper and torch use -0.8)")
    if o.name in optimizer_names():
        problems += _optimizer_serves_layout(cfg, get_optimizer(o.name))
    return problems


def _optimizer_serves_layout(cfg: Config, spec) -> list[str]:
    """An optimizer that needs more than single elements, checked against the layout's cuts."""
    o, par = cfg.optim, cfg.parallel
    if spec.needs == "whole" and (par.zero >= 1 or cfg.precision.mode != "fp32" or par.tp > 1):
        return [f"optim.name = '{o.name}' needs each parameter's shape (whole parameters), but the ZeRO engine "
                f"(parallel.zero >= 1, or precision.mode other than fp32) runs the optimizer on flat shards and "
                f"tensor parallelism (parallel.tp > 1) cuts parameters; use parallel.zero = 0, "
                f"precision.mode = 'fp32' and parallel.tp = 1"]
    m, described = model_shapes(cfg)
    if spec.needs == "blocks" and par.tp > 1 and o.block_size > 0:
        # Row-parallel weights are cut along their rows: a block must not straddle two ranks' parts.
        widths = {"model.dim / parallel.tp": m.dim // par.tp, "ffn_dim / parallel.tp": m.ffn_dim // par.tp}
        # The attention output's rows (wo, row-parallel) and the q bias are cut at n_heads x head_dim,
        # which attention_head_dim sets apart from dim; the k and v biases where tp splits their heads.
        if m.n_heads * m.head_dim != m.dim:
            widths["model.n_heads x head_dim / parallel.tp"] = m.n_heads * m.head_dim // par.tp
        if m.q_bias and m.kv_heads % par.tp == 0:
            widths["model.n_kv_heads x head_dim / parallel.tp"] = m.kv_heads * m.head_dim // par.tp
        bad = {k: w for k, w in widths.items() if w % o.block_size}
        if bad:
            fit = math.gcd(o.block_size, *widths.values())
            return [f"optim.block_size = {o.block_size} must divide each tensor-parallel slice of a row "
                    f"({', '.join(f'{k} = {w}' for k, w in bad.items())}{described}), so that no quantization "
                    f"block straddles two ranks; use optim.block_size = {fit} or a smaller parallel.tp"]
    if spec.needs == "blocks" and par.ep > 1 and m.moe_experts and m.moe_experts % par.ep == 0 and o.block_size > 0:
        # Each expert weight (experts x hidden rows of model.dim) is cut over ep along its rows: where
        # a row is not a whole number of blocks, each rank's part must be.
        part = m.moe_experts // par.ep * m.moe_ffn_dim * m.dim
        if m.dim % o.block_size and part % o.block_size:
            return [f"optim.block_size = {o.block_size} must divide model.dim = {m.dim} or each expert-parallel "
                    f"rank's part of an expert weight (model.moe_experts / parallel.ep x moe_ffn_dim x model.dim "
                    f"= {part} elements{described}), so that no quantization block straddles two ranks; use "
                    f"optim.block_size = {math.gcd(o.block_size, part)} or another parallel.ep"]
    return []


def check_runtime(cfg: Config) -> list[str]:
    problems = one_of("precision.mode", cfg.precision.mode, PRECISIONS)
    problems += one_of("precision.reduce_dtype", cfg.precision.reduce_dtype, REDUCE_DTYPES)
    problems += positive(cfg, ["precision.loss_scale", "precision.scale_growth_interval"])
    if not 0 < cfg.precision.scale_backoff < 1:
        problems.append(f"precision.scale_backoff = {cfg.precision.scale_backoff}: must be in (0, 1), e.g. 0.5")
    problems += one_of("memory.checkpointing", cfg.memory.checkpointing, CHECKPOINTING_POLICIES)
    problems += one_of("memory.activation_compression", cfg.memory.activation_compression, ACTIVATION_COMPRESSIONS)
    problems += positive(cfg, ["memory.checkpoint_every", "logging.log_every", "checkpoint.keep",
                               "model.fused_loss_chunk"])
    problems += non_negative(cfg, ["memory.offload_min_bytes"])
    problems += non_negative(cfg, ["checkpoint.every", "checkpoint.every_minutes"])
    if cfg.checkpoint.every_minutes > MINUTES_MAX:
        problems.append(f"checkpoint.every_minutes = {cfg.checkpoint.every_minutes:g}: at most {MINUTES_MAX:g} "
                        f"(19 years); use 0 for no time-based checkpoints")
    problems += one_of("train.device", cfg.train.device, DEVICES)
    problems += step_window_problems("logging.profile_steps", cfg.logging.profile_steps, cfg.train.steps)
    resume = cfg.checkpoint.resume
    if resume not in ("none", "auto") and not path_exists(resume, expand=False):
        problems.append(f"checkpoint.resume = '{resume}': no such checkpoint; use 'auto', 'none' or an existing path")
    return problems


# init_value seeds torch with seed x 1_000_003 + crc32(name), which must stay below 2**64; numpy's
# generators (the sampler's default_rng([seed, step])) take no negative seed.
SEED_MAX = (2**64 - 2**32) // 1_000_003


def check_seed(cfg: Config) -> list[str]:
    seed = cfg.train.seed
    if 0 <= seed <= SEED_MAX:
        return []
    return [f"train.seed = {seed}: must be in [0, {SEED_MAX}] (the range numpy's and torch's generators "
            f"take once bigtrain mixes in each parameter's name); e.g. {seed % (SEED_MAX + 1)}"]


TIMEOUT_MAX_S = 365 * 86400  # far beyond any wait worth having; larger overflows torch's timedelta
BUCKET_MB_MAX = 2**20  # 1 TiB: a bucket is never larger than the model; more overflows the byte count


def check_distributed(cfg: Config) -> list[str]:
    timeout = cfg.distributed.timeout_s
    if not 1 <= timeout <= TIMEOUT_MAX_S:  # NaN fails too
        return [f"distributed.timeout_s = {timeout:g}: must be between 1 (a step's collectives take longer than "
                f"less) and {TIMEOUT_MAX_S} (a year); the default 600 finds a frozen rank in 10 minutes"]
    return []


def check_limits(cfg: Config) -> list[str]:
    """Upper bounds the other rules leave open, and text fields that must not be empty."""
    problems = []
    if math.isfinite(cfg.parallel.bucket_mb) and cfg.parallel.bucket_mb > BUCKET_MB_MAX:
        problems.append(f"parallel.bucket_mb = {cfg.parallel.bucket_mb:g}: at most {BUCKET_MB_MAX} (1 TiB); "
                        f"the default 25 suits most models")
    if not cfg.checkpoint.resume.strip():
        problems.append("checkpoint.resume is empty; use 'none', 'auto' or the path of a checkpoint")
    return problems


def check_evaluation(cfg: Config) -> list[str]:
    """``data.val_fraction``, ``train.eval_every`` and ``train.eval_batches``: a held-out slice to evaluate on."""
    d, t = cfg.data, cfg.train
    problems = non_negative(cfg, ["train.eval_every"]) + positive(cfg, ["train.eval_batches"])
    if not 0.0 <= d.val_fraction < 1.0:  # NaN fails too
        problems.append(f"data.val_fraction = {d.val_fraction:g}: must be in [0, 1), e.g. 0.01 (0: no held-out data)")
    elif d.val_source and d.val_fraction:
        problems.append(f"data.val_source = '{d.val_source}' and data.val_fraction = {d.val_fraction:g} both give "
                        f"held-out data: evaluate on one of them, set data.val_fraction = 0 or data.val_source = ''")
    elif t.eval_every > 0 and d.val_fraction == 0 and not d.val_source:
        problems.append(f"train.eval_every = {t.eval_every} needs held-out data: set data.val_fraction, e.g. 0.01, "
                        f"or data.val_source (a corpus of its own), or train.eval_every = 0")
    if d.val_source and d.val_source != "stdlib" and not path_exists(d.val_source):
        problems.append(f"data.val_source = '{d.val_source}': no such file or folder; give the held-out corpus's path")
    return problems


def check_block_linears(cfg: Config) -> list[str]:
    """``precision.fp8`` (bigtrain/fp8/checks.py) and ``memory.activation_compression``, which
    change how the linear layers of a decoder's blocks compute, for the model's family."""
    family = registered_family(cfg.model.family)
    if family is None:  # an unknown family: check_family names it
        return check_fp8(cfg, shapes=cfg)
    # A family whose config.json describes it checks the float8 kernels' shapes with its own rules.
    problems = check_fp8(cfg, family.block_linears, cfg if family.model_fields else None)
    compression = cfg.memory.activation_compression
    if compression != "none" and not family.block_linears:
        problems.append(f"memory.activation_compression = '{compression}' keeps int8 inputs of a decoder's "
                        f"linear layers; model.family = '{cfg.model.family}' has none: set it to 'none'")
    return problems


COMPILE_SETTINGS = ("auto", "true", "false")


def check_compile(cfg: Config) -> list[str]:
    """``compile.enabled`` (bigtrain/parallel/compile.py): combinations the compiler cannot take are
    refused here, before launch."""
    setting = cfg.compile.enabled
    problems = one_of("compile.enabled", setting, COMPILE_SETTINGS)
    family = registered_family(cfg.model.family)
    if setting == "true" and family is not None and not family.compiles:
        problems.append(f"compile.enabled = true compiles the decoder's transformer blocks; model.family = "
                        f"'{cfg.model.family}' has none: use compile.enabled = 'auto' or false")
    return problems


def check_context(cfg: Config) -> list[str]:
    """``parallel.cp`` (bigtrain/context_checks.py) for ``model.family``'s attention."""
    return check_context_parallel(cfg, registered_family(cfg.model.family))


# Every rule, in the order their problems are listed; the Llama fields' rules: bigtrain/families/llama.py.
RULES: list[Rule] = [check_model, check_parallel, check_model_split, check_pipeline, check_batch, check_data,
                     check_family, check_optim, check_runtime,
                     check_seed, check_distributed, check_limits, check_moe, check_offload, check_block_linears,
                     check_evaluation, check_embedding, check_compile,
                     check_async, data_field_problems, check_context, check_hybrid_sharding, check_documents]


def validate(cfg: Config, world_size: int | None = None, cuda_available: bool | None = None,
             world_size_from: str = "from the launcher", cuda_capability: tuple[int, int] | None = None) -> None:
    """Raise a ConfigError naming every problem; ``world_size`` (``world_size_from`` says whose) is
    checked against the layout, the device (``cuda_available``, and the GPU's ``cuda_capability``)
    when given."""
    problems: list[str] = []
    for rule in RULES:
        problems += rule(cfg)
    if world_size is not None and not problems and world_size != cfg.parallel.world_size:
        p = cfg.parallel
        rest = max(1, p.tp * p.pp * p.sp * p.cp)
        dp = world_size // rest
        if world_size % rest:  # no dp makes this world: "set parallel.dp = 1" when dp is 1 fixed nothing
            fix = (f"tp x pp x sp x cp = {rest} does not divide it: lower tp, pp, sp or cp to a product that "
                   f"divides {world_size},")
        elif not p.dp_shard:
            fix = f"set parallel.dp = {dp}"
        else:
            fix = f"set parallel.dp_shard = {max(1, dp // max(1, p.dp_replicate))} (HSDP: dp = dp_replicate x dp_shard)"
        ranks = f"{p.world_size} rank{'s' if p.world_size > 1 else ''}"
        launch = f"give --world-size {p.world_size}" if world_size_from == "--world-size" else f"launch {ranks}"
        problems.append(
            f"world size {world_size} ({world_size_from}) != parallel.dp x tp x pp x sp x cp = "
            f"{p.dp} x {p.tp} x {p.pp} x {p.sp} x {p.cp} = {p.world_size}; {fix} or {launch}")
    if cuda_available is False and cfg.train.device == "cuda":
        problems.append("train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    problems += check_fp8_device(cfg, cuda_available, cuda_capability)
    problems += check_attention_device(cfg, cuda_available)
    if problems:
        raise ConfigError(problems)


