"""Checks of the Llama fields that current checkpoints set: head size, biases, rotary scaling.

Plain data (no torch): :func:`llama_field_problems` is one of the Llama family's rules (bigtrain/families/llama.py).
Each problem names the field and the value that fixes it.
"""

from __future__ import annotations

import math

from bigtrain.config import Config

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # bigtrain.models.rope.ROPE_SCALINGS


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def head_problems(cfg: Config) -> list[str]:
    m = cfg.model
    if m.attention_head_dim < 0:
        return [f"model.attention_head_dim = {m.attention_head_dim}: must be >= 0 (0 means model.dim / "
                f"model.n_heads)"]
    if m.attention_head_dim == 0 or m.n_heads <= 0:
        return []  # validation's dim / n_heads rules apply
    if m.attention_head_dim % 2:
        return [f"model.attention_head_dim = {m.attention_head_dim} must be even for rotary embeddings "
                f"(pairs of features rotate together); use {m.attention_head_dim + 1}"]
    return []


def rope_problems(cfg: Config) -> list[str]:
    m = cfg.model
    kind = m.rope_scaling
    if kind not in ROPE_SCALINGS:
        return [f"model.rope_scaling = '{kind}': must be one of {', '.join(repr(k) for k in ROPE_SCALINGS)}"]
    problems = []
    for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow"):
        value = getattr(m, name)
        if not (_finite(value) and value > 0):
            problems.append(f"model.{name} = {value}: must be > 0")
    if not (_finite(m.rope_attention_factor) and m.rope_attention_factor >= 0):
        problems.append(f"model.rope_attention_factor = {m.rope_attention_factor}: must be >= 0 (0: YaRN's default)")
    if m.rope_original_max_len < 0:
        problems.append(f"model.rope_original_max_len = {m.rope_original_max_len}: must be >= 0")
    if problems or kind == "none":
        return problems
    if kind == "llama3":
        if m.rope_original_max_len <= 0:
            problems.append("model.rope_scaling = 'llama3' needs model.rope_original_max_len, the context the "
                            "model was trained on before scaling (Llama 3.1: 8192)")
        if m.rope_high_freq_factor <= m.rope_low_freq_factor:
            problems.append(f"model.rope_high_freq_factor = {m.rope_high_freq_factor:g} must exceed "
                            f"model.rope_low_freq_factor = {m.rope_low_freq_factor:g} (Llama 3.1: 4 and 1)")
    if kind == "yarn" and m.rope_beta_fast <= m.rope_beta_slow:
        problems.append(f"model.rope_beta_fast = {m.rope_beta_fast:g} must exceed model.rope_beta_slow = "
                        f"{m.rope_beta_slow:g} (YaRN: 32 and 1)")
    return problems


def llama_field_problems(cfg: Config) -> list[str]:
    """Head size and rotary scaling (a DLRM has none of them: not checked). Biases need no rule: a
    row-parallel one is added once after the tensor-parallel sum, with int8 compression and float8
    as without (parallel/tensor/styles.py: ``RowParallel``)."""
    if cfg.model.family != "llama":
        return []
    qk_norm = ["model.qk_norm = true: bigtrain's Llama has no per-head query and key norms (Qwen3's); train "
               "such a model as model.family = 'hf', or set model.qk_norm = false"] if cfg.model.qk_norm else []
    return qk_norm + head_problems(cfg) + rope_problems(cfg)
