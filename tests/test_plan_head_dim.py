"""The planner for a model whose query heads are not ``hidden`` wide (model.attention_head_dim, a
Hugging Face head_dim: Qwen3-0.6B has 16 heads of 128 at hidden 1024, 2048 wide): attention's FLOPs,
its projections' shapes and its Ulysses exchange count heads x head_dim, not hidden. Each test fails
on a planner that takes the hidden width for the query heads' width."""

from __future__ import annotations

import numpy as np
import pytest

from bigtrain.config import ModelConfig
from bigtrain.plan import PRESETS, ModelSpec, estimate_memory
from bigtrain.plan.fit import _layout
from bigtrain.plan.gemm import linear_shapes
from bigtrain.plan.layout import Layout
from bigtrain.testing import run_ranks
from helpers import tiny_config, trainer_on_rank

# 2 layers, hidden 64, 4 query heads of 32 (a = 128 = 2 x hidden), 2 kv heads (k = 64), SwiGLU 96.
SPEC = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=100, seq=32, ffn_hidden=96, head_size=32)


def test_flops_count_the_query_heads_width_by_hand():
    h, a, k, f, L, V, s = 64, 128, 64, 96, 2, 100, 32
    assert SPEC.attention_dim == a and SPEC.kv_dim == k
    block = a * h + k * h + k * h + h * a + 3 * f * h  # wq, wk, wv, wo, w1 w3 w2
    assert block == 43008
    n = L * block + V * h  # the output projection; the embedding is a lookup
    assert SPEC.matmul_params == n == 92416
    # forward 2 N_block + 4 a s; a step 6N + 12 L a s (Megatron's and torchtitan's attention term)
    assert SPEC.block_forward_flops_per_token() == 2 * block + 4 * a * s == 102400
    assert SPEC.model_flops_per_token() == 6 * n + 12 * L * a * s == 652800
    # with a = h the formula is the one it always was: 6N + 12 L h s
    plain = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=100, seq=32, ffn_hidden=96)
    assert plain.model_flops_per_token() == 6 * plain.matmul_params + 12 * 2 * 64 * 32


def test_a_qwen3_config_reaches_the_spec_and_its_gemms_cover_its_weights():
    """From the config (Qwen3-0.6B's attention shapes) to the spec, and the shape-aware time model's
    linears (gemm.py) multiply exactly the weights the FLOPs count, at tp 1 and 2."""
    cfg = ModelConfig(dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, attention_head_dim=128, ffn_hidden=3072,
                      vocab_size=1000, max_seq_len=64)
    spec = ModelSpec.from_model_config(cfg, 64)
    assert spec.attention_dim == 2048 and spec.hidden == 1024
    for tp in (1, 2):
        per_token = sum(2 * n * k * count for _, n, k, count, _ in linear_shapes(spec, Layout(tp=tp), 1.0))
        assert per_token * tp == 2 * spec.block_matmul_params, tp


def _step_memory(rank, world_size, overrides, run_dir):
    cfg = tiny_config(run_dir, *overrides)
    return trainer_on_rank(rank, world_size, cfg, run_dir).train_step(measure=True).mem


def test_ulysses_activations_with_a_head_size_are_what_the_trainer_saves(tmp_path):
    """Ulysses (sp 2) brings attention's output back by an all-to-all as a tensor of its own, which
    wo saves: heads x head_dim wide (here twice hidden). Measured to the byte on 2 Gloo ranks
    (the planner sized it as hidden: 3% short)."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint16))
    overrides = [f"--data.source={tokens}", "--parallel.sp=2", "--model.attention_head_dim=32",
                 "--precision.mode=bf16", "--train.micro_batch=2"]
    cfg = tiny_config(str(tmp_path), *overrides)
    spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    assert spec.attention_dim == 2 * spec.hidden
    planned = estimate_memory(spec, _layout(cfg), PRESETS["cpu"], cfg.train.global_batch)
    measured = run_ranks(_step_memory, 2, overrides, str(tmp_path), timeout=300)[0]
    assert planned.activations == measured["activations"]
    for key in ("params", "grads", "optimizer"):
        assert getattr(planned, key) == pytest.approx(measured[key], rel=1e-2), key
