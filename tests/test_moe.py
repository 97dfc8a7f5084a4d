"""The MoE block in one process against a plainly written one: token by token, its top-k experts
weighted, the capacity rule written as the docs state it (per sequence, first choices before
second ones, earlier tokens first), the balance loss added to the objective by hand. Grouped GEMM
against the loop. Each comparison is fp32 at 1e-5 relative and fails when the rule is changed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bigtrain.models.moe import LocalExperts, MoEFeedForward, set_aux_loss_scale, update_router_biases
from helpers import assert_rel_close

DIM, HIDDEN, EXPERTS, BATCH, SEQ = 8, 16, 4, 3, 12


def block(top_k=2, capacity=0.0, aux=0.0, router="softmax", shared=False, seed=0, shared_hidden=None,
          shared_gate=False) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(DIM, HIDDEN, EXPERTS, top_k, capacity, aux, router, shared, shared_hidden=shared_hidden,
                         shared_gate=shared_gate)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def plain_forward(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token; the capacity counters reset per sequence and are filled choice by choice."""
    b, s, _ = x.shape
    k, F_ = moe.top_k, moe.experts.hidden
    out = torch.zeros_like(x)
    cap = math.ceil(moe.capacity_factor * s * k / EXPERTS) if moe.capacity_factor > 0 else None
    for i in range(b):
        logits = x[i] @ moe.router.weight.t()
        if moe.router_kind == "softmax":
            scores = logits.softmax(-1)
            w, e = scores.topk(k, dim=-1)
            w = w / w.sum(-1, keepdim=True) if k > 1 else w
        else:
            scores = torch.sigmoid(logits)
            _, e = (scores.detach() + moe.expert_bias).topk(k, dim=-1)
            w = scores.gather(-1, e)
            w = w / w.sum(-1, keepdim=True) if k > 1 else w
        used = [0] * EXPERTS
        for choice in range(k):
            for t in range(s):
                expert = int(e[t, choice])
                used[expert] += 1
                if cap is not None and used[expert] > cap:
                    continue  # dropped: the token keeps its residual only
                rows = slice(expert * F_, (expert + 1) * F_)
                w1, w3, w2 = moe.experts.w1[rows], moe.experts.w3[rows], moe.experts.w2[rows]
                y = (F.silu(x[i, t] @ w1.t()) * (x[i, t] @ w3.t())) @ w2
                out[i, t] = out[i, t] + w[t, choice] * y
        if moe.shared is not None:  # a SwiGLU of its own size; Qwen2-MoE's gate: sigmoid(g . x) per token
            w1, w3, w2 = moe.shared.w1.weight, moe.shared.w3.weight, moe.shared.w2.weight
            y = (F.silu(x[i] @ w1.t()) * (x[i] @ w3.t())) @ w2.t()
            if moe.shared_gate is not None:
                y = torch.sigmoid(x[i] @ moe.shared_gate.weight.t()) * y
            out[i] = out[i] + y
    return out


def plain_balance_loss(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    total = 0.0
    for i in range(x.shape[0]):
        scores = (x[i] @ moe.router.weight.t()).softmax(-1)
        chosen = scores.topk(moe.top_k, dim=-1).indices
        f = torch.stack([(chosen == e).float().sum() for e in range(EXPERTS)]) / chosen.numel()
        total = total + EXPERTS * (f * scores.mean(0)).sum()
    return total


CASES = {
    "top1-dropless": dict(top_k=1),
    "top2-dropless": dict(top_k=2),
    "top2-capacity-1.0": dict(top_k=2, capacity=1.0),
    "top1-capacity-0.5": dict(top_k=1, capacity=0.5),
    "sigmoid-bias-shared": dict(top_k=2, router="sigmoid-bias", shared=True),
    "shared-gated-own-size": dict(top_k=2, shared=True, shared_hidden=12, shared_gate=True),
    "sigmoid-bias-top1": dict(top_k=1, router="sigmoid-bias"),
}


def _grads(moe, loss):
    moe.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in moe.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_block_equals_plain_token_loop(case):
    moe = block(**CASES[case])
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    target = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(2))
    ours = moe(x)
    assert_rel_close(ours.detach(), plain_forward(moe, x).detach(), 1e-5, f"{case} outputs")
    g_ours = _grads(moe, (ours * target).sum())
    g_plain = _grads(moe, (plain_forward(moe, x) * target).sum())
    for name in g_plain:
        assert_rel_close(g_ours[name], g_plain[name], 1e-5, f"{case} grad {name}")
    if moe.capacity_factor > 0:
        assert int(moe.stats.dropped) > 0, "the capacity case must drop something, or it proves nothing"


def test_capacity_changes_the_result():
    """The comparison above can fail: dropless and capacity-limited outputs differ here."""
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    dropless, limited = block(top_k=2)(x), block(top_k=2, capacity=1.0)(x)
    err = float((dropless - limited).detach().norm() / dropless.detach().norm())
    assert err > 1e-3


def test_balance_loss_joins_the_gradient():
    coef, scale = 5.0, 1 / 3  # large enough to move the router gradient well past the tolerance
    moe = block(top_k=2, aux=coef)
    set_aux_loss_scale(moe, scale)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    target = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(2))
    ours = _grads(moe, (moe(x) * target).sum())
    plain = _grads(moe, (plain_forward(moe, x) * target).sum() + coef * scale * plain_balance_loss(moe, x))
    without = _grads(moe, (plain_forward(moe, x) * target).sum())
    assert_rel_close(ours["router.weight"], plain["router.weight"], 1e-5, "router grad with aux")
    err = float((ours["router.weight"] - without["router.weight"]).norm() / without["router.weight"].norm())
    assert err > 1e-3, "the balance loss must move the router's gradient"


def test_grouped_gemm_equals_the_loop():
    moe = block(top_k=2)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    target = torch.randn(BATCH, SEQ, DIM)
    loop_out = moe(x)
    loop = _grads(moe, (loop_out * target).sum())
    moe.dispatcher = LocalExperts(grouped_mm=True)
    grouped_out = moe(x)
    grouped = _grads(moe, (grouped_out * target).sum())
    assert_rel_close(grouped_out, loop_out, 1e-5, "grouped outputs")
    for name in loop:
        assert_rel_close(grouped[name], loop[name], 1e-5, f"grouped grad {name}")


def test_statistics_and_sigmoid_bias_update():
    moe = block(top_k=1, capacity=0.5, router="sigmoid-bias")
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    moe(x)
    report = update_router_biases(moe)[""]
    assert sum(report["load"]) == BATCH * SEQ
    cap = math.ceil(0.5 * SEQ / EXPERTS)
    assert report["dropped"] == sum(max(0, n - cap) for n in _per_sequence_loads(moe, x, cap))
    bias = moe.expert_bias
    mean = sum(report["load"]) / EXPERTS
    for e, n in enumerate(report["load"]):  # over-loaded experts pushed down, under-loaded up
        assert float(bias[e]) == pytest.approx(1e-3 * (1 if n < mean else -1 if n > mean else 0))
    assert float(moe.stats.load.sum()) == 0  # reset for the next step


def _per_sequence_loads(moe, x, cap):
    out = []
    with torch.no_grad():
        for i in range(x.shape[0]):
            scores = torch.sigmoid(x[i] @ moe.router.weight.t())
            chosen = scores.topk(1, dim=-1).indices.flatten()
            out += [int((chosen == e).sum()) for e in range(EXPERTS)]
    return out


def test_the_report_draws_expert_load(tmp_path):
    """A run whose metrics carry ``moe`` gets expert_load.png and a per-block table (shares at the
    last logged step, max / mean, drops, aux); a dense run gets neither."""
    import json

    from bigtrain.report import write_report

    def record(step, load):
        return {"step": step, "loss": 5.0 - step, "tokens_per_s": 100.0, "tokens": 256,
                "moe": {"layers.0.feed_forward": {"load": load, "dropped": 3, "aux": 1.25}}}

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        record(0, [10, 30, 20, 4]), record(1, [16, 16, 16, 16]))) + "\n")
    report = write_report(tmp_path).read_text()
    assert (tmp_path / "expert_load.png").stat().st_size > 0
    assert "| layers.0.feed_forward | 0.25 0.25 0.25 0.25 | 1.00 | 3 | 1.2500 |" in report
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0, "tokens_per_s": 1.0}) + "\n")
    assert "Expert load" not in write_report(dense).read_text() and not (dense / "expert_load.png").exists()
