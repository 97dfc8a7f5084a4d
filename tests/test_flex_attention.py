"""FlexAttention for block-causal attention (``model.attention = "flex"``): the BlockMask written
from the document ids (core/documents.py, ``document_block_mask``) against the dense mask, the flex
path against sdpa's dense mask and against each document run alone, and the refusals.

torch (2.13) has FlexAttention's forward only on a CPU, no backward (eager or compiled): here the
forward and the loss are compared (fp32, 1e-5 relative); the gradients, the compiled kernel and
compiled blocks are compared on a GPU (the tests marked gpu, run by scripts/gpu-check.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config import ConfigError, ModelConfig
from bigtrain.core.attention_kind import attention_kind
from bigtrain.core.documents import DocumentBoundaries, document_bias, document_block_mask, document_ids, document_mask
from bigtrain.models.flex import flex_attend
from bigtrain.models.llama import Llama
from helpers import tiny_config

END = 10
RTOL = 1e-5
HF = Path(__file__).resolve().parent / "fixtures" / "hf"
# On a CPU the eager call is meant (forward only): torch's note that it is unfused says nothing new.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _documents(batch: int, seq: int, rate: float, gen: torch.Generator) -> torch.Tensor:
    starts = torch.rand(batch, seq, generator=gen) < rate
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


@pytest.mark.parametrize("tile", [4, 8])
def test_the_block_mask_keeps_every_allowed_pair_and_its_full_tiles_hold_no_forbidden_one(tile):
    """Random documents, short and long, sequences the tile divides and does not: each tile holding an
    allowed pair is kept (else the kernel would skip a pair it must attend), and a tile marked full
    (computed without the mask) holds only allowed pairs. The transposed lists are torch's own."""
    gen = torch.Generator().manual_seed(tile)
    for seq, rate in [(24, 0.4), (37, 0.1), (64, 0.02), (13, 1.0)]:
        docs = _documents(2, seq, rate, gen)
        block = document_block_mask(docs, tile)
        allowed = document_mask(docs)[:, 0]
        tiles = -(-seq // tile)
        padded = F.pad(allowed, (0, tiles * tile - seq, 0, tiles * tile - seq)).view(2, tiles, tile, tiles, tile)
        has_pair = padded.any(dim=(2, 4))
        assert (block.to_dense()[:, 0].bool() >= has_pair).all(), (seq, rate)
        for b in range(2):
            for q in range(tiles):
                for j in block.full_kv_indices[b, 0, q, :int(block.full_kv_num_blocks[b, 0, q])].tolist():
                    assert bool(padded[b, q, :, j].all()) and (q + 1) * tile <= seq, (seq, rate, q, j)


def test_flex_attention_equals_the_dense_mask_with_skipped_and_full_tiles():
    """Tiles of 8 over 40 tokens (a short tail tile), grouped-query heads: FlexAttention over the
    BlockMask gives sdpa's output under the additive mask (fp32, 1e-5 relative)."""
    gen = torch.Generator().manual_seed(0)
    docs = _documents(2, 40, 0.08, gen)
    q, k, v = (torch.randn(2, h, 40, 16, generator=gen) for h in (4, 2, 2))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_bias(docs, q.dtype), enable_gqa=True)
    block = document_block_mask(docs, 8)
    assert int(block.full_kv_num_blocks.sum()) > 0 and int((block.kv_num_blocks + block.full_kv_num_blocks).sum()) < 2 * 5 * 5
    torch.testing.assert_close(flex_attend(q, k, v, block), dense, rtol=RTOL, atol=1e-6)


def test_the_flex_model_s_loss_equals_the_dense_mask_s_and_each_document_alone():
    """bigtrain's Llama with model.attention = 'flex' on a packed window: the same logits as 'sdpa'
    and, per document, as the document run alone (window positions); the same summed loss."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(11, 256, (2, 24), generator=gen)
    tokens[0, [3, 4, 12, 13, 20]] = END
    tokens[1, [0, 9, 23]] = END
    targets = torch.randint(0, 256, (2, 24), generator=gen)
    docs = document_ids(tokens, DocumentBoundaries(ends=(END,)))
    logits = {}
    for kind in ("sdpa", "flex"):
        model = Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, attention=kind))
        model.init_weights(0)
        model.requires_grad_(False)  # FlexAttention has no CPU backward: it refuses inputs that need one
        logits[kind] = model(tokens, documents=docs)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=RTOL, atol=1e-6)
    loss = float(F.cross_entropy(logits["flex"].flatten(0, 1), targets.flatten(), reduction="sum"))
    alone = 0.0
    for r in range(2):
        cuts = [0] + [i + 1 for i, t in enumerate(tokens[r, :-1].tolist()) if t == END] + [24]
        for a, b in zip(cuts[:-1], cuts[1:]):
            out = model(tokens[r:r + 1, a:b], start_pos=a)  # causal over the document alone
            torch.testing.assert_close(logits["flex"][r:r + 1, a:b], out, rtol=RTOL, atol=1e-6)
            alone += float(F.cross_entropy(out.flatten(0, 1), targets[r, a:b], reduction="sum"))
    assert loss == pytest.approx(alone, rel=RTOL)


def test_auto_is_flex_on_cuda_for_block_causal_only():
    assert attention_kind("auto", "block_causal", "cuda") == "flex"
    assert attention_kind("auto", "block_causal", "cpu") == "sdpa"
    assert attention_kind("auto", "causal", "cuda") == "sdpa"
    assert attention_kind("sdpa", "block_causal", "cuda") == "sdpa"


# -- refusals before launch ---------------------------------------------------------------------------
def _problems(corpus_cache, *overrides, cuda_available=None) -> list[str]:
    from bigtrain.config import load_config
    from bigtrain.validation import validate

    base = [f"--data.cache_dir={corpus_cache}", "--data.document_end=\n"]
    with pytest.raises(ConfigError) as err:
        validate(load_config(preset="tiny", overrides=base + list(overrides)), cuda_available=cuda_available)
    return err.value.problems


@pytest.mark.parametrize("overrides,cuda,words", [
    (["--model.attention=flex"], None, ["model.attention = 'flex'", "model.attn_mask = 'block_causal'"]),
    (["--model.attention=flex", "--model.attn_mask=block_causal", "--train.device=cpu"], None,
     ["model.attention = 'flex'", "train.device = 'cpu'", "no FlexAttention backward", "model.attention = 'auto'"]),
    (["--model.attention=flex", "--model.attn_mask=block_causal"], False,
     ["model.attention = 'flex'", "no CUDA device", "model.attention = 'auto'"]),
    (["--model.attention=dense"], None, ["model.attention = 'dense'", "'sdpa', 'flex', 'auto'"]),
], ids=["causal", "cpu-device", "no-cuda", "unknown"])
def test_flex_where_it_cannot_run_is_refused_naming_the_field_and_the_fix(corpus_cache, overrides, cuda, words):
    problems = _problems(corpus_cache, *overrides, cuda_available=cuda)
    assert any(all(w in p for w in words) for p in problems), problems


def test_flex_in_a_family_without_it_is_refused(corpus_cache):
    """The Hugging Face family takes documents (sdpa's dense mask) but no BlockMask (the document
    rule alone: the family's full validation reads transformers, seconds)."""
    from bigtrain.config import load_config
    from bigtrain.document_checks import check_documents

    cfg = load_config(preset="tiny", overrides=[f"--data.cache_dir={corpus_cache}", "--data.document_end=\n",
                                                "--model.family=hf", f"--model.hf_config={HF / 'llama'}",
                                                "--model.attn_mask=block_causal", "--model.attention=flex"])
    problems = check_documents(cfg)
    assert any("model.attention = 'flex'" in p and "model.family = 'hf'" in p and "model.attention = 'sdpa'" in p
               for p in problems), problems


def test_auto_and_sdpa_on_a_cpu_are_accepted(corpus_cache):
    for setting in ("auto", "sdpa"):
        tiny_config(corpus_cache, "--data.document_end=\n", "--model.attn_mask=block_causal",
                    f"--model.attention={setting}")


# -- on a GPU: gradients, the compiled kernel, compiled blocks (scripts/gpu-check.sh runs -m gpu) -------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _cuda_window(seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ``seq`` ids: the first with end tokens at random (documents of 1 to ~seq / 3
    tokens: skipped and partial 128-token tiles), the second one document over its first 256 tokens
    (a full tile: keys 0-127 for queries 128-255) and another to its end; and targets."""
    tokens = torch.randint(11, 256, (2, seq), generator=gen)
    ends = torch.rand(seq, generator=gen) < 6 / seq
    ends[2] = ends[3] = True  # documents of one token
    tokens[0, ends] = END
    tokens[1, [255, seq - 2]] = END
    return tokens, torch.randint(0, 256, (2, seq), generator=gen)


@pytest.mark.gpu
@gpu
def test_flex_on_cuda_trains_as_the_dense_mask_and_each_document_alone():
    """fp32 on the GPU, the compiled FlexAttention kernel, 320 tokens (two tiles and a tail tile the
    kernel pads; skipped, partial and full tiles): the packed window's loss and every gradient equal
    sdpa's under the dense mask and the sum over its documents run alone (1e-5 relative; torch's
    default fp32 matmuls, no TF32, which bigtrain leaves as it is)."""
    seq = 320
    tokens, targets = (t.cuda() for t in _cuda_window(seq, torch.Generator().manual_seed(seq)))
    docs = document_ids(tokens, DocumentBoundaries(ends=(END,)))
    assert int(document_block_mask(docs).full_kv_num_blocks.sum()) > 0
    losses, grads = {}, {}
    for kind in ("sdpa", "flex"):
        model = Llama(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=512, attention=kind))
        model.to_empty(device="cuda")
        model.init_weights(0)
        loss = F.cross_entropy(model(tokens, documents=docs).flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        losses[kind], grads[kind] = float(loss), {n: p.grad for n, p in model.named_parameters()}
    alone, loss_alone = model, 0.0  # the flex model's weights; its gradients kept above
    alone.zero_grad(set_to_none=True)
    for r in range(2):
        row = tokens[r].tolist()
        cuts = [0] + [i + 1 for i, t in enumerate(row[:-1]) if t == END] + [seq]
        for a, b in zip(cuts[:-1], cuts[1:]):
            part = F.cross_entropy(alone(tokens[r:r + 1, a:b], start_pos=a).flatten(0, 1), targets[r, a:b], reduction="sum")
            part.backward()
            loss_alone += float(part)
    assert losses["flex"] == pytest.approx(losses["sdpa"], rel=RTOL)
    assert losses["flex"] == pytest.approx(loss_alone, rel=RTOL)
    for name, p in alone.named_parameters():
        for other in (grads["sdpa"][name], p.grad):
            assert (grads["flex"][name] - other).norm() <= RTOL * other.norm(), name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compiled", ["false", "true"], ids=["eager-blocks", "compiled-blocks"])
def test_the_trainer_with_flex_on_cuda_matches_the_reference(compiled, corpus_cache, tmp_path):
    """``bigtrain check`` on the GPU: the trainer with model.attention = 'flex' (eager blocks calling
    the compiled kernel; compiled blocks inlining it) against the independent reference, which runs
    each document alone, 3 steps at fp32's bounds."""
    from bigtrain.check.run import check_layout
    from bigtrain.distributed.mesh import Mesh

    cfg = tiny_config(corpus_cache, "--data.document_end=\n", "--model.attn_mask=block_causal",
                      "--model.attention=flex", "--model.reset_positions=true", "--precision.mode=fp32",
                      f"--compile.enabled={compiled}", "--data.seq_len=256", "--model.max_seq_len=256")
    report = check_layout(cfg, Mesh({}), tmp_path / "check", steps=3, device="cuda")
    assert report.agree, report.text()

