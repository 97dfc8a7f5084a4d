"""The memory-efficient optimizers on one process, each against an independent reference:
Adafactor against torch.optim.Adafactor, Lion against a transcription of the paper's Algorithm 2,
8-bit AdamW against the same block-wise quantization written plainly here (exactly) and against
fp32 AdamW (within the quantization's error)."""

from __future__ import annotations

import math

import pytest
import torch

from bigtrain.config import OptimConfig
from bigtrain.optim import build_optimizer, get_optimizer
from bigtrain.optim.pieces import ParamPiece


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))


def _params(seed=0):
    torch.manual_seed(seed)
    return {"w": torch.randn(40, 24), "stack": torch.randn(3, 10, 7), "b": torch.randn(40) * 0.1}


def _grads(step, shapes):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) * (0.01 + step) for n, s in shapes.items()}


def _run(make, steps=6, lr_of=lambda t: 1e-2):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _params().items()}
    opt = make(params)
    for t in range(steps):
        for n, g in _grads(t, {n: p.shape for n, p in params.items()}).items():
            params[n].grad = g
        for group in opt.param_groups:
            group["lr"] = lr_of(t)
        opt.step()
        yield {n: p.detach().clone() for n, p in params.items()}, opt


def _groups(params, wd):
    return [{"params": [params["w"], params["stack"]], "weight_decay": wd},
            {"params": [params["b"]], "weight_decay": 0.0}]


# -- Adafactor ------------------------------------------------------------------------------------
def test_adafactor_matches_torch_every_step():
    cfg = OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.1)
    ours = _run(lambda ps: get_optimizer("adafactor").build(_groups(ps, cfg.weight_decay), cfg))
    theirs = _run(lambda ps: torch.optim.Adafactor(_groups(ps, cfg.weight_decay), lr=cfg.lr))
    for (a, opt_a), (b, opt_b) in zip(ours, theirs):
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-7, msg=n)
    state = opt_a.state[opt_a.param_groups[0]["params"][0]]
    assert state["row_var"].numel() + state["col_var"].numel() == 40 + 24  # O(rows + cols)


def test_adafactor_on_pieces_equals_whole():
    """A parameter split in row blocks and flat ranges (as tp x ZeRO would), the pieces' sums added
    by hand: each piece's update equals the same elements of the whole parameter's update."""
    from bigtrain.parallel.placement import even_shard

    cfg = OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0)
    full = torch.randn(8, 6)
    whole = torch.nn.Parameter(full.clone())
    ref = get_optimizer("adafactor").build([{"params": [whole], "weight_decay": 0.0}], cfg)
    # two tp parts along dim 0, each cut in two flat ranges: four "ranks"
    pieces, tensors = [], []
    for part in range(2):
        cut = even_shard(8, 2, part, dim=0)
        local = cut.local_from_full(full)
        for lo, hi in ((0, 10), (10, 24)):
            pieces.append(ParamPiece(tuple(local.shape), lo, hi - lo, (cut,), ()))
            tensors.append(torch.nn.Parameter(local.reshape(-1)[lo:hi].clone()))
    opts = [get_optimizer("adafactor").build([{"params": [t], "weight_decay": 0.0}], cfg) for t in tensors]
    for o, t, pc in zip(opts, tensors, pieces):
        o.attach_pieces({id(t): pc})
    for step in range(3):
        g = torch.randn(8, 6)
        whole.grad = g
        ref.step()
        # The four "ranks", their sums added by hand where a process group would all-reduce them.
        for k, t in enumerate(tensors):
            lo, hi = ((0, 10), (10, 24))[k % 2]
            t.grad = even_shard(8, 2, k // 2, 0).local_from_full(g).reshape(-1)[lo:hi].clone()
        total = sum(o._partial_sums(t, pc) for o, t, pc in zip(opts, tensors, pieces))
        updates = [o._update(o.param_groups[0], t, pc, total) for o, t, pc in zip(opts, tensors, pieces)]
        norm = sum(u.pow(2).sum() for u, _ in updates)
        rms = norm.sqrt().item() / math.sqrt(48)
        for t, (u, alpha) in zip(tensors, updates):
            t.data.add_(u, alpha=-alpha / max(1.0, rms))
        got = torch.cat([torch.cat([tensors[0], tensors[1]]).view(4, 6), torch.cat([tensors[2], tensors[3]]).view(4, 6)])
        torch.testing.assert_close(got, whole.detach(), rtol=1e-6, atol=1e-7)


# -- Lion -----------------------------------------------------------------------------------------
def _lion_paper(params, grads, m, lr, b1, b2, wd):
    """Algorithm 2 of Chen et al. (2023), line by line, one tensor at a time."""
    for n in params:
        g = grads[n]
        c = b1 * m[n] + (1 - b1) * g  # update = interp(g, m) with beta1
        theta = params[n]
        theta = theta - lr * (torch.sign(c) + wd * theta)  # decoupled weight decay
        params[n] = theta
        m[n] = b2 * m[n] + (1 - b2) * g  # momentum with beta2


def test_lion_matches_the_paper():
    cfg = OptimConfig(name="lion", lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.5)
    params = {n: t.clone() for n, t in _params().items()}
    m = {n: torch.zeros_like(t) for n, t in params.items()}
    for t, (ours, _) in enumerate(_run(lambda ps: get_optimizer("lion").build(_groups(ps, cfg.weight_decay), cfg),
                                       lr_of=lambda t: 1e-3)):
        grads = _grads(t, {n: p.shape for n, p in params.items()})
        decayed = {n: 0.5 if n != "b" else 0.0 for n in params}
        for n in params:
            one = {n: params[n]}
            mm = {n: m[n]}
            _lion_paper(one, {n: grads[n]}, mm, 1e-3, 0.9, 0.99, decayed[n])
            params[n], m[n] = one[n], mm[n]
        for n in params:
            torch.testing.assert_close(ours[n], params[n], rtol=1e-6, atol=1e-7, msg=n)


# -- 8-bit AdamW ----------------------------------------------------------------------------------
def _plain_quantize(x: torch.Tensor, signed: bool, block: int):
    """The code maps of bigtrain.optim.quantize, written out: per block, scale = max |x|; a value's
    code is its log-step from the smallest magnitude, rounded (0 below half the smallest)."""
    smallest, steps = (1e-5, 127) if signed else (1e-8, 255)
    log_ratio = -math.log(smallest) / (steps - 1)
    codes, scales = [], []
    for lo in range(0, x.numel(), block):
        b = x[lo:lo + block]
        scale = b.abs().max()
        scales.append(scale)
        rel = b.abs() / (scale if scale > 0 else torch.tensor(1.0))
        k = (rel / smallest).log() / log_ratio
        k = k.round().clamp(0, steps - 1) + 1
        k = torch.where(rel < smallest / 2, torch.zeros_like(k), k)
        codes.append(k * b.sign() if signed else k)
    return torch.cat(codes).to(torch.int8 if signed else torch.uint8), torch.stack(scales)


def _plain_dequantize(codes, scales, signed, block):
    smallest, steps = (1e-5, 127) if signed else (1e-8, 255)
    log_ratio = -math.log(smallest) / (steps - 1)
    k = codes.long().abs() if signed else codes.long()
    mags = torch.exp(math.log(smallest) + (k - 1).double() * log_ratio).float()
    mags = torch.where(k == steps, torch.ones_like(mags), mags)
    vals = torch.where(k == 0, torch.zeros_like(mags), mags) * (codes.long().sign() if signed else 1)
    return vals * scales.repeat_interleave(block)[:codes.numel()]


@pytest.mark.parametrize("block", [64, 256])
def test_adamw8bit_state_equals_plain_blockwise_reference_exactly(block):
    cfg = OptimConfig(name="adamw8bit", lr=1e-2, weight_decay=0.1, block_size=block)
    p = torch.nn.Parameter(torch.randn(37, 29))  # 1073 elements: a short last block
    ref_p = p.detach().clone()
    opt = get_optimizer("adamw8bit").build([{"params": [p], "weight_decay": 0.1}], cfg)
    m_c = torch.zeros(p.numel(), dtype=torch.int8)
    v_c = torch.zeros(p.numel(), dtype=torch.uint8)
    nb = -(-p.numel() // block)
    m_s, v_s = torch.zeros(nb), torch.zeros(nb)
    for t in range(1, 6):
        g = torch.randn(37, 29) * 10 ** (-t)
        p.grad = g
        opt.step()
        # the reference step
        ref_p.mul_(1 - 1e-2 * 0.1)
        m = _plain_dequantize(m_c, m_s, True, block)
        v = _plain_dequantize(v_c, v_s, False, block)
        gf = g.reshape(-1)
        m = m.lerp(gf, 0.1)
        v = v * 0.95 + 0.05 * gf * gf
        denom = v.sqrt() / math.sqrt(1 - 0.95 ** t) + 1e-8
        ref_p.view(-1).addcdiv_(m, denom, value=-1e-2 / (1 - 0.9 ** t))
        m_c, m_s = _plain_quantize(m, True, block)
        v_c, v_s = _plain_quantize(v, False, block)
        state = opt.state[p]
        assert torch.equal(state["exp_avg"].view(-1), m_c) and torch.equal(state["exp_avg_sq"].view(-1), v_c)
        assert torch.equal(state["exp_avg_scale"], m_s) and torch.equal(state["exp_avg_sq_scale"], v_s)
        # The codes and scales are exact; the weights may round differently by one ulp a step: how
        # addcmul_ / addcdiv_ round depends on the CPU's vector kernels (on an AVX-512 Xeon 5.6% of
        # addcmul_'s results differ in the last bit from the reference's separate ops), a last-bit
        # difference in an update ~1e-2 of the weight, so at most one rounding of p apart per step:
        # t ulps of p (2**-23 relative each) after step t.
        torch.testing.assert_close(p.detach(), ref_p, rtol=t * 2 ** -23, atol=0)


def test_adamw8bit_close_to_fp32_adamw():
    """Against torch's AdamW: the quantization's error (a few % of each moment) stays a small
    fraction of the parameter change over 20 steps (stated tolerance: 5% of the change's norm)."""
    cfg = OptimConfig(name="adamw8bit", lr=1e-2, weight_decay=0.0, beta2=0.999, block_size=256)
    start = _params()
    ours = list(_run(lambda ps: get_optimizer("adamw8bit").build(_groups(ps, 0.0), cfg), steps=20))[-1][0]
    theirs = list(_run(lambda ps: torch.optim.AdamW(_groups(ps, 0.0), lr=1e-2, betas=(0.9, 0.999), eps=1e-8),
                       steps=20))[-1][0]
    for n in ours:
        change = (theirs[n] - start[n]).norm()
        assert (ours[n] - theirs[n]).norm() <= 0.05 * change, n


def test_adamw8bit_shard_at_block_boundary_keeps_the_same_state():
    """A flat range starting at a block boundary (and ending at one), stepped alone, holds bit for bit the state and
    values the whole tensor's optimizer holds for those elements (what ZeRO relies on)."""
    cfg = OptimConfig(name="adamw8bit", lr=1e-2, block_size=64)
    full = torch.nn.Parameter(torch.randn(1000))
    part = torch.nn.Parameter(full.detach()[128:704].clone())
    o_full = get_optimizer("adamw8bit").build([{"params": [full], "weight_decay": 0.0}], cfg)
    o_part = get_optimizer("adamw8bit").build([{"params": [part], "weight_decay": 0.0}], cfg)
    for _ in range(4):
        g = torch.randn(1000)
        full.grad, part.grad = g, g[128:704].clone()
        o_full.step(), o_part.step()
    assert torch.equal(full.detach()[128:704], part.detach())
    assert torch.equal(o_full.state[full]["exp_avg"][128:704], o_part.state[part]["exp_avg"])
    assert torch.equal(o_full.state[full]["exp_avg_sq_scale"][2:11], o_part.state[part]["exp_avg_sq_scale"])


# -- declared bytes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,per_param", [("adamw", 8), ("adamw8bit", 2 + 8 / 256), ("lion", 4)])
def test_state_bytes_measured_equal_declared(name, per_param):
    from bigtrain.memory.accounting import optimizer_tensors, tensor_bytes

    model = torch.nn.Linear(512, 512, bias=False)
    cfg = OptimConfig(name=name)
    opt = build_optimizer(model, cfg)
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    measured = tensor_bytes(optimizer_tensors(opt))
    spec = get_optimizer(name)
    assert measured == spec.state_bytes(model.weight.numel(), 1, cfg)
    assert abs(measured / model.weight.numel() - per_param) < 0.01


def test_adafactor_state_is_rows_plus_columns():
    from bigtrain.memory.accounting import optimizer_tensors, tensor_bytes

    model = torch.nn.Linear(512, 384, bias=False)
    cfg = OptimConfig(name="adafactor")
    opt = build_optimizer(model, cfg)
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    measured = tensor_bytes(optimizer_tensors(opt))
    assert measured == get_optimizer("adafactor").state_bytes(model.weight.numel(), 1, cfg, [(384, 512)])
    assert measured == 4 * (384 + 512) + 4
