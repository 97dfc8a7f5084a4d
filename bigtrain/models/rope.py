"""Rotary position embeddings and their long-context frequency scalings.

Each scaling changes the inverse frequencies of the rotary pairs (and YaRN also scales cos and sin):
``linear`` divides them all by ``rope_factor`` (positions interpolated); ``llama3`` (Llama 3.1)
divides the low frequencies (wavelengths beyond ``rope_original_max_len / rope_low_freq_factor``)
by it, keeps the high ones (shorter than ``rope_original_max_len / rope_high_freq_factor``) and
blends in between; ``yarn`` blends interpolated and original frequencies over a ramp of dimensions
set by ``rope_beta_fast`` / ``rope_beta_slow`` and multiplies cos and sin by an attention factor.

The arithmetic follows Hugging Face's ``modeling_rope_utils`` operation for operation, in fp32, so a
model imported from (or exported to) a ``config.json`` with ``rope_scaling`` gives the same logits.
"""

from __future__ import annotations

import math

import torch

from bigtrain.config import ModelConfig

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


def default_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """1 / theta^(2i / head_dim) for i < head_dim / 2, in fp32."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default scale of cos and sin: 0.1 ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, device=None) -> torch.Tensor:
    dim, base, factor = cfg.head_dim, cfg.rope_theta, cfg.rope_factor
    old_len = cfg.rope_original_max_len or cfg.max_seq_len

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_frequencies(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of shape (head_dim / 2,), the factor cos and sin are scaled by)."""
    kind = cfg.rope_scaling
    if kind == "yarn":
        return _yarn(cfg, device), cfg.rope_attention_factor or yarn_attention_factor(cfg.rope_factor)
    inv_freq = default_inv_freq(cfg.head_dim, cfg.rope_theta, device)
    if kind == "linear":
        return inv_freq / cfg.rope_factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, cfg), 1.0
    if kind != "none":
        raise ValueError(f"model.rope_scaling = {kind!r}: must be one of {', '.join(ROPE_SCALINGS)}")
    return inv_freq, 1.0


def rotary_tables_for(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim / 2) for ``cfg``, scaling included."""
    inv_freq, scale = rope_frequencies(cfg, device)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return (cos * scale, sin * scale) if scale != 1.0 else (cos, sin)
