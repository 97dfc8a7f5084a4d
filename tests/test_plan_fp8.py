"""The planner's float8 accounting (``precision.fp8``): the profiles' float8 rate, the time of a
float8 linear's GEMMs and casts (plan/gemm.py), its operand copies (plan/memory.py), and the layout
key that carries it from a config to ``--parallel auto``'s overrides."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.plan import evaluate
from bigtrain.plan.fit import _layout
from bigtrain.plan.gemm import block_times, float8_cast_bytes, float8_gemm_seconds, gemm_seconds
from bigtrain.plan.hardware import get_profile
from bigtrain.plan.layout import Cluster, Layout, parse_layout
from bigtrain.plan.memory import float8_operand_bytes
from bigtrain.plan.model import ModelSpec

H100, H200, A100 = (get_profile(name) for name in ("h100-80g", "h200-141g", "a100-80g"))
LLAMA_1B = ModelSpec.from_model_config(load_config(preset="llama-1b").model, 2048)


def test_the_gpu_profiles_carry_the_datasheets_dense_float8_rate():
    # H100 / H200 SXM datasheets: 3,958 TFLOP/s fp8 with 2:4 sparsity, 1,979 dense: twice bf16's 989.
    assert H100.peak_flops_fp8 == H200.peak_flops_fp8 == 1979e12
    assert H100.peak_flops_fp8 == pytest.approx(2 * H100.peak_flops_bf16, rel=1e-3)
    assert "1,979 dense fp8" in H100.source and "H200 SXM datasheet" in H200.source
    assert A100.peak_flops_fp8 == 0 and get_profile("cpu").peak_flops_fp8 == 0  # no float8 tensor cores


def test_a_large_float8_gemm_is_half_the_bf16_one_where_the_profile_has_no_kernel_figures():
    m = n = k = 8192.0
    plain = H100.with_values(gemm_kernel_fraction=0.0, gemm_kernel_fraction_fp8=0.0)
    bf16_compute = 2 * m * n * k / (H100.peak_flops_bf16 * 0.58 * (m / (m + 64)) ** 3)
    assert gemm_seconds(plain, "bf16", m, n, k) == pytest.approx(bf16_compute)
    fp8_compute = bf16_compute * H100.peak_flops_bf16 / H100.peak_flops_fp8  # about half
    assert float8_gemm_seconds(plain, "bf16", m, n, k) == pytest.approx(fp8_compute)
    # Without float8 tensor cores (emulation) the GEMM keeps its precision.
    assert float8_gemm_seconds(A100, "bf16", m, n, k) == gemm_seconds(A100, "bf16", m, n, k)


def test_a_float8_gemm_keeps_what_the_fitted_curve_carries_beside_the_kernel():
    # The Hopper profiles' kernel figures (from the H200's profile): the fitted bf16 time less its
    # kernel at 0.81 of the curve's peak share, plus the float8 kernel at 0.76.
    m = n = k = 8192.0
    assert (H100.gemm_kernel_fraction, H100.gemm_kernel_fraction_fp8) == (H200.gemm_kernel_fraction,
                                                                           H200.gemm_kernel_fraction_fp8) == (0.81, 0.76)
    fitted = gemm_seconds(H200, "bf16", m, n, k)
    flops, shape = 2 * m * n * k, (m / (m + 64)) ** 3
    kernel = flops / (H200.peak_flops_bf16 * 0.81 * shape)
    float8 = flops / (H200.peak_flops_fp8 * 0.76 * shape)
    assert float8_gemm_seconds(H200, "bf16", m, n, k) == pytest.approx(fitted - kernel + float8)
    assert fitted - kernel == pytest.approx(fitted * (1 - 0.58 / 0.81))  # 28% of the fitted time stays


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_the_casts_bytes_per_recipe_are_the_code_passes(compiled):
    m, n, k = 8192.0, 4096.0, 2048.0
    q = 2 * 2 + 1 if compiled else 8 * 2 + 1  # an amax pass and a cast of a bf16 element (eager: five kernels)
    mk, nk, mn = m * k, n * k, m * n
    tensorwise = float8_cast_bytes("bf16", "tensorwise", compiled, False, m, n, k)
    # x quantized once (its codes transposed for dW), W for the forward and for dX (then transposed),
    # dY once for both backward GEMMs compiled (eager: once in each autograd node), transposed for dW
    assert tensorwise == pytest.approx((q * (mk + nk), q * mn + (q + 2) * nk,
                                        2 * mk + (2 if compiled else q + 2) * mn))
    rowwise = float8_cast_bytes("bf16", "rowwise", compiled, False, m, n, k)  # every operand once per GEMM
    assert rowwise == pytest.approx((q * (mk + nk), q * mn + (q + 2) * nk, (q + 2) * (mk + mn)))
    # emulated (no float8 matmuls): each operand dequantized for each of its GEMMs besides
    emulated = float8_cast_bytes("bf16", "rowwise", compiled, True, m, n, k)
    d = 3 if compiled else 7
    assert [e - r for e, r in zip(emulated, rowwise)] == pytest.approx([d * (mk + nk), d * (mn + nk), d * (mn + mk)])


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_eager_cast_bytes_are_what_one_float8_linear_reads_and_writes(scaling):
    """The eager table of plan/gemm.py against the bytes every ATen op of one Float8Linear's forward
    and backward reads and writes, the float8 GEMMs and views aside (scaled_mm on the CPU)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from bigtrain.fp8.linear import Float8Linear
    from bigtrain.fp8.scaling import Float8Recipe

    m, n, k = 512, 96, 64  # every operand's rows (<= m) far fewer elements than an operand (>= n k)
    skipped = {torch.ops.aten._scaled_mm.default}
    small = m  # scales: one a row at most

    class Bytes(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in skipped and not func.is_view and func._schema.name != "aten::detach":
                tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                Bytes.moved += sum(t.numel() * t.element_size() for t in tensors if t.numel() > small)
            return out

    linear = Float8Linear(k, n, bias=False, recipe=Float8Recipe(scaling), backend="scaled_mm", dtype=torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, dtype=torch.bfloat16)
    y = linear(x)
    with Bytes():  # the forward again, counted
        y = linear(x)
        y.backward(grad)
    # the input gradient and the weight gradient are written by the GEMMs (skipped); nothing else moves
    assert Bytes.moved == sum(float8_cast_bytes("bf16", scaling, False, False, m, n, k))


def test_float8_speeds_up_compiled_blocks_where_there_are_float8_matmuls_and_slows_them_where_not():
    # (tensorwise: rowwise's casts move 1.6x its bytes, on the H100's 3.35 TB/s more than its GEMMs save)
    bf16, fp8 = Layout(micro_batch=4, compiled=True), Layout(micro_batch=4, fp8="tensorwise", compiled=True)
    for hw, faster in ((H100, True), (A100, False)):
        plain, float8 = block_times(LLAMA_1B, bf16, hw), block_times(LLAMA_1B, fp8, hw)
        assert (float8.forward < plain.forward) == faster and (float8.backward < plain.backward) == faster
    step = {f: evaluate(LLAMA_1B, Layout(micro_batch=4, fp8=f, compiled=True), Cluster.build(1, H100), 4).time.step_time_s
            for f in ("none", "tensorwise")}
    assert step["tensorwise"] < step["none"]
    # Eager, each quantization is five kernels (abs, amax, division, clamp, cast: 17 bytes a bf16
    # element, not 5): more than the float8 GEMMs save (torchao, too, needs torch.compile for a speed-up).
    eager = {f: block_times(LLAMA_1B, Layout(micro_batch=4, fp8=f), H100) for f in ("none", "tensorwise")}
    assert eager["tensorwise"].forward > eager["none"].forward


def test_the_routers_and_experts_of_a_moe_block_stay_in_bf16():
    moe = ModelSpec.from_model_config(load_config(preset="moe-tiny").model, 64)
    layout = Layout(micro_batch=4, fp8="tensorwise")
    from bigtrain.plan.gemm import linear_shapes

    shapes = linear_shapes(moe, layout, 256, moe=True)
    assert [float8 for *_, float8 in shapes] == [True] * 4 + [False] * (len(shapes) - 4)


def test_the_float8_operand_copies_are_counted_as_a_buffer():
    layout = Layout(micro_batch=4, fp8="rowwise")
    # llama-1b, 8192 tokens: the worst GEMM is a feed-forward linear's dW, dY's and x's codes in their
    # own layout and transposed, 2 x 8192 x (8192 + 2048) bytes, and eager the bf16 quotient of the
    # largest operand (dY, 8192 x 8192) as it is cast: 160 + 128 MiB; compiled, the codes alone.
    assert float8_operand_bytes(LLAMA_1B, layout) == 2 * 8192 * (8192 + 2048) + 2 * 8192 * 8192 == 288 * 2**20
    assert float8_operand_bytes(LLAMA_1B, Layout(micro_batch=4, fp8="rowwise", compiled=True)) == 160 * 2**20
    cluster = Cluster.build(1, H100)
    with_fp8, without = (evaluate(LLAMA_1B, lay, cluster, 4).memory for lay in (layout, Layout(micro_batch=4)))
    assert with_fp8.buffers["fp8_operands"] == 288 * 2**20 and "fp8_operands" not in without.buffers
    assert with_fp8.activations == without.activations  # eager rowwise saves the bf16 input, as F.linear does
    # tp = 2 halves the feed-forward's local width.
    assert float8_operand_bytes(LLAMA_1B, Layout(tp=2, micro_batch=4, fp8="rowwise")) == \
        2 * 8192 * (4096 + 2048) + 2 * 8192 * 4096


def test_compiled_float8_blocks_keep_fewer_activations_than_bf16_ones():
    # compiled, either recipe: no norm output, no SwiGLU product (2 B h + B F a token and block fewer:
    # 3.0 GiB of llama-1b at 4 x 2048 tokens; the H200 measured 22.2 -> 19.5 / 19.6 GiB peaks)
    bf16 = evaluate(LLAMA_1B, Layout(micro_batch=4, compiled=True), Cluster.build(1, H200), 4).memory
    h, f = LLAMA_1B.hidden, LLAMA_1B.ffn_hidden
    for scaling in ("tensorwise", "rowwise"):
        fp8 = evaluate(LLAMA_1B, Layout(micro_batch=4, compiled=True, fp8=scaling), Cluster.build(1, H200), 4).memory
        scales = 16 * 4 * 11 if scaling == "tensorwise" else 0  # a block's fp32 tensorwise scales
        assert bf16.activations - fp8.activations == 8192 * 16 * (2 * 2 * h + 2 * f) - scales


def _saved_by_the_model(scaling: str, compiled: bool, tmp_path) -> tuple[int, int]:
    """(bytes a tiny bf16 Llama with float8 linears saves for backward, the planner's figure)."""
    import torch

    from bigtrain.fp8.linear import convert_to_float8
    from bigtrain.fp8.scaling import Float8Recipe
    from bigtrain.parallel.build import token_loss_sum
    from bigtrain.memory.accounting import SavedActivations
    from bigtrain.models.llama import build_model
    from bigtrain.plan.activations import block_activations, head_activations
    from bigtrain.parallel.compile import apply_compile
    from helpers import tiny_config

    cfg = tiny_config(str(tmp_path), "--precision.mode=bf16", "--model.ffn_hidden=160")
    model = build_model(cfg.model, "cpu")
    convert_to_float8(model, Float8Recipe(scaling), "scaled_mm")
    model.init_weights(0)
    model.to(torch.bfloat16)
    model.init_buffers()
    loss = apply_compile(model, token_loss_sum, device="cpu").loss_fn if compiled else token_loss_sum
    batch, seq = 4, 24  # 96 tokens: the float8 GEMMs' dimensions multiples of 16
    window = torch.randint(0, 256, (batch, seq + 1))
    with SavedActivations(model) as tracker:
        loss(model(window[:, :-1]), window[:, 1:])
    spec = ModelSpec.from_model_config(cfg.model, seq)
    blocks = block_activations(spec, "bf16", compiled=compiled, fp8=scaling)
    head = head_activations(spec, "bf16", compiled=compiled)
    layers = cfg.model.n_layers
    return tracker.peak, batch * seq * layers * blocks.per_token() + layers * blocks.per_block + head.bytes(batch, seq)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_float8_activation_list_matches_the_saved_tensors(scaling, tmp_path):
    measured, predicted = _saved_by_the_model(scaling, False, tmp_path)
    assert measured == predicted


@pytest.mark.slow
def test_the_compiled_float8_activation_list_matches_the_saved_tensors(tmp_path):
    measured, predicted = _saved_by_the_model("tensorwise", True, tmp_path)  # one cold compile: rowwise keeps as much
    assert measured == predicted


def test_the_layout_key_goes_from_the_config_to_the_overrides():
    cfg = load_config(preset="tiny", overrides=["--precision.fp8=rowwise", "--precision.mode=bf16"])
    layout = _layout(cfg)
    assert layout.fp8 == "rowwise" and "fp8=rowwise" in layout.describe()
    assert "--precision.fp8=rowwise" in layout.to_overrides()
    assert not any("fp8" in o for o in Layout().to_overrides())
    assert parse_layout("dp=2,fp8=tensorwise") == {"dp": 2, "fp8": "tensorwise"}
    with pytest.raises(Exception, match="fp8"):
        parse_layout("fp8=blockwise")


def test_every_precision_fp8_choice_reaches_the_plan_as_it_is():
    from bigtrain.fp8.checks import FP8_RECIPES
    from bigtrain.fp8.scaling import SCALINGS
    from bigtrain.plan.layout import FP8

    assert FP8 == FP8_RECIPES == ("none", *SCALINGS)
    steps = {}
    for choice in FP8:
        cfg = load_config(preset="llama-1b", overrides=[f"--precision.fp8={choice}", "--train.global_batch=4",
                                                        "--train.micro_batch=4", "--compile.enabled=true"])
        layout = _layout(cfg, cuda=True)
        assert layout.fp8 == choice and layout.compiled
        steps[choice] = evaluate(LLAMA_1B, layout, Cluster.build(1, H200), 4).time.step_time_s
    # each recipe priced as its own (the H200 measured 110.9, 102.9 and 112.4 ms: docs/benchmarks.md)
    assert steps["tensorwise"] < steps["rowwise"] and steps["tensorwise"] < steps["none"]


def test_bigtrain_plan_prices_the_configs_fp8_unless_the_layout_names_one(tmp_path):
    import argparse

    from bigtrain.plan.cli import add_plan_parser, resolve

    path = tmp_path / "run.toml"
    path.write_text('[model]\ndim = 64\nn_layers = 2\nn_heads = 4\n[data]\nseq_len = 32\n'
                    '[precision]\nmode = "bf16"\nfp8 = "rowwise"\n[optim]\ngrad_clip = 0.0\n')
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    _, _, _, fixed = resolve(parser.parse_args(["plan", "--config", str(path)]))
    assert fixed["fp8"] == "rowwise" and fixed["grad_clip"] is False
    _, _, _, fixed = resolve(parser.parse_args(["plan", "--config", str(path), "--layout", "fp8=tensorwise"]))
    assert fixed["fp8"] == "tensorwise"
