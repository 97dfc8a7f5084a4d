"""Float8 linear layers (``precision.fp8``, bigtrain/fp8): the numerics against two independent
references, the swap, layouts against the one-process float8 run, training, and bad input.

Tolerances, from the arithmetic:
- Quantization is exact and deterministic (power-of-two scales): the quantized operands are
  compared bit for bit with a float64 transcription of the recipe.
- A GEMM of those operands differs from the float64 product only by the accumulation (fp32:
  about K 2^-24, within 1e-5 relative) and the one rounding of its output to the compute dtype
  (bf16: at most 2^-8 of each element). Rows are compared one by one (the largest row's relative
  error), so a row flushed to zero by a wrong (tensor instead of row) scale cannot hide behind a
  large one.
- Layouts (fp32 compute, emulated float8): a layout whose GEMMs see the same operands as the
  one-process run (ZeRO: the same micro-batches) is bit-identical to it. One that reassociates a
  sum (tp's partial sums) starts 1e-7 away, and float8 turns that into jumps of one float8 step
  (2^-4 to 2^-3 of an element) wherever a value sits that close to a rounding boundary: few at
  step 0 (a fraction ~1e-7 / 2^-4 of the elements), then, as the difference grows, more (after
  n steps single tensors differ at float8 noise, measured 3e-2 after 5 steps at tp = 2, 8e-8
  without float8). So step 0's gradients are held to 1e-4 (float8 misapplied on one side: ~1e-2),
  and the loss of every step, a mean over 256 tokens, to 1e-3 (measured <= 4e-5).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bigtrain.check.compare import relative_error
from bigtrain.check.reference import ReferenceRun
from bigtrain.config import ConfigError, load_config
from bigtrain.fp8.gemm import float8_matmul_nt
from bigtrain.fp8.linear import Float8Linear, apply_float8, convert_to_float8, float8_backend
from bigtrain.fp8.scaling import E4M3, E5M2, Float8Recipe, dequantize, quantize, quantize_transposed
from bigtrain.models.llama import build_model
from bigtrain.parallel.parallel_plan import Float8Plan
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from helpers import tiny_config, trainer_on_rank
from test_validation import _assert_rejected, train_cli  # noqa: F401 - the CLI fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fp8_feature_scaled import FeatureScaledFloat8Linear  # noqa: E402
from fp8_previous import PreviousFloat8Linear, use_previous_formulation  # noqa: E402

BF16_ROUNDING = 2.0**-8  # one rounding to bf16: at most half of its 2^-7 relative spacing
FP32_GEMM = 1e-5
GEMM_BOUND = {torch.float32: FP32_GEMM, torch.bfloat16: BF16_ROUNDING + FP32_GEMM}


# -------------------------------------------------------------------- an independent transcription

def transcribed_dequantized(t: torch.Tensor, fmt: torch.dtype, rowwise: bool) -> torch.Tensor:
    """docs/precision.md's recipe, written again in float64: s = 2^ceil(log2(amax / fmax)) per
    row (or per tensor), x -> float8(x / s) saturated, times s."""
    t64, fmax = t.detach().double(), torch.finfo(fmt).max
    amax = t64.abs().amax(-1, keepdim=True) if rowwise else t64.abs().amax()
    s = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-12) / fmax)))
    return (t64 / s).clamp(-fmax, fmax).to(fmt).double() * s


def transcribed_linear(x, w, g, rowwise: bool):
    """(y, dX, dW) of the float8 linear in float64, each GEMM's operands quantized along its
    reduction dimension: y = Q(x) Q(W)^T, dX = Q(dY) Q(W^T)^T, dW = Q(dY^T) Q(x^T)^T."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    q = transcribed_dequantized
    y = q(x2, E4M3, rowwise) @ q(w, E4M3, rowwise).T
    dx = q(g2, E5M2, rowwise) @ q(w.T, E4M3, rowwise).T
    dw = q(g2.T, E5M2, rowwise) @ q(x2.T, E4M3, rowwise).T
    return y, dx, dw


def worst_row_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest relative error of a row, ||a_i - e_i|| / ||e_i|| (absolute where e_i = 0)."""
    a = actual.reshape(-1, actual.shape[-1]).double()
    e = expected.reshape(-1, expected.shape[-1]).double()
    diff, scale = (a - e).norm(dim=1), e.norm(dim=1)
    return float(torch.where(scale > 0, diff / scale, diff).max())


def wide_range(*shape: int, seed: int) -> torch.Tensor:
    """Gaussian rows scaled by 2^-12 ... 2^12: one scale per tensor flushes the small rows, where
    one per row does not, so the two recipes differ (and a mix-up shows)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen)
    rows = t.reshape(-1, shape[-1])
    rows *= torch.exp2(torch.linspace(-12, 12, rows.shape[0])).unsqueeze(1)[torch.randperm(rows.shape[0],
                                                                                             generator=gen)]
    return t


def weight(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def run_linear(backend: str, scaling: str, dtype: torch.dtype, x, w, g, cls=Float8Linear):
    """(y, dX, dW) of a ``cls`` float8 linear holding ``w``, on ``x`` with output gradient ``g``."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight = nn.Parameter(w.to(dtype))
    layer = cls.from_linear(linear, Float8Recipe(scaling), backend)
    xx = x.to(dtype).requires_grad_()
    y = layer(xx)
    y.backward(g.to(dtype))
    return y.detach(), xx.grad, layer.weight.grad


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantization_is_the_recipe_bit_for_bit(fmt, rowwise):
    t = wide_range(64, 48, seed=1) * 3.7
    q, scale = quantize(t, fmt, rowwise)
    assert q.dtype == fmt and scale.dtype == torch.float32
    assert scale.shape == ((64, 1) if rowwise else ())
    assert torch.equal(torch.log2(scale), torch.log2(scale).round()), "scales are powers of two"
    assert torch.equal(dequantize(q, scale, torch.float64), transcribed_dequantized(t, fmt, rowwise))
    # Power-of-two scales make dequantization exact in bf16 as well.
    assert torch.equal(dequantize(q, scale, torch.bfloat16).double(), transcribed_dequantized(t, fmt, rowwise))


def test_power_of_two_scales_make_the_recipes_differ_only_below_a_tensors_float8_range():
    """Dividing by a power of two is exact, so a value's float8 rounding does not depend on which
    power-of-two scale it got unless it falls below the format's smallest normal number: tensorwise
    and rowwise agree on a tensor of narrow range and part on one of wide range."""
    gen = torch.Generator().manual_seed(9)
    magnitudes = 0.5 + 3.5 * torch.rand(32, 64, generator=gen)  # a range of 2^3: nothing near zero
    narrow = torch.where(torch.rand(32, 64, generator=gen) < 0.5, -magnitudes, magnitudes)
    assert torch.equal(dequantize(*quantize(narrow, E4M3, False), torch.float32),
                       dequantize(*quantize(narrow, E4M3, True), torch.float32))
    wide = wide_range(32, 64, seed=2)
    tensorwise = dequantize(*quantize(wide, E4M3, False), torch.float32)
    rowwise = dequantize(*quantize(wide, E4M3, True), torch.float32)
    assert worst_row_error(tensorwise, rowwise) > 0.5  # the smallest rows flushed to (nearly) zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_emulated_linear_matches_the_transcription(scaling, dtype):
    x, w, g = wide_range(2, 32, 64, seed=3), weight(96, 64), wide_range(2, 32, 96, seed=4) * 1e-3
    # The operands the transcription quantizes are the ones the layer sees (after the cast to dtype).
    want = transcribed_linear(x.to(dtype), w.to(dtype), g.to(dtype), scaling == "rowwise")
    got = run_linear("emulated", scaling, dtype, x, w, g)
    for name, a, e in zip(("output", "input gradient", "weight gradient"), got, want):
        err = worst_row_error(a, e)
        assert err <= GEMM_BOUND[dtype], f"{name}: worst row {err:.2e} > {GEMM_BOUND[dtype]:.1e}"
    # The other recipe is far off on these rows: the comparison can tell the two apart.
    other = transcribed_linear(x.to(dtype), w.to(dtype), g.to(dtype), scaling != "rowwise")
    assert max(worst_row_error(a, e) for a, e in zip(got, other)) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_emulated_linear_matches_torchaos_float8_training(scaling, dtype):
    """torchao's Float8Linear (emulate=True) with our recipe spelled in its config: e4m3 inputs and
    weights, e5m2 output gradients, power-of-two scales, per tensor or per row ("axiswise")."""
    pytest.importorskip("torchao")
    from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    gran = ScalingGranularity.AXISWISE if scaling == "rowwise" else ScalingGranularity.TENSORWISE
    config = Float8LinearConfig(cast_config_input=CastConfig(scaling_granularity=gran, target_dtype=E4M3),
                                cast_config_weight=CastConfig(scaling_granularity=gran, target_dtype=E4M3),
                                cast_config_grad_output=CastConfig(scaling_granularity=gran, target_dtype=E5M2),
                                round_scales_to_power_of_2=True, emulate=True)
    x, w, g = wide_range(2, 32, 64, seed=5), weight(96, 64), wide_range(2, 32, 96, seed=6) * 1e-3
    linear = nn.Linear(64, 96, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    theirs = TorchaoFloat8Linear.from_float(copy.deepcopy(linear), config)
    xx = x.to(dtype).requires_grad_()
    y = theirs(xx)
    y.backward(g.to(dtype))
    got = run_linear("emulated", scaling, dtype, x, w, g)
    for name, a, e in zip(("output", "input gradient", "weight gradient"), got,
                          (y.detach(), xx.grad, theirs.weight.grad)):
        err = worst_row_error(a, e)
        assert err <= GEMM_BOUND[dtype], f"{name}: worst row {err:.2e} > {GEMM_BOUND[dtype]:.1e}"


def _cpu_scaled_mm(scaling: str) -> bool:
    """Whether this torch build's CPU ``torch._scaled_mm`` takes ``scaling``'s scales (torch 2.11's
    CPU kernel takes per-tensor scales only; 2.13's rowwise too)."""
    rows = scaling == "rowwise"
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=E4M3), torch.zeros(16, 16, dtype=E4M3).t(),
                         scale_a=torch.ones((16, 1) if rows else ()), scale_b=torch.ones((1, 16) if rows else ()),
                         out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_scaled_mm_call_matches_the_emulation_on_the_cpu(scaling, dtype):
    """torch's CPU build runs ``torch._scaled_mm`` too: the kernel path's call (scales as
    dequantization factors, the column-major second operand, e5m2 first in backward) is checked
    here; the CUDA kernels' own constraints only on a GPU (test_scaled_mm_matches_the_emulation_on_cuda)."""
    if not _cpu_scaled_mm(scaling):
        pytest.skip(f"this torch build's CPU torch._scaled_mm takes no {scaling} scales")
    x, w, g = wide_range(2, 32, 64, seed=7), weight(96, 64), wide_range(2, 32, 96, seed=8) * 1e-3
    kernel = run_linear("scaled_mm", scaling, dtype, x, w, g)
    emulated = run_linear("emulated", scaling, dtype, x, w, g)
    for name, a, e in zip(("output", "input gradient", "weight gradient"), kernel, emulated):
        err = worst_row_error(a, e)
        assert err <= 2 * GEMM_BOUND[dtype], f"{name}: worst row {err:.2e}"  # each side rounds once


def _sm90_scaled_mm(calls: list):
    """``torch._scaled_mm`` holding each call to what the CUDA build takes on an H100/H200
    (torch's ScaledBlas.cpp: cuBLASLt there multiplies a row-major ``mat1`` by a column-major
    ``mat2`` only; every dimension but ``mat1``'s rows a multiple of 16; never two e5m2 operands; fp32
    scales, one element each or ``(M, 1)`` and ``(1, N)`` contiguous), then computing it from the
    dequantized operands. The CPU kernel is laxer: a call it takes can still fail on the GPU."""
    def checked(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        (m, k), (k2, n) = mat1.shape, mat2.shape
        assert k == k2 and k % 16 == 0 and n % 16 == 0, f"shapes {(m, k)} x {(k2, n)}: multiples of 16"
        assert mat1.stride(1) == 1 and mat2.stride(0) == 1, f"strides {mat1.stride()}, {mat2.stride()}: " \
                                                             "mat1 row-major, mat2 column-major"
        assert E5M2 not in (mat1.dtype, mat2.dtype) or mat1.dtype != mat2.dtype, "two e5m2 operands"
        assert scale_a.dtype == scale_b.dtype == torch.float32
        tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
        rowwise = (tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
                   and scale_a.is_contiguous() and scale_b.is_contiguous())
        assert tensorwise or rowwise, f"scales {tuple(scale_a.shape)}, {tuple(scale_b.shape)}"
        assert out_dtype in (torch.bfloat16, torch.float16, torch.float32) and bias is None
        calls.append("tensorwise" if tensorwise else "rowwise")
        return ((mat1.float() * scale_a) @ (mat2.float() * scale_b)).to(out_dtype)
    return checked


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_every_float8_gemm_call_is_one_the_cuda_kernels_take(scaling, monkeypatch):
    """A linear's three GEMMs (forward, input and weight gradient) on the ``scaled_mm`` backend call
    ``torch._scaled_mm`` as the CUDA build requires (see :func:`_sm90_scaled_mm`), the gradient in
    e5m2 as the first operand, with the scales of the recipe."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _sm90_scaled_mm(calls))
    x, w, g = wide_range(2, 32, 64, seed=7), weight(96, 64), wide_range(2, 32, 96, seed=8) * 1e-3
    kernel = run_linear("scaled_mm", scaling, torch.bfloat16, x, w, g)
    emulated = run_linear("emulated", scaling, torch.bfloat16, x, w, g)
    assert calls == [scaling] * 3
    for name, a, e in zip(("output", "input gradient", "weight gradient"), kernel, emulated):
        err = worst_row_error(a, e)
        assert err <= 2 * GEMM_BOUND[torch.bfloat16], f"{name}: worst row {err:.2e}"  # each side rounds once


# -------------------------------------------------------------------- against the previous formulation

def codes(q: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's bytes (``torch.equal`` compares float8 values as numbers, where the CPU
    build supports it at all: -0 and 0, and NaNs, would pass or fail by value)."""
    return q.view(torch.uint8)


def wide_columns(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows and columns both spanning 2^-12 ... 2^12, one column all zero (the EPS guard): a scale
    taken along the wrong dimension, or over the whole tensor, shows on some row or column."""
    t = wide_range(rows, cols, seed=seed)
    t *= torch.exp2(torch.linspace(-12, 12, cols))[torch.randperm(cols, generator=torch.Generator().manual_seed(seed))]
    t[:, 3] = 0
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantizing_in_place_then_transposing_the_codes_is_quantizing_the_transposed_copy(fmt, rowwise, dtype):
    """What the backward's transposed operands rely on: the codes and scales of ``t^T`` computed in
    ``t``'s layout equal those of a transposed copy, byte for byte (from a strided view too)."""
    t = (wide_columns(96, 80, seed=21) * 300).to(dtype)  # 300: some values saturate in e4m3
    for source in (t, t.t().contiguous().t()):  # contiguous, and a column-major view of the same values
        q, scale = quantize_transposed(source, fmt, rowwise)
        q_ref, scale_ref = quantize(source.t().contiguous(), fmt, rowwise)
        assert q.shape == q_ref.shape == (80, 96) and q.is_contiguous() and q.dtype == fmt
        assert torch.equal(codes(q), codes(q_ref))
        assert scale.shape == scale_ref.shape and scale.is_contiguous() and torch.equal(scale, scale_ref)


def _previous_and_current(scaling: str, dtype: torch.dtype, backend: str, x, w, g):
    """(y, dX, dW) of the current Float8Linear and of the previous formulation on the same data."""
    return [run_linear(backend, scaling, dtype, x, w, g, cls) for cls in (PreviousFloat8Linear, Float8Linear)]


@pytest.mark.parametrize("backend", ["emulated", "scaled_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_linear_equals_its_previous_formulation_bit_for_bit(scaling, dtype, backend):
    """The current formulation (each backward operand quantized in its own layout, the float8 codes
    transposed; tensorwise dW from the forward's float8 input) changes no bit of the output or of
    either gradient: same float8 operands, same GEMM calls."""
    if backend == "scaled_mm" and not _cpu_scaled_mm(scaling):
        pytest.skip(f"this torch build's CPU torch._scaled_mm takes no {scaling} scales")
    x, w = wide_columns(64, 64, seed=22).reshape(2, 32, 64), weight(96, 64)
    g = wide_columns(64, 96, seed=23).reshape(2, 32, 96) * 1e-3
    previous, current = _previous_and_current(scaling, dtype, backend, x, w, g)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), current, previous):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {(a.double() - b.double()).abs().max():.3e}"


def _signed_octave(shape: tuple[int, ...], seed: int, scales: torch.Tensor) -> torch.Tensor:
    """Values of magnitude 1 to 2 with random signs, times a power of two per last-dim index: every
    nonzero value of a row or a column within a few octaves of its largest (no float8 subnormal
    under any of the scalings)."""
    gen = torch.Generator().manual_seed(seed)
    mags = 1 + torch.rand(shape, generator=gen)
    signs = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return mags * signs * scales


@pytest.mark.parametrize("backend", ["emulated", "scaled_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_feature_scaled_benchmark_formulation_is_rowwise_where_no_value_is_subnormal(dtype, backend):
    """benchmarks/fp8_feature_scaled.py quantizes x and dY once per feature and folds the scales into
    the weight operand: with power-of-two scales a value's float8 rounding does not depend on its scale
    (only its exponent moves), so where no value falls to float8's subnormals or saturates, every GEMM
    multiplies the same rounded values as rowwise's, scaled by a power of two: the results are rowwise's,
    bit for bit. (Where values do fall there, each scaling keeps another window of exponents: what the
    block benchmark's error table measures.)"""
    if backend == "scaled_mm" and not _cpu_scaled_mm("rowwise"):
        pytest.skip("this torch build's CPU torch._scaled_mm takes no rowwise scales")
    x = _signed_octave((2, 32, 64), 31, torch.exp2(torch.arange(64) % 4.0))
    w = _signed_octave((96, 64), 32, torch.exp2(-(torch.arange(64) % 3.0)))
    g = _signed_octave((2, 32, 96), 33, torch.exp2(torch.arange(96) % 5.0) * 1e-3)
    rowwise = run_linear(backend, "rowwise", dtype, x, w, g)
    features = run_linear(backend, "rowwise", dtype, x, w, g, FeatureScaledFloat8Linear)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), features, rowwise):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {(a.double() - b.double()).abs().max():.3e}"
    # and float8 is in the results: they are not the plain product's
    assert not torch.equal(rowwise[0], (x.to(dtype) @ w.to(dtype).t()))


class _FeedForwardAndQuery(nn.Module):
    """What a block's float8 linears see, small: a SwiGLU (w1, w3 on one input, w2 on their product:
    the gradient the costliest quantization kernel on the GPU fused) and a fourth linear reading the
    same input as w1 and w3 (wq, wk, wv share theirs)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"w1": nn.Linear(64, 128, bias=False),
                                                    "w3": nn.Linear(64, 128, bias=False),
                                                    "w2": nn.Linear(128, 64, bias=False),
                                                    "wq": nn.Linear(64, 48, bias=False)})])

    def forward(self, x):
        b = self.layers[0]
        return b["w2"](torch.nn.functional.silu(b["w1"](x)) * b["w3"](x)) + b["wq"](x).sum(-1, keepdim=True)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_compiled_the_linear_equals_its_previous_formulation_bit_for_bit(scaling):
    """Compiled as a bf16 run compiles its blocks (inductor's fusions, the graph's merged
    quantizations), the current formulation's output and gradients equal the previous one's
    compiled the same way, bit for bit; eager, they equal the previous one's eager."""
    from bigtrain.parallel.compile import compiled_function, inductor_options

    torch.manual_seed(0)
    plain = _FeedForwardAndQuery()
    gen = torch.Generator().manual_seed(24)
    x = (torch.randn(2, 32, 64, generator=gen) * torch.exp2(torch.linspace(-6, 6, 64))).bfloat16()
    g = torch.randn(2, 32, 64, generator=gen).bfloat16() * 1e-3
    results = {}
    for name in ("previous", "current"):
        model = copy.deepcopy(plain)
        convert_to_float8(model, Float8Recipe(scaling), "emulated")
        if name == "previous":
            assert use_previous_formulation(model) == 4
        model = model.to(torch.bfloat16)
        for mode in ("compiled", "eager"):
            fn = compiled_function(model.forward, options=inductor_options("cpu", sixteen_bit=True)) \
                if mode == "compiled" else model.forward
            leaf = x.clone().requires_grad_()
            y = fn(leaf)
            y.backward(g)
            results[name, mode] = [y.detach(), leaf.grad] + [p.grad for p in model.parameters()]
            model.zero_grad(set_to_none=True)
    # compiled against compiled, eager against eager: inductor computes the SwiGLU between the
    # linears in fp32 registers where eager rounds each op to bf16, so the two modes differ anyway
    for mode in ("compiled", "eager"):
        for i, (a, b) in enumerate(zip(results["current", mode], results["previous", mode])):
            assert torch.equal(a, b), f"{mode} tensor {i}: {(a.double() - b.double()).abs().max():.3e}"


def test_tensorwise_keeps_the_float8_input_for_the_weight_gradient():
    """Tensorwise, the weight-gradient node keeps the forward's float8 input and its scale (1 byte
    an element), not the bf16 input; rowwise keeps the input (dW scales it along the tokens)."""
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    for scaling, kept in (("tensorwise", [(E4M3, (32, 64)), (torch.float32, ())]),
                          ("rowwise", [(torch.bfloat16, (32, 64))])):
        layer = Float8Linear.from_linear(nn.Linear(64, 96, bias=False).bfloat16(), Float8Recipe(scaling), "emulated")
        node = layer(x).grad_fn.next_functions[0][0]  # under the view: the weight-gradient node
        assert [(t.dtype, tuple(t.shape)) for t in node.saved_tensors] == kept


# -------------------------------------------------------------------- the swap

def test_the_swap_keeps_parameters_and_names_and_leaves_routers_norms_and_head():
    cfg = load_config(preset="moe-tiny", overrides=["--model.moe_shared_expert=true",
                                                    "--model.moe_shared_expert_gate=true"]).model
    model = build_model(cfg)
    before = dict(model.named_parameters())
    names = list(model.state_dict())
    record = convert_to_float8(model, Float8Recipe("rowwise"), "emulated")
    assert list(model.state_dict()) == names
    assert all(p is before[n] for n, p in model.named_parameters())
    swapped = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(record.names) and swapped
    assert not any(n.endswith(("router", "shared_gate")) or n == "output" for n in swapped)  # one output wide
    assert any(".shared." in n for n in swapped) and any(n.endswith("attention.wo") for n in swapped)
    # A class swap, not a forward put on the instance (tests grep for those too).
    assert all("forward" not in vars(m) for m in model.modules())
    assert apply_float8(model, Float8Plan("none"), "cpu") is None


def test_a_device_without_float8_matmuls_is_refused_when_the_model_is_built():
    assert float8_backend("cpu", emulate=True) == "emulated"
    with pytest.raises(ValueError, match="precision.fp8_emulate = true"):
        float8_backend("cpu", emulate=False)


# -------------------------------------------------------------------- layouts

LAYOUT_STEPS = 3


def _steps_with_grads(rank, world_size, cfg, run_dir, steps):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses, first_grads = [], {}
    for step in range(steps):
        keep = (lambda: first_grads.update(trainer.parallel.full_grads())) if step == 0 else None
        losses.append(trainer.train_step(before_update=keep).loss)
    return losses, first_grads


def _against_reference(cfg, tmp_path):
    ranks = run_ranks(_steps_with_grads, cfg.parallel.world_size, cfg, str(tmp_path), LAYOUT_STEPS, timeout=600)
    losses, grads = ranks[0]
    reference = ReferenceRun(cfg)
    ref = [reference.train_step() for _ in range(LAYOUT_STEPS)]
    loss_error = max(abs(a - r.loss) / r.loss for a, r in zip(losses, ref))
    grad_error = max(relative_error(grads[n], g) for n, g in ref[0].grads.items())
    return loss_error, grad_error


BIASES = ["--model.attention_bias=true", "--model.mlp_bias=true"]
LAYOUTS = [
    pytest.param(["--parallel.dp=2", "--parallel.zero=1"], "tensorwise", id="zero1-tensorwise"),
    pytest.param(["--parallel.dp=2", "--parallel.zero=2"], "rowwise", id="zero2-rowwise"),
    pytest.param(["--parallel.dp=2", "--parallel.zero=3"], "tensorwise", id="zero3-tensorwise"),
    # Biases: wo and w2, row-parallel, add theirs after the tp sum and stay float8 (they were silently
    # made plain linears: step 0's gradients then 8.8e-2 off the float8 reference, measured).
    pytest.param(["--parallel.tp=2", "--parallel.zero=1", *BIASES], "tensorwise", id="tp2-tensorwise-biases"),
    pytest.param(["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.zero=1", *BIASES], "rowwise",
                 id="tp2-sp-rowwise-biases"),
]


@pytest.mark.parametrize("layout, scaling", LAYOUTS)
def test_float8_layouts_match_the_one_process_float8_run(layout, scaling, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, f"--precision.fp8={scaling}", "--precision.fp8_emulate=true", *layout)
    loss_error, grad_error = _against_reference(cfg, tmp_path)
    assert grad_error <= 1e-4, f"step 0 gradients: {grad_error:.2e}"
    assert loss_error <= 1e-3, f"loss: {loss_error:.2e}"


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_checks_decide_at_the_bf16_bounds_no_looser(mode, scaling):
    """What ``bigtrain check`` and the layout fuzzer judge a float8 sample by (issue 27: fp8
    emulation at a bf16-level tolerance): the loss and the gradient norm decide, at bounds no wider
    than bf16's; the optimizer step replayed from the layout's own state stays at fp32's 1e-5;
    single tensors are reported only, as in bf16 (compare.py: float8 steps between layouts)."""
    from bigtrain.check.compare import TOLERANCES, tolerance_for

    for optimizer in ("adamw", "adamw8bit", "lion"):
        bound, bf16 = tolerance_for(mode, optimizer, fp8=scaling), TOLERANCES["bf16"]
        assert bound.decides("loss") and bound.loss <= bf16.loss == 1e-3
        assert bound.decides("grad_norm") and bound.grad_norm <= bf16.grad_norm
        assert bound.decides("replayed") and bound.replayed == 1e-5
        assert set(bound.diagnostic) == set(bf16.diagnostic)


def test_a_layout_without_its_float8_layers_fails_the_comparison(corpus_cache, tmp_path, monkeypatch):
    """The bounds can fail: the same tp = 2 layout with the swap skipped on the layout's side only
    (forked ranks inherit the patch; the reference still computes in float8)."""
    import bigtrain.parallel.build as build

    monkeypatch.setattr(build, "apply_float8", lambda model, plan, device: None)
    cfg = tiny_config(corpus_cache, "--precision.fp8=tensorwise", "--precision.fp8_emulate=true", "--parallel.tp=2")
    _, grad_error = _against_reference(cfg, tmp_path)
    assert grad_error > 1e-3


# -------------------------------------------------------------------- training

def _losses(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    return [trainer.train_step().loss for _ in range(cfg.train.steps)]


def test_the_loss_falls_with_float8_as_without(corpus_cache, tmp_path):
    """30 steps of tiny: the last 5 steps' mean loss with float8 emulation within 1.5% of the run
    without (the GPU acceptance's bound at 200 steps). fp32 compute, the faster on this CPU; measured
    in fp32 and bf16 in docs/precision.md (float8 0.05-0.08% above)."""
    common = ["--train.steps=30", "--parallel.zero=1", "--precision.fp8_emulate=true"]
    finals = {}
    for fp8 in ("none", "tensorwise", "rowwise"):
        cfg = tiny_config(corpus_cache, *common, f"--precision.fp8={fp8}")
        losses = run_ranks(_losses, 1, cfg, str(tmp_path / fp8), timeout=600)[0]
        finals[fp8] = sum(losses[-5:]) / 5
        assert finals[fp8] < losses[0] - 2.0, f"{fp8}: {losses[0]:.3f} -> {finals[fp8]:.3f}"
    for fp8 in ("tensorwise", "rowwise"):
        assert abs(finals[fp8] - finals["none"]) <= 0.015 * finals["none"], finals


# -------------------------------------------------------------------- bad input

def _problems(*overrides, **device):
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=list(overrides)), **device)
    return e.value.problems


def test_float8_without_float8_matmuls_is_refused_before_launch_with_the_fix():
    cpu = _problems("--precision.fp8=rowwise", "--precision.mode=bf16", cuda_available=False)
    assert len(cpu) == 1 and "the CPU" in cpu[0] and "precision.fp8_emulate = true" in cpu[0]
    ampere = _problems("--precision.fp8=tensorwise", "--precision.mode=bf16", cuda_available=True,
                       cuda_capability=(8, 0))
    assert len(ampere) == 1 and "CUDA capability 8.0" in ampere[0] and "precision.fp8_emulate = true" in ampere[0]
    forced_cpu = _problems("--precision.fp8=rowwise", "--precision.mode=bf16", "--train.device=cpu",
                           cuda_available=True, cuda_capability=(9, 0))
    assert "the CPU" in forced_cpu[0]
    for ok in ((9, 0), (8, 9)):
        validate(load_config(preset="tiny", overrides=["--precision.fp8=rowwise", "--precision.mode=bf16"]),
                 cuda_available=True, cuda_capability=ok)
    validate(load_config(preset="tiny", overrides=["--precision.fp8=rowwise", "--precision.fp8_emulate=true"]),
             cuda_available=False)


@pytest.mark.parametrize("overrides, field", [
    (["--precision.fp8=blockwise"], "precision.fp8 = 'blockwise'"),
    (["--precision.fp8=rowwise", "--precision.mode=fp16", "--precision.fp8_emulate=true"], "precision.mode = 'bf16'"),
    (["--precision.fp8=rowwise"], "the float8 kernels take and return bf16"),
    (["--precision.fp8=rowwise", "--precision.fp8_emulate=true", "--memory.activation_compression=int8"],
     "memory.activation_compression"),
    (["--precision.fp8=rowwise", "--precision.mode=bf16", "--data.seq_len=18"], "train.micro_batch x data.seq_len"),
    (["--precision.fp8=tensorwise", "--precision.mode=bf16", "--model.dim=72", "--model.n_heads=4",
      "--model.n_kv_heads=4"], "model.dim = 72"),
], ids=["unknown-recipe", "fp16", "fp32-kernels", "int8-compression", "tokens-not-16", "dim-not-16"])
def test_float8_combinations_that_cannot_run_are_refused(overrides, field):
    problems = _problems(*overrides)
    assert len(problems) == 1 and field in problems[0], problems


def test_the_cli_refuses_float8_on_this_cpu_before_any_rank_starts(train_cli):  # noqa: F811
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, out, err = train_cli("--precision.fp8=rowwise", "--precision.mode=bf16")
    _assert_rejected(train_cli, code, out, err, "precision.fp8 = 'rowwise'", "precision.fp8_emulate = true")


# -------------------------------------------------------------------- on a GPU (pending until one is lent)

def _cuda_float8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def scaled_mm_against_fp32(scaling: str, device: str, tokens: int, k: int, n: int) -> dict[str, tuple[float, float]]:
    """{GEMM: (worst row error, its bound)} of a linear's three GEMMs on ``torch._scaled_mm``
    against the same float8 operands dequantized, multiplied in fp32 and rounded to bf16."""
    rowwise = scaling == "rowwise"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=device, generator=gen) * 0.02).bfloat16()
    g = (torch.randn(tokens, n, device=device, generator=gen) * 1e-4).bfloat16()
    cases = {"forward": (x, E4M3, w, E4M3, True), "input gradient": (g, E5M2, w.t(), E4M3, False),
             "weight gradient": (g.t(), E5M2, x.t(), E4M3, False)}
    out = {}
    for name, (a, fa, b, fb, fast) in cases.items():
        kernel = float8_matmul_nt(a, fa, b, fb, rowwise, "scaled_mm", torch.bfloat16, fast)
        exact = float8_matmul_nt(a, fa, b, fb, rowwise, "emulated", torch.float32).bfloat16()
        out[name] = (worst_row_error(kernel.float(), exact.float()), 2e-2 if fast else BF16_ROUNDING + FP32_GEMM)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_float8(), reason="needs a CUDA device of capability >= 8.9")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_scaled_mm_matches_the_emulation_on_cuda(scaling):
    """The three GEMMs of a llama-1b feed-forward linear (8192 tokens, 2048 -> 8192) on the float8
    kernels. Without fast accumulation each output element differs from the fp32 product of the same
    operands by the final bf16 rounding (2^-8) and fp32 reassociation; the forward's fast
    accumulation keeps fewer accumulator bits (DeepSeek-V3's report measured ~14 bits on H800, up to
    ~2% on single elements at K = 4096): its rows are held to 2e-2. A wrong scale or layout is O(1)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 side must be fp32
    try:
        errors = scaled_mm_against_fp32(scaling, "cuda", 8192, 2048, 8192)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for name, (err, bound) in errors.items():
        assert err <= bound, f"{name}: worst row {err:.2e} > {bound:.1e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_float8(), reason="needs a CUDA device of capability >= 8.9")
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_training_on_cuda_follows_the_emulated_reference(scaling, corpus_cache, tmp_path):
    """The trainer on the float8 kernels (bf16, ZeRO-1, one GPU) against the reference emulating
    float8 on the same GPU, 4 steps at the float8 bounds of ``bigtrain check`` (loss 1e-3, gradient
    norm 2e-2): the two differ by accumulation order, which float8 rounding amplifies into
    float8-level noise in single tensors, as between layouts."""
    from bigtrain.check.compare import tolerance_for
    from bigtrain.check.run import check_layout
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.train import Trainer

    # Eager: the float8 kernels as the linears call them (compile.enabled = 'auto' would compile on
    # CUDA; benchmarks/bench_gpu.py's fp8 variants run them compiled).
    cfg = tiny_config(corpus_cache, f"--precision.fp8={scaling}", "--precision.mode=bf16", "--parallel.zero=1",
                      "--compile.enabled=false")
    assert Trainer(cfg, tmp_path / "probe", Mesh({}), "cuda").parallel.float8.backend == "scaled_mm"
    report = check_layout(cfg, Mesh({}), tmp_path / "check", steps=4, device="cuda")
    assert report.agree, report.text()
    assert report.tolerance == tolerance_for("bf16", "adamw", fp8=scaling)
