"""Block-causal attention under ring context parallelism (parallel.cp_mode 'ring' / 'hybrid' with
model.attn_mask = 'block_causal'): the ring masks each pair of chunks by the documents' ids
(bigtrain/parallel/ring_attention.py). The ring against one process's SDPA with the dense document
mask, forward and backward, in float64 (a wrong pair, mask or merge is O(1)); whole runs against the
independent one-process reference (``bigtrain.check``, fp32); the refusal that remains (a family
whose ring takes no documents)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from bigtrain.check.run import check_on_rank
from bigtrain.config import ConfigError
from bigtrain.core.documents import DocumentIds, document_mask
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.context import chunks_of, local_sequence
from bigtrain.parallel.ring_attention import _ChunkDocuments, ring_attention
from bigtrain.testing import run_ranks
from test_document_masking import HF, documents_corpus, packed_config  # noqa: F401 (a fixture)

# Each row's documents, by where each begins (the row's first token always does), over 32 tokens
# cut into 2 x cp chunks: at cp 2 chunks of 8, at cp 4 chunks of 4. Row 0: boundaries inside chunks,
# on a chunk's edge and a document of one token; row 1: one document over the first 20 tokens (whole
# chunk pairs, no mask), then short ones; row 2: a document per chunk of 8 (at cp 2 every pair
# across chunks is skipped).
STARTS = [[0, 3, 8, 9, 17, 26], [0, 20, 23, 29], [0, 8, 16, 24]]


def _ids(seq: int = 32) -> torch.Tensor:
    ids = torch.zeros(len(STARTS), seq, dtype=torch.long)
    for row, starts in enumerate(STARTS):
        for s in starts[1:]:
            ids[row, s:] += 1
    return ids


def _ring_vs_sdpa(rank, world_size, heads, kv_heads):
    cp = Mesh({"cp": world_size}, rank).comm("cp")
    ids = _ids()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(STARTS), 32, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(len(STARTS), 32, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(len(STARTS), 32, heads, 8, generator=gen, dtype=torch.float64)
    # One process: SDPA over the whole sequence with the dense document mask.
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in whole), attn_mask=document_mask(ids),
                                         enable_gqa=heads != kv_heads).transpose(1, 2)
    ref.backward(dout)
    mine = [local_sequence(t, cp).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, cp, partial(chunks_of, world_size), documents=DocumentIds(ids))
    out.backward(local_sequence(dout, cp))
    errors = [float((out - local_sequence(ref, cp)).abs().max())]
    return errors + [float((t.grad - local_sequence(w.grad, cp)).abs().max()) for t, w in zip(mine, whole)]


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 2), (4, 2, 1)])
def test_ring_attention_with_documents_equals_sdpa_with_the_document_mask(cp, heads, kv_heads):
    for errors in run_ranks(_ring_vs_sdpa, cp, heads, kv_heads):
        assert max(errors) < 1e-12, errors


def test_the_pairs_are_skipped_unmasked_or_masked_as_the_documents_say():
    docs = _ChunkDocuments(_ids()[2:], 8)  # row 2 alone: a document per chunk of 8
    pairs = {(qi, ki): mask for qi, ki, _, mask in docs.pairs((0, 3), (0, 3))}
    assert set(pairs) == {(0, 0), (1, 1)} and pairs[(0, 0)] is None  # across chunks: nothing seen
    docs = _ChunkDocuments(_ids()[1:2], 8)  # row 1: tokens 0-19 one document
    pairs = {(qi, ki): mask for qi, ki, _, mask in docs.pairs((1, 2), (0, 1))}
    assert pairs[(0, 0)] is None and pairs[(0, 1)] is None  # chunk 1 against 0 and itself: one document
    # chunk 2 (tokens 16-23), where token 20 begins a document, against chunks 0 and 1: masked
    assert pairs[(1, 0)] is not None and pairs[(1, 1)] is not None
    assert pairs[(1, 0)][0, 0].sum(1).tolist() == [8, 8, 8, 8, 0, 0, 0, 0]  # rows 20-23 see none of chunk 0


def _unmasked(rank, world_size):
    _ChunkDocuments._mask = lambda self, a, b, causal: None  # in this forked rank only
    return _ring_vs_sdpa(rank, world_size, 2, 2)


def test_a_ring_that_drops_the_masks_fails_the_comparison():
    """The comparison above can fail: unmasked pairs attend across documents."""
    assert all(max(errors) > 1e-3 for errors in run_ranks(_unmasked, 2))


LAYOUTS = {
    "ring-cp2-reset": ["--parallel.cp=2", "--parallel.cp_mode=ring", "--model.reset_positions=true"],
    "hybrid-cp2-sp2": ["--parallel.cp=2", "--parallel.cp_mode=hybrid", "--parallel.sp=2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ring_layout_with_documents_matches_the_reference(name, documents_corpus, tmp_path):  # noqa: F811
    cfg = packed_config(documents_corpus, *LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 3, timeout=600)[0]
    assert report.agree, report.text()


HF_LAYOUTS = {
    "ring-cp2-reset": ["--parallel.cp=2", "--parallel.cp_mode=ring", "--model.reset_positions=true"],
}


@pytest.mark.parametrize("name", list(HF_LAYOUTS))
def test_hf_ring_layout_with_documents_matches_transformers_reference(name, documents_corpus, tmp_path):  # noqa: F811
    """The Hugging Face family's ring (families/hf_context.py) takes the same ids; its reference runs
    transformers' own model over each document alone."""
    pytest.importorskip("transformers")
    cfg = packed_config(documents_corpus, "--model.family=hf", "--optim.name=adamw", f"--model.hf_config={HF / 'qwen3'}",
                        *HF_LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 3, timeout=600)[0]
    assert report.agree, report.text()


def test_a_family_whose_ring_takes_no_documents_is_refused(documents_corpus, monkeypatch):  # noqa: F811
    import dataclasses

    import bigtrain.document_checks
    from bigtrain.families.llama import LLAMA

    own = dataclasses.replace(LLAMA, ring_documents=False)  # a family of one's own, say, with no ring of ids
    monkeypatch.setattr(bigtrain.document_checks, "registered_family", lambda name: own)
    with pytest.raises(ConfigError) as err:
        packed_config(documents_corpus, "--parallel.cp=2", "--parallel.cp_mode=ring")
    assert any("parallel.cp_mode = 'ring'" in p and "no document mask in its ring" in p
               and "parallel.cp_mode = 'all-to-all'" in p for p in err.value.problems), err.value.problems


def _saved_activations(rank, world_size, cfg, run_dir):
    from pathlib import Path

    from bigtrain.train import Trainer
    return Trainer(cfg, Path(run_dir), Mesh.from_config(cfg.parallel, rank, world_size)).train_step(
        measure=True).mem["activations"]


def test_the_planner_prices_the_ids_the_ring_saves(corpus_cache, tmp_path):
    """Under the ring a micro-batch's documents cost their ids (int64, the whole sequence), saved once
    for every layer, not a (seq, seq) mask: measured to the byte, and planned so."""
    from bigtrain.plan import PRESETS, ModelSpec, estimate_memory
    from bigtrain.plan.fit import _layout
    from helpers import tiny_config

    measured, planned = [], []
    for mask in ("causal", "block_causal"):
        cfg = tiny_config(corpus_cache, "--data.document_end=\n", "--train.global_batch=2", "--train.micro_batch=2",
                          "--parallel.cp=2", "--parallel.cp_mode=ring", f"--model.attn_mask={mask}")
        measured.append(run_ranks(_saved_activations, 2, cfg, str(tmp_path / mask))[0])
        spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len, device="cpu")
        planned.append(estimate_memory(spec, _layout(cfg), PRESETS["cpu"], cfg.train.global_batch).activations)
    ids = 2 * cfg.data.seq_len * 8
    assert measured[1] - measured[0] == ids, measured
    assert planned[1] - planned[0] == ids, planned


@pytest.mark.slow
def test_compiled_blocks_around_the_ring_with_documents_match_the_reference(documents_corpus, tmp_path):  # noqa: F811
    """The ids reach compiled blocks as data and the ring runs eagerly between them (a compiled
    region that falls back to eager fails check_compiled_on_rank)."""
    from bigtrain.check.run import check_compiled_on_rank

    cfg = packed_config(documents_corpus, "--parallel.cp=2", "--parallel.cp_mode=ring", "--compile.enabled=true")
    report = run_ranks(check_compiled_on_rank, 2, cfg, str(tmp_path), 2, timeout=900)[0]
    assert report.agree, report.text()


def test_bigtrain_plan_prices_a_configs_documents_and_a_ring_as_its_causal_pairs(tmp_path):
    """``bigtrain plan --config`` read no model.attn_mask: a block-causal run was priced causal (sdpa's
    (seq, seq) mask left out). A ring masks its pairs from the ids whatever model.attention says:
    its time is the causal ring's, not sdpa's masked square."""
    import argparse
    import dataclasses

    from bigtrain.plan.cli import add_plan_parser, resolve
    from bigtrain.plan.gemm import block_times
    from bigtrain.plan.layout import Layout

    path = tmp_path / "run.toml"
    path.write_text('[model]\ndim = 64\nn_layers = 2\nn_heads = 4\nattn_mask = "block_causal"\nattention = "sdpa"\n'
                    '[data]\nseq_len = 64\ndocument_end = ":"\n')
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    model, cluster, _, _ = resolve(parser.parse_args(["plan", "--config", str(path), "--hardware", "h100-80g"]))
    assert model.document_mask == "sdpa"
    causal, hw = dataclasses.replace(model, document_mask=""), cluster.hardware
    assert block_times(model, Layout(), hw).forward > block_times(causal, Layout(), hw).forward
    ring = Layout(cp=2, cp_mode="ring")
    assert block_times(model, ring, hw) == block_times(causal, ring, hw)
