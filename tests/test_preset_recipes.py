"""Model presets carry the optimizer recipe of the published model they copy (issue 28: the
llama-7b preset's lr of 3e-3, ten times Llama-2's, made the loss climb 11 -> 27 in three steps)."""

import pytest

from bigtrain.config import load_config
from bigtrain.plan import ModelSpec

# Llama 2, section 2.2 and table 1: (peak lr) by size; the rest is common to every size.
LLAMA2_LR = {"llama-7b": 3e-4, "llama-13b": 3e-4, "llama-70b": 1.5e-4}
LLAMA2_COMMON = dict(name="adamw", warmup_steps=2000, min_lr_ratio=0.1, beta1=0.9, beta2=0.95, eps=1e-5,
                     weight_decay=0.1, grad_clip=1.0)


@pytest.mark.parametrize("preset", list(LLAMA2_LR))
def test_llama2_presets_carry_llama2s_optimizer_recipe(preset):
    cfg = load_config(preset=preset)
    assert cfg.optim.lr == LLAMA2_LR[preset]
    assert {k: getattr(cfg.optim, k) for k in LLAMA2_COMMON} == LLAMA2_COMMON
    # The cosine runs over Llama 2's 2.0 T tokens at 4 M tokens a step, not the default 200 steps.
    assert cfg.train.global_batch * cfg.data.seq_len == 4 * 2**20 and cfg.train.steps == 476837


def test_llama_13b_is_llama2_13b():
    cfg = load_config(preset="llama-13b")
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size) == (5120, 40, 40, 40, 13824, 32000)
    assert ModelSpec.from_model_config(m, cfg.data.seq_len).params == pytest.approx(13.016e9, rel=1e-3)


@pytest.mark.parametrize("preset", ["llama-1b", "mixtral-8x7b"])
def test_other_model_presets_use_llama2s_adamw_settings(preset):
    cfg = load_config(preset=preset)
    assert cfg.optim.lr == 3e-4
    assert {k: getattr(cfg.optim, k) for k in ("beta1", "beta2", "eps", "weight_decay", "grad_clip")} == \
        {"beta1": 0.9, "beta2": 0.95, "eps": 1e-5, "weight_decay": 0.1, "grad_clip": 1.0}
