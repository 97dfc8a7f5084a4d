"""Bad values for the tiny preset's fields on the command line (the ``field`` kind of
:mod:`bigtrain.check.input_cases`): each field's domain, written here independently of
``validation.py`` (a lower bound, and the value from which rejection is certain on any machine),
the classifiers that tell a certainly-bad text from one that may be valid, and the drawn case.
"""

from __future__ import annotations

import math
import os
import random

from bigtrain.check.input_recipe import INT64, NEED, SEED_MAX, Case, fixed_args

# (lower bound of a valid value, value from which rejection is certain); None: no such bound.
INT_FIELDS: dict[str, tuple[int, int | None]] = {
    "model.vocab_size": (256, 10**11), "model.dim": (8, 10**7), "model.n_layers": (1, 10**9),
    "model.n_heads": (1, 65), "model.n_kv_heads": (0, 5), "model.ffn_hidden": (0, 10**12),
    "model.max_seq_len": (32, 10**12), "parallel.dp": (1, 3), "parallel.tp": (1, 5), "parallel.pp": (1, 3),
    "parallel.sp": (1, 3), "parallel.cp": (1, 17), "parallel.ep": (1, None), "parallel.pp_virtual": (1, 2), "parallel.zero": (0, 4),
    "precision.scale_growth_interval": (1, None), "memory.checkpoint_every": (1, None),
    "optim.warmup_steps": (0, None), "optim.base_batch": (1, None), "optim.block_size": (1, None), "data.seq_len": (1, 65),
    "data.max_bytes": (0, None), "data.ignore_target": (-1, 256), "train.steps": (1, None),
    "train.global_batch": (1, 2**40), "train.micro_batch": (1, 9), "train.seed": (0, SEED_MAX + 1),
    "train.max_bad_steps": (1, None), "model.moe_experts": (0, None), "model.moe_top_k": (1, None),
    "model.moe_every": (1, None), "model.moe_ffn_hidden": (0, None), "model.moe_shared_expert_hidden": (0, None),
    "checkpoint.every": (0, None), "checkpoint.keep": (1, None), "logging.log_every": (1, None),
    "model.fused_loss_chunk": (1, None), "memory.offload_min_bytes": (0, None),
    "train.eval_every": (0, None), "train.eval_batches": (1, None),
    "model.dlrm_dense_features": (1, None), "embedding.dim": (1, None), "embedding.hotness": (1, None),
    "offload.prefetch_depth": (0, None), "offload.grad_buckets": (1, None),
    "parallel.local_sgd_every": (1, 2),  # with the preset's dp_sync = 'sync', only 1 is valid
    "parallel.dp_replicate": (1, 2), "parallel.dp_shard": (0, 2),  # dp = 1: one group of one (dp_shard 0: dp's)
    "model.attention_head_dim": (0, None), "model.rope_original_max_len": (0, None),
}
# (low, low inclusive, high, high inclusive)
FLOAT_FIELDS: dict[str, tuple[float, bool, float, bool]] = {
    "model.rope_theta": (0, False, math.inf, False), "model.norm_eps": (0, False, math.inf, False),
    "model.init_std": (0, False, math.inf, False), "parallel.bucket_mb": (0, False, 2**20, True),
    "precision.loss_scale": (0, False, math.inf, False), "precision.scale_backoff": (0, False, 1, False),
    "optim.lr": (0, False, math.inf, False), "optim.min_lr_ratio": (0, True, 1, True),
    "optim.decay_fraction": (0, False, 1, True),
    "optim.weight_decay": (0, True, math.inf, False), "optim.beta1": (0, True, 1, False),
    "optim.beta2": (0, True, 1, False), "optim.eps": (0, False, math.inf, False),
    "optim.grad_clip": (0, True, math.inf, False), "optim.adafactor_decay": (-1, True, 0, True),
    "optim.adafactor_clip": (0, False, math.inf, False), "optim.adafactor_eps": (0, False, math.inf, False), "distributed.timeout_s": (1, True, 365 * 86400, True),
    "model.moe_capacity_factor": (0, True, math.inf, False), "model.moe_aux_loss_coef": (0, True, math.inf, False),
    "data.val_fraction": (0, True, 1, False),
    "embedding.lr": (0, False, math.inf, False), "embedding.eps": (0, False, math.inf, False),
    "embedding.budget_gb": (0, True, math.inf, False), "checkpoint.every_minutes": (0, True, 1e7, True),
    "model.rope_factor": (0, False, math.inf, False), "model.rope_low_freq_factor": (0, False, math.inf, False),
    "model.rope_high_freq_factor": (0, False, math.inf, False), "model.rope_beta_fast": (0, False, math.inf, False),
    "model.rope_beta_slow": (0, False, math.inf, False), "model.rope_attention_factor": (0, True, math.inf, False),
}
BOOL_FIELDS = ["model.tie_embeddings", "parallel.sequence_parallel", "parallel.reshard_after_forward",
               "parallel.prefetch", "checkpoint.save_final", "checkpoint.async", "logging.progress",
               "logging.report", "logging.measure_memory", "logging.tensorboard", "model.fused_loss",
               "memory.activation_offload", "memory.selective_attention", "parallel.pp_vertical_sync",
               "model.attention_bias", "model.qkv_bias", "model.mlp_bias"]
ENUM_FIELDS: dict[str, tuple[str, ...]] = {
    "model.family": ("llama",), "parallel.pp_schedule": ("naive", "gpipe", "1f1b", "interleaved", "zb-h1"),
    "parallel.dp_sync": ("sync", "local-sgd"),
    "parallel.pp_balance": ("layers", "params"), "precision.mode": ("fp32", "bf16", "fp16"),
    "precision.reduce_dtype": ("auto", "fp32"), "memory.checkpointing": ("none", "full", "every", "selective"),
    "memory.activation_compression": ("none", "int8"),
    "optim.lr_scaling": ("none", "linear"), "optim.schedule": ("cosine", "linear", "wsd", "constant"), "optim.name": ("adamw", "adamw8bit", "adafactor", "lion"),  # others register at run time
    "train.device": ("auto", "cpu"),  # cuda: only with a GPU
    "model.rope_scaling": ("none", "linear", "yarn"),  # 'llama3' needs model.rope_original_max_len
    "embedding.sharding": ("auto", "table", "row", "column", "data"),  # a DLRM's; refused for any model
}
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

INT_TEXT = ["0", "-1", "-7", "1.5", "abc", "", " ", "1e3", "0x10", "nan", "inf", "true", str(INT64),
            str(-INT64 - 1), "9" * 30, "9" * 5000, "+-1", "10**3", "1,000", "½", "-0x1", "\t", "٣", "1_0",
            str(10**12), str(10**15), str(2**62), str(INT64 - 1), "-" + str(10**12)]
FLOAT_TEXT = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400", "-1e400", "0", "-0", "-0.0", "-1",
              "5e-324", "1e308", "abc", "", "1,5", "0x10", "1/2", "1e", "--1", "2", "1", "1.0000001", "-1e-9",
              "1e9", "3e7", "1e-300"]
BOOL_TEXT = ["maybe", "", "2", "-1", "tru", "t", "y", "null", "None", "yes please", "oui", " ", "0.0", "1e0",
             "TRUE", " true ", "No"]
STR_TEXT = ["", " ", "\t", "x" * 5000, "\u00e9", "\U0001f642", "../../etc", "$(id)", "\x1b[2J", "null", "None",
            "0", "-1", "\udcff", "a" * 300, "fp 32"]


def _int_value(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def int_is_bad(name: str, text: str) -> bool:
    """True when ``text`` is certainly not a valid value of int field ``name`` (in the tiny preset)."""
    value = _int_value(text)
    if value is None or not -INT64 <= value < INT64:
        return True
    low, certain = INT_FIELDS[name]
    if name == "data.max_bytes" and 0 < value < NEED:
        return True  # a cap below one window and its target
    return value < low or (certain is not None and value >= certain)


def float_is_bad(name: str, text: str) -> bool:
    try:
        value = float(text.strip())
    except ValueError:
        return True
    low, low_in, high, high_in = FLOAT_FIELDS[name]
    if not math.isfinite(value):
        return True
    return not ((value >= low if low_in else value > low) and (value <= high if high_in else value < high))


def bool_is_bad(text: str) -> bool:
    return text.strip().lower() not in TRUE + FALSE


def str_is_bad(name: str, text: str) -> bool:
    if name == "embedding.sharding":  # one kind for every table, or one per table: 'table, row'
        return any(part.strip() not in ENUM_FIELDS[name] for part in text.split(","))
    return text not in ENUM_FIELDS[name]



def field_case(rng: random.Random) -> tuple[Case | None, str]:
    """One bad value for one field; (None, label) when the drawn value may be valid (skipped)."""
    kind = rng.choice(["int"] * 5 + ["float"] * 3 + ["bool", "enum", "enum", "text"])
    if kind == "int":
        name = rng.choice(sorted(INT_FIELDS))
        text = rng.choice(INT_TEXT + [str(rng.randint(-10**6, 10**6)), str(rng.randint(-3, 70)),
                                      str(10 ** rng.randint(6, 18) * rng.randint(1, 9))])
        bad = int_is_bad(name, text)
    elif kind == "float":
        name = rng.choice(sorted(FLOAT_FIELDS))
        text = rng.choice(FLOAT_TEXT + [repr(rng.uniform(-5, 5)), f"1e{rng.randint(-330, 330)}"])
        bad = float_is_bad(name, text)
    elif kind == "bool":
        name, text = rng.choice(BOOL_FIELDS), rng.choice(BOOL_TEXT)
        bad = bool_is_bad(text)
    elif kind == "enum":
        name = rng.choice(sorted(ENUM_FIELDS))
        good = rng.choice(ENUM_FIELDS[name])
        text = rng.choice(STR_TEXT + [good.upper(), good + " ", " " + good, good[:-1], good + "x", "cuda"])
        bad = str_is_bad(name, text)
    else:
        name = rng.choice(["data.source", "parallel.pp_split", "checkpoint.resume", "data.tokenizer",
                           "model.family_module"])
        text = rng.choice(STR_TEXT + ["/nonexistent/corpus.txt", "stdlib ", "STDLIB", "1,2", "a,b", "-1", "1,,2"])
        if name == "parallel.pp_split":
            bad = bool(text.strip())  # one stage: any split point is one too many
        elif name == "checkpoint.resume":
            bad = text not in ("none", "auto") and not os.path.lexists(text)
        elif name == "model.family_module":  # '' or a module that imports: none of these texts names one
            bad = bool(text.strip())
        elif name == "data.tokenizer":  # 'bytes', or a tokenizer file: none of these texts names one
            bad = text != "bytes" and not os.path.isfile(os.path.expanduser(text))
        else:
            bad = text != "stdlib" and not os.path.lexists(os.path.expanduser(text))
    label = f"--{name}={text[:40]!r}" + ("..." if len(text) > 40 else "")
    if not bad:
        return None, label
    return Case("field", label, (name,), fixed_args(f"--{name}={text}")), label
