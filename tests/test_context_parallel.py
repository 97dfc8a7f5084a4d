"""Context parallelism (parallel.cp, docs/context-parallel.md): the balanced chunk layout, ring
attention against one process's causal SDPA (forward and backward), whole runs against the
independent one-process reference (``bigtrain.check``, fp32: loss and gradient norm within 1e-5
relative, every weight, gradient and module output within 1e-4, over 4 steps), the ring's traffic
against its formula, and the saved activations per rank."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from bigtrain.check.run import check_on_rank
from bigtrain.distributed.mesh import Mesh
from bigtrain.parallel.context import chunk_order, chunks_of, local_positions, local_sequence
from bigtrain.parallel.ring_attention import ring_attention
from bigtrain.testing import run_ranks
from helpers import tiny_config

SMALL_BATCH = ["--train.global_batch=4", "--train.micro_batch=1"]


def test_each_rank_holds_chunks_i_and_2cp_minus_1_minus_i():
    assert [chunks_of(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert chunk_order(2) == [0, 3, 1, 2]


def _ring_vs_sdpa(rank, world_size, seq, heads, kv_heads):
    mesh = Mesh({"cp": world_size}, rank)
    cp = mesh.comm("cp")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, seq, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, seq, heads, 8, generator=gen, dtype=torch.float64)
    # One process: causal SDPA over the whole sequence.
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in whole), is_causal=True,
                                         enable_gqa=heads != kv_heads).transpose(1, 2)
    ref.backward(dout)
    # This rank: its two chunks of each, through the ring.
    mine = [local_sequence(t, cp).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, cp, partial(chunks_of, world_size))
    out.backward(local_sequence(dout, cp))
    errors = [float((out - local_sequence(ref, cp)).abs().max())]
    errors += [float((t.grad - local_sequence(w.grad, cp)).abs().max()) for t, w in zip(mine, whole)]
    return errors, mesh.stats.sent_bytes("cp", "send")


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 4), (4, 4, 2), (3, 2, 1)])
def test_ring_attention_equals_causal_attention_forward_and_backward(cp, heads, kv_heads):
    """float64, so rounding is far below the bound: a wrong mask, merge or gradient hop is O(1)."""
    for errors, _ in run_ranks(_ring_vs_sdpa, cp, 4 * cp, heads, kv_heads):
        assert max(errors) < 1e-12, errors


def test_local_positions_follow_the_chunks():
    class Comm:
        size, rank = 2, 1
    assert local_positions(8, Comm()).tolist() == [2, 3, 4, 5]
    assert local_sequence(torch.arange(8)[None], Comm()).tolist() == [[2, 3, 4, 5]]


LAYOUTS = {
    "ring-cp2": ["--parallel.cp=2"],
    "ring-cp4": ["--parallel.cp=4"],
    "all-to-all-cp2": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all"],
    "all-to-all-cp4": ["--parallel.cp=4", "--parallel.cp_mode=all-to-all"],
}


def _check(corpus_cache, tmp_path, overrides, steps=4):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *overrides)
    return run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), steps, timeout=300)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_the_reference(name, corpus_cache, tmp_path):
    report = _check(corpus_cache, tmp_path, LAYOUTS[name])
    assert report.agree, report.text()
    assert report.worst["forward"] < 1e-4  # module outputs were put back together and compared
