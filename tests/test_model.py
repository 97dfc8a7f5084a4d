"""The reference model: meta construction, layout-independent init, GQA, activation checkpointing."""

import torch
import torch.nn.functional as F

from bigtrain.config import ModelConfig
from bigtrain.memory.accounting import SavedActivations, model_state_bytes
from bigtrain.memory.checkpointing import apply_activation_checkpointing, checkpointed_blocks
from bigtrain.models.llama import apply_rotary, build_model, count_parameters, rotary_tables
from bigtrain.parallel.build import token_loss_sum

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _materialized(cfg=CFG, seed=0, policy="none", every=1):
    model = build_model(cfg)
    apply_activation_checkpointing(model.layers, policy, every)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def _tokens(b=2, s=16, seed=0):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def test_built_on_meta_allocates_nothing():
    model = build_model(CFG)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model_state_bytes(model)["params"] == 0


def test_parameter_count_matches_the_formula():
    h, f, kv = CFG.dim, CFG.ffn_dim, CFG.kv_heads * CFG.head_dim
    per_block = h * h * 2 + 2 * h * kv + 3 * h * f + 2 * h
    expected = CFG.n_layers * per_block + 2 * CFG.vocab_size * h + h
    assert count_parameters(build_model(CFG)) == expected
    tied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    assert count_parameters(build_model(tied)) == expected - CFG.vocab_size * h


def test_init_depends_only_on_seed_and_name():
    a, b, c = _materialized(seed=3), _materialized(seed=3), _materialized(seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_grouped_query_attention_equals_repeated_kv_heads():
    model = _materialized()
    attn = model.layers[0].attention
    x = torch.randn(2, 8, CFG.dim)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    q = apply_rotary(attn.wq(x).view(2, 8, 4, 16), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.wk(x).view(2, 8, 2, 16), cos, sin).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 8, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 8, -1))
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-6)


def test_rotary_preserves_norms_and_is_relative():
    cos, sin = rotary_tables(16, 32, 10000.0)
    x = torch.randn(1, 32, 1, 16)
    torch.testing.assert_close(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(16), torch.randn(16)
    dots = [apply_rotary(q.expand(1, 32, 1, 16), cos, sin)[0, i, 0] @ apply_rotary(
        k.expand(1, 32, 1, 16), cos, sin)[0, i - 3, 0] for i in (5, 20)]
    torch.testing.assert_close(dots[0], dots[1], rtol=1e-5, atol=1e-5)


def test_checkpointing_policies_choose_blocks():
    assert checkpointed_blocks(6, "none") == []
    assert checkpointed_blocks(6, "full") == [0, 1, 2, 3, 4, 5]
    assert checkpointed_blocks(6, "every", 2) == [0, 2, 4]


def _grads_and_saved(policy, every=1):
    model = _materialized(policy=policy, every=every)
    tokens = _tokens()
    with SavedActivations(model) as saved:
        loss = token_loss_sum(model(tokens), tokens)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, saved.peak, float(loss.detach())


def test_checkpointing_keeps_gradients_and_saves_less():
    grads, saved_none, loss = _grads_and_saved("none")
    for policy, every in (("full", 1), ("every", 2)):
        ckpt_grads, saved, ckpt_loss = _grads_and_saved(policy, every)
        assert ckpt_loss == loss
        for name, g in grads.items():
            torch.testing.assert_close(ckpt_grads[name], g, rtol=1e-6, atol=1e-8)
        assert saved < saved_none
    # Fully checkpointed, each block keeps just its input: b s h fp32 bytes a block.
    _, saved_full, _ = _grads_and_saved("full")
    _, saved_every, _ = _grads_and_saved("every", 2)
    block_input = 2 * 16 * CFG.dim * 4
    per_block = (saved_none - saved_full) / CFG.n_layers + block_input
    assert saved_every == saved_full + 2 * (per_block - block_input)
    assert saved_full >= CFG.n_layers * block_input


def test_saved_activations_exclude_parameters():
    model = _materialized()
    x = torch.randn(4, CFG.dim, requires_grad=True)
    with SavedActivations(model) as saved:
        y = model.layers[0].feed_forward.w1(x)  # linear saves its input and weight
    y.sum().backward()
    assert saved.peak == x.numel() * 4
