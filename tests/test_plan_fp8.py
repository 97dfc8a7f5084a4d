"""The planner's float8 accounting (``precision.fp8``): the profiles' float8 rate, the time of a
float8 linear's GEMMs and casts (plan/gemm.py), its operand copies (plan/memory.py), and the layout
key that carries it from a config to ``--parallel auto``'s overrides."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.plan import evaluate
from bigtrain.plan.fit import _layout
from bigtrain.plan.gemm import block_times, float8_gemm_seconds, gemm_seconds
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


def test_a_large_float8_gemm_is_half_the_bf16_one_plus_its_casts():
    m = n = k = 8192.0
    cast = 2 * m * k * (2 * 2 + 1) / (H100.hbm_bandwidth * H100.memory_fraction)  # read twice, write 1 byte
    bf16_compute = 2 * m * n * k / (H100.peak_flops_bf16 * 0.58 * (m / (m + 64)) ** 3)
    assert gemm_seconds(H100, "bf16", m, n, k) == pytest.approx(bf16_compute)
    fp8_compute = bf16_compute * H100.peak_flops_bf16 / H100.peak_flops_fp8  # about half
    assert float8_gemm_seconds(H100, "bf16", m, n, k) == pytest.approx(fp8_compute + cast)
    # Transposed operands are copied before the cast: two more passes of the compute dtype.
    copied = float8_gemm_seconds(H100, "bf16", m, n, k, transposed=(True, True))
    assert copied - float8_gemm_seconds(H100, "bf16", m, n, k) == pytest.approx(cast * 4 / 5)
    # Without float8 tensor cores (emulation) the GEMM keeps its precision and pays the casts.
    assert float8_gemm_seconds(A100, "bf16", m, n, k) > gemm_seconds(A100, "bf16", m, n, k)


def test_float8_speeds_up_the_blocks_where_there_are_float8_matmuls_and_slows_them_where_not():
    bf16, fp8 = Layout(micro_batch=4), Layout(micro_batch=4, fp8="rowwise")
    for hw, faster in ((H100, True), (A100, False)):
        plain, float8 = block_times(LLAMA_1B, bf16, hw), block_times(LLAMA_1B, fp8, hw)
        assert (float8.forward < plain.forward) == faster and (float8.backward < plain.backward) == faster
    step = {f: evaluate(LLAMA_1B, Layout(micro_batch=4, fp8=f), Cluster.build(1, H100), 4).time.step_time_s
            for f in ("none", "tensorwise")}
    assert step["tensorwise"] < step["none"]


def test_the_routers_and_experts_of_a_moe_block_stay_in_bf16():
    moe = ModelSpec.from_model_config(load_config(preset="moe-tiny").model, 64)
    layout = Layout(micro_batch=4, fp8="tensorwise")
    from bigtrain.plan.gemm import linear_shapes

    shapes = linear_shapes(moe, layout, 256, moe=True)
    assert [float8 for *_, float8 in shapes] == [True] * 4 + [False] * (len(shapes) - 4)


def test_the_float8_operand_copies_are_counted_as_a_buffer():
    layout = Layout(micro_batch=4, fp8="rowwise")
    # llama-1b, 8192 tokens: the worst GEMM is a feed-forward linear's dW, dY^T and x^T copied in
    # bf16 and cast: (2 + 1) x 8192 x (8192 + 2048) bytes = 240 MiB.
    assert float8_operand_bytes(LLAMA_1B, layout) == 3 * 8192 * (8192 + 2048) == 240 * 2**20
    cluster = Cluster.build(1, H100)
    with_fp8, without = (evaluate(LLAMA_1B, lay, cluster, 4).memory for lay in (layout, Layout(micro_batch=4)))
    assert with_fp8.buffers["fp8_operands"] == 240 * 2**20 and "fp8_operands" not in without.buffers
    assert with_fp8.activations == without.activations  # inputs saved in bf16, as F.linear saves them
    # tp = 2 halves the feed-forward's local width.
    assert float8_operand_bytes(LLAMA_1B, Layout(tp=2, micro_batch=4, fp8="rowwise")) == 3 * 8192 * (4096 + 2048)


def test_the_layout_key_goes_from_the_config_to_the_overrides():
    cfg = load_config(preset="tiny", overrides=["--precision.fp8=rowwise", "--precision.mode=bf16"])
    layout = _layout(cfg)
    assert layout.fp8 == "rowwise" and "fp8=rowwise" in layout.describe()
    assert "--precision.fp8=rowwise" in layout.to_overrides()
    assert not any("fp8" in o for o in Layout().to_overrides())
    assert parse_layout("dp=2,fp8=tensorwise") == {"dp": 2, "fp8": "tensorwise"}
    with pytest.raises(Exception, match="fp8"):
        parse_layout("fp8=blockwise")
