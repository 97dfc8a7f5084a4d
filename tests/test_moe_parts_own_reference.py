"""An MoE block cut three ways at once against a plain reference written here from the rules of
docs/moe.md alone (not bigtrain/check/reference.py, not tests/test_moe.py's): each sequence in
2 x cp = 6 chunks with cp rank i holding chunks i and 5 - i (the odd chunk count of cp = 3), the
experts cut over ep = 3 on the same ranks (tokens to their expert by all-to-all), capacity drops,
the Switch balance loss in the gradient; or the sequence cut in rank order over Ulysses' sp.

The reference: per whole sequence, softmax router in fp32, top-k renormalized, every first choice
queued before every second, then in token order, routings past C = ceil(factor x seq x k / E)
dropped, experts as explicit SwiGLU matrices, E sum_e f_e P_e per sequence. fp32 throughout: the
layout only regroups the same sums (all-to-all moves rows, the chunk pairs are a permutation), so
1e-5 relative holds with room (the block's own test of a plain loop holds at 1e-5 too)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bigtrain.distributed.mesh import Mesh
from bigtrain.testing import run_ranks
from helpers import assert_rel_close

DIM, HIDDEN, E, K, BATCH, SEQ = 8, 6, 6, 2, 2, 24
FACTOR, COEF = 0.75, 0.3


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(E, DIM, generator=g), "w1": torch.randn(E * HIDDEN, DIM, generator=g) * 0.5,
            "w3": torch.randn(E * HIDDEN, DIM, generator=g) * 0.5, "w2": torch.randn(E * HIDDEN, DIM, generator=g) * 0.5}


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def plain(weights: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor):
    """Objective sum(out * target) + COEF x sum over sequences of the balance loss; its gradients."""
    w = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    x = x.clone().requires_grad_(True)
    cap = math.ceil(FACTOR * SEQ * K / E)
    total, dropped = 0.0, 0
    for b in range(BATCH):
        probs = (x[b] @ w["router"].t()).softmax(-1)  # (seq, E)
        top, chosen = probs.topk(K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros(SEQ, DIM)
        queue = [0] * E
        for c in range(K):
            for t in range(SEQ):
                e = int(chosen[t, c])
                queue[e] += 1
                if queue[e] > cap:
                    dropped += 1
                    continue
                rows = slice(e * HIDDEN, (e + 1) * HIDDEN)
                h = F.silu(x[b, t] @ w["w1"][rows].t()) * (x[b, t] @ w["w3"][rows].t())
                out = out.index_add(0, torch.tensor([t]), (top[t, c] * (h @ w["w2"][rows]))[None])
        fraction = torch.tensor([float((chosen == e).sum()) for e in range(E)]) / (SEQ * K)
        balance = E * (fraction * probs.mean(0)).sum()
        total = total + (out * target[b]).sum() + COEF * balance
    total.backward()
    return {n: t.grad for n, t in w.items()}, x.grad, dropped


def _block(weights):
    from bigtrain.models.moe import MoEFeedForward

    block = MoEFeedForward(DIM, HIDDEN, E, K, capacity_factor=FACTOR, aux_loss_coef=COEF)
    with torch.no_grad():
        block.router.weight.copy_(weights["router"])
        for n in ("w1", "w3", "w2"):
            getattr(block.experts, n).copy_(weights[n])
    block.aux_scale = 1.0  # each sequence's balance loss counts once, as in the objective above
    return block


def _cut(rank, world_size, axis, weights, x, target):
    from bigtrain.parallel.context import local_sequence
    from bigtrain.parallel.experts import apply_expert_parallel
    from bigtrain.parallel.sequence_moe import ChunkPairsOverCP, SequenceParts
    from torch import nn

    mesh = Mesh({axis: world_size, "ep": world_size}, rank)
    comm = mesh.comm(axis)
    block = _block(weights)
    holder = nn.ModuleDict({"moe": block})
    with torch.no_grad():  # apply_expert_parallel cuts on meta-shaped empties: copy this rank's rows after
        full = {n: getattr(block.experts, n).detach().clone() for n in ("w1", "w3", "w2")}
    apply_expert_parallel(holder, mesh)
    rows = slice(rank * (E // world_size) * HIDDEN, (rank + 1) * (E // world_size) * HIDDEN)
    with torch.no_grad():
        for n in ("w1", "w3", "w2"):
            getattr(block.experts, n).copy_(full[n][rows])
    if axis == "cp":
        block.sequence = ChunkPairsOverCP(comm)
        part, part_target = local_sequence(x, comm), local_sequence(target, comm)
    else:
        block.sequence = SequenceParts(comm)
        part, part_target = (t.chunk(world_size, dim=1)[rank].contiguous() for t in (x, target))
    part = part.clone().requires_grad_(True)
    (block(part) * part_target).sum().backward()
    grads = {"router": block.router.weight.grad, **{n: getattr(block.experts, n).grad for n in ("w1", "w3", "w2")}}
    return grads, part.grad, int(block.stats.dropped)


@pytest.mark.parametrize("axis", ["cp", "sp"])
def test_a_block_cut_over_the_sequence_and_ep_equals_the_plain_reference(axis):
    weights = _weights()
    x, target = _data()
    expected, expected_x, expected_dropped = plain(weights, x, target)
    assert expected_dropped > 0, "the capacity must drop routings, or the queues prove nothing"
    ranks = run_ranks(_cut, 3, axis, weights, x, target, timeout=300)
    router = sum(r[0]["router"] for r in ranks)  # each rank's router saw its own tokens: partial sums
    assert_rel_close(router, expected["router"], 1e-5, f"{axis} router grad")
    for n in ("w1", "w3", "w2"):  # each rank holds E / 3 experts, whole over the ranks' tokens
        assert_rel_close(torch.cat([r[0][n] for r in ranks]), expected[n], 1e-5, f"{axis} {n} grad")
    if axis == "cp":
        chunks = expected_x.chunk(6, dim=1)
        whole_x = torch.cat([torch.cat([chunks[i], chunks[5 - i]], dim=1) for i in range(3)], dim=1)
    else:
        whole_x = expected_x
    assert_rel_close(torch.cat([r[1] for r in ranks], dim=1), whole_x, 1e-5, f"{axis} input grad")
    assert sum(r[2] for r in ranks) == expected_dropped
