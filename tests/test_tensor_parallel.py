"""Tensor parallelism (Megatron), sequence parallelism (Megatron and Ulysses) and plans.

Layer parity: forward and input/weight gradients equal the single-device layer within 1e-6.
Model parity: fp32, 10 steps, per-step loss within 1e-5 relative of one process.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.check.reference import reference_losses
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.feed_forward import FeedForward
from bigtrain.models.llama import AttentionCore
from bigtrain.parallel.tensor.loss import vocab_parallel_loss_sum
from bigtrain.parallel.tensor.plan import parallelize_module
from bigtrain.parallel.tensor.styles import (ColumnParallel, PrepareInput, RowParallel, TPContext,
                                             UlyssesAttention, VocabParallelEmbedding)
from bigtrain.testing import run_ranks
from helpers import run_steps, tiny_config, trainer_on_rank

TOL = dict(rtol=1e-6, atol=1e-6)


def _local_copy(full_module: nn.Module, meta_module: nn.Module, ctx: TPContext) -> dict:
    """Fill a parallelized module's local weights from a full module's (slicing as the specs say);
    returns the specs by parameter name."""
    full = dict(full_module.named_parameters())
    specs = {}
    for name, p in list(meta_module.named_parameters()):
        spec = specs[name] = ctx.specs.get(id(p))
        value = full[name].detach() if spec is None else spec.local_from_full(full[name].detach())
        setattr(_owner(meta_module, name), name.rsplit(".", 1)[-1], nn.Parameter(value.clone()))
    return specs


def _owner(module, name):
    for part in name.split(".")[:-1]:
        module = getattr(module, part)
    return module


def _swiglu_parity(rank, world_size, sequence_parallel):
    torch.manual_seed(0)
    full = FeedForward(16, 32)
    x = torch.randn(2, 8, 16, requires_grad=True)
    full(x).pow(2).sum().backward()
    with torch.device("meta"):
        local = FeedForward(16, 32)
    ctx = TPContext(tp=Mesh({"tp": world_size}, rank).comm("tp"), sequence_parallel=sequence_parallel)
    # The seeds' plan for a SwiGLU feed-forward: w1 and w3 column-parallel, w2 row-parallel.
    parallelize_module(local, {"": PrepareInput(), "w1": ColumnParallel(), "w3": ColumnParallel(),
                               "w2": RowParallel()}, ctx)
    specs = _local_copy(full, local, ctx)
    x_local = x.detach().chunk(world_size, dim=1)[rank] if sequence_parallel else x.detach()
    x_local.requires_grad_(True)
    y = local(x_local)
    y.pow(2).sum().backward()
    expected_y = full(x.detach()).chunk(world_size, dim=1)[rank] if sequence_parallel else full(x.detach())
    torch.testing.assert_close(y, expected_y, **TOL)
    expected_gx = x.grad.chunk(world_size, dim=1)[rank] if sequence_parallel else x.grad
    torch.testing.assert_close(x_local.grad, expected_gx, **TOL)
    for name, p in local.named_parameters():
        spec = specs[name]
        torch.testing.assert_close(p.grad, spec.local_from_full(dict(full.named_parameters())[name].grad), **TOL)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_column_row_swiglu_equals_the_single_device_layer(world_size, sequence_parallel):
    run_ranks(_swiglu_parity, world_size, sequence_parallel)


def _embedding_and_loss_parity(rank, world_size, vocab):
    torch.manual_seed(0)
    full = nn.Embedding(vocab, 8)
    tokens = torch.randint(0, vocab, (2, 6))
    full(tokens).pow(2).sum().backward()
    with torch.device("meta"):
        local = nn.Embedding(vocab, 8)
    ctx = TPContext(tp=Mesh({"tp": world_size}, rank).comm("tp"))
    local = VocabParallelEmbedding().apply(local, ctx)  # a lookup wrapper in the embedding's place
    spec = _local_copy(full, local, ctx)["weight"]
    out = local(tokens)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, full(tokens), **TOL)
    torch.testing.assert_close(local.weight.grad, spec.local_from_full(full.weight.grad), **TOL)
    # Vocab-parallel cross-entropy, padding columns included, against F.cross_entropy.
    logits = torch.randn(2, 6, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (2, 6))
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    local_logits = spec.local_from_full(logits.detach()[..., :].transpose(0, 2)).transpose(0, 2)
    local_logits = local_logits.contiguous().requires_grad_(True)
    if spec.padded_size > vocab:  # padded columns hold garbage; the loss must ignore them
        local_logits.data[..., -1] = 100.0 if rank == world_size - 1 else local_logits.data[..., -1]
    first = rank * spec.padded_size // world_size
    loss = vocab_parallel_loss_sum(local_logits, targets, ctx.tp, first, vocab)
    loss.backward()
    expected = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="sum")
    torch.testing.assert_close(loss, expected, **TOL)
    padded_grad = spec.local_from_full(logits.grad.transpose(0, 2)).transpose(0, 2)
    torch.testing.assert_close(local_logits.grad, padded_grad, **TOL)


@pytest.mark.parametrize("world_size,vocab", [(2, 16), (2, 15), (4, 18)], ids=["even", "padded", "padded-4"])
def test_vocab_parallel_embedding_and_cross_entropy(world_size, vocab):
    run_ranks(_embedding_and_loss_parity, world_size, vocab)


def _ulysses_parity(rank, world_size):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 4, 4, requires_grad=True) for _ in range(3))
    core = AttentionCore()
    core(q, k, v).pow(2).sum().backward()
    local = AttentionCore()
    ctx = TPContext(tp=Mesh({}).comm("tp"), sp=Mesh({"sp": world_size}, rank).comm("sp"))
    UlyssesAttention().apply(local, ctx)
    shards = [t.detach().chunk(world_size, dim=1)[rank].requires_grad_(True) for t in (q, k, v)]
    out = local(*shards)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, core(q, k, v).chunk(world_size, dim=1)[rank], **TOL)
    for shard, full in zip(shards, (q, k, v)):
        torch.testing.assert_close(shard.grad, full.grad.chunk(world_size, dim=1)[rank], **TOL)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_attention_equals_full_attention(world_size):
    run_ranks(_ulysses_parity, world_size)


def test_a_pattern_that_matches_nothing_is_an_error():
    with torch.device("meta"):
        ff = FeedForward(8, 16)
    with pytest.raises(ValueError, match="'w9' matches no module"):
        parallelize_module(ff, {"w9": ColumnParallel()}, TPContext(tp=Mesh({}).comm("tp")))


# -- whole models --------------------------------------------------------------------------------
STEPS = 10


def _losses(rank, world_size, cfg, run_dir):
    return run_steps(trainer_on_rank(rank, world_size, cfg, run_dir), STEPS)


@functools.lru_cache(maxsize=None)
def _reference(cache_dir, *model_overrides):
    """Per-step losses of the independent single-process loop (bigtrain.check.reference)."""
    return reference_losses(tiny_config(cache_dir, *model_overrides), STEPS)


LAYOUTS = {
    "tp2": (2, ["--parallel.tp=2"], []),
    "tp4-replicated-kv": (4, ["--parallel.tp=4"], []),
    "tp4-split-kv": (4, ["--parallel.tp=4"], ["--model.n_kv_heads=4"]),
    "tp2-sequence-parallel": (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true"], []),
    "ulysses2": (2, ["--parallel.sp=2"], []),
    "ulysses4": (4, ["--parallel.sp=4"], ["--model.n_kv_heads=4"]),
    "dp2-tp2": (4, ["--parallel.dp=2", "--parallel.tp=2", "--train.micro_batch=2"], []),
    "zero2-tp2": (4, ["--parallel.dp=2", "--parallel.tp=2", "--train.micro_batch=4", "--parallel.zero=2"], []),
    "tp2-ulysses2": (4, ["--parallel.tp=2", "--parallel.sp=2"], ["--model.n_kv_heads=4"]),
    "tp2-vocab-not-divisible": (2, ["--parallel.tp=2"], ["--model.vocab_size=257"]),
    "tp4-sp-vocab-padded": (4, ["--parallel.tp=4", "--parallel.sequence_parallel=true"],
                            ["--model.vocab_size=258", "--model.n_kv_heads=4"]),
    # Current Llama configs: biases (row-parallel ones added once, after the sum), a head size apart
    # from dim / heads, rotary scaling; q/k/v biases on replicated key/value heads (partial gradients).
    "tp2-biases": (2, ["--parallel.tp=2"], ["--model.attention_bias=true", "--model.mlp_bias=true"]),
    "tp2-sp-biases-head-dim-llama3": (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
                                      ["--model.attention_bias=true", "--model.mlp_bias=true",
                                       "--model.attention_head_dim=24", "--model.rope_scaling=llama3",
                                       "--model.rope_factor=8", "--model.rope_original_max_len=16"]),
    "tp4-replicated-kv-qkv-bias-yarn": (4, ["--parallel.tp=4"], ["--model.qkv_bias=true", "--model.rope_scaling=yarn",
                                                                 "--model.rope_factor=4"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_losses_match_one_process(layout, corpus_cache, tmp_path):
    world_size, parallel, model = LAYOUTS[layout]
    expected = _reference(corpus_cache, *model)
    base = [] if any("micro_batch" in o for o in parallel) else ["--train.micro_batch=8"]
    cfg = tiny_config(corpus_cache, *base, *parallel, *model)
    results = run_ranks(_losses, world_size, cfg, str(tmp_path))
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def _tp_checkpoint_round_trip(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 3)
    trainer.save()
    weights = trainer.parallel.full_state()[0]  # a collective: every rank calls it
    return weights if rank == 0 else None


def test_a_tp_checkpoint_holds_full_weights_and_resumes_on_one_process(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--train.micro_batch=8", "--parallel.tp=2", "--model.vocab_size=257",
                      f"--train.steps={STEPS}")
    weights = run_ranks(_tp_checkpoint_round_trip, 2, cfg, str(tmp_path))[0]
    assert weights["tok_embeddings.weight"].shape == (257, 64)
    one = tiny_config(corpus_cache, "--train.micro_batch=8", "--model.vocab_size=257", "--checkpoint.resume=auto",
                      f"--train.steps={STEPS}")
    resumed = trainer_on_rank(0, 1, one, str(tmp_path))
    tail = [r.loss for r in resumed.fit()]
    expected = _reference(corpus_cache, "--model.vocab_size=257", f"--train.steps={STEPS}")
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(expected[3:]), rtol=1e-5, atol=0)


# -- traffic ---------------------------------------------------------------------------------------
def _forward_traffic(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    tokens, targets = next(trainer.sampler.micro_batches(0, 0, 1, cfg.train.micro_batch))
    stats = trainer.mesh.stats
    before = stats.snapshot()
    with torch.no_grad():
        trainer.parallel.model(tokens if trainer.parallel.sp.size == 1 else tokens.chunk(world_size, 1)[rank])
    return {k: v for k, v in stats.since(before).payload.items()}


@pytest.mark.parametrize("kind", ["tp", "tp+sp", "ulysses"])
def test_forward_traffic_per_layer_matches_theory(kind, corpus_cache, tmp_path):
    b, s, h, L = 4, 32, 64, 2
    sbh = s * b * h * 4  # fp32 bytes
    if kind == "ulysses":
        cfg = tiny_config(corpus_cache, "--parallel.sp=2", "--model.n_kv_heads=4", "--train.micro_batch=4")
        payload = run_ranks(_forward_traffic, 2, cfg, str(tmp_path))[0]
        # q, k, v in and the output back: 4 all-to-alls of s b h / sp each, per layer.
        assert payload == {("sp", "all_to_all:ulysses"): L * 4 * sbh // 2}
        return
    extra = ["--parallel.sequence_parallel=true"] if kind == "tp+sp" else []
    cfg = tiny_config(corpus_cache, "--parallel.tp=2", "--train.micro_batch=4", *extra)
    payload = run_ranks(_forward_traffic, 2, cfg, str(tmp_path))[0]
    if kind == "tp":
        # Two all-reduces of s b h per layer, plus the embedding's; then the loss is not computed here.
        assert payload == {("tp", "all_reduce:tp"): (2 * L + 1) * sbh}
    else:
        # The same volume as all-gathers (before each sub-block and the head) and reduce-scatters
        # (after each sub-block and the embedding): all-reduce = reduce-scatter + all-gather.
        assert payload == {("tp", "all_gather:sp"): (2 * L + 1) * sbh, ("tp", "reduce_scatter:sp"): (2 * L + 1) * sbh}


def test_a_rank_s_sequence_shard_does_not_keep_the_whole_sequence_alive():
    """split_sequence (the first block's input under SP in a Hugging Face decoder) and the token ids'
    chunks: a single sample's shard is a contiguous slice, and as a view it kept the whole sequence's
    storage alive wherever autograd saved it (the layout fuzzer's HF draws: (tp - 1) / tp of the
    embedding's output, 5% of a tiny model's activations at tp 4). Each shard is a copy of its own."""
    from types import SimpleNamespace

    from bigtrain.parallel.tensor.functional import local_chunk

    whole = torch.randn(1, 32, 8)
    for rank in range(4):
        shard = local_chunk(whole, SimpleNamespace(size=4, rank=rank), 1)
        assert torch.equal(shard, whole[:, 8 * rank:8 * (rank + 1)])
        assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()
