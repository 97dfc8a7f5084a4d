"""A row-parallel linear with a bias (Llama's wo / w2 with model.attention_bias / mlp_bias, a
Hugging Face o_proj / down_proj) adds its bias once, after the tensor-parallel sum, whatever else
changes how the layer computes: int8 compression's wrapper leaves the bias to the style's hook,
and a float8 layer stays float8 (parallel/tensor/styles.py ``bias_after_the_sum``). Before, int8
added the bias on every rank and again after the sum, and float8 was silently replaced by a plain
layer. One rank here (the style's collectives are identities): the layouts themselves are proved
against the references in test_int8_layouts.py, test_fp8.py and test_hf_family.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.distributed.comm import AxisComm, CommStats
from bigtrain.fp8.linear import Float8Linear, Float8Linears
from bigtrain.fp8.scaling import Float8Recipe
from bigtrain.memory.compression import int8_linears
from bigtrain.parallel.tensor.styles import RowParallel, RowParallelLinear, TPContext

IN, OUT, TOKENS = 32, 16, 12


def _row_parallel(linear: nn.Module) -> tuple[nn.Module, AxisComm]:
    """``linear`` under the RowParallel style over one tp rank, holding its own values again."""
    comm = AxisComm("tp", None, 1, 0, CommStats())
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    layer = RowParallel().apply(linear, TPContext(tp=comm)) or linear
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer, comm


def _inputs(seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    linear = nn.Linear(IN, OUT)
    with torch.no_grad():
        linear.bias.uniform_(1.0, 2.0)  # large next to the product: a bias added twice shows
    return linear, torch.randn(2, TOKENS, IN)


def test_int8_over_a_row_parallel_layer_adds_its_bias_once():
    linear, x = _inputs()
    expected = F.linear(x, linear.weight, linear.bias)
    layer, comm = _row_parallel(linear)
    assert type(layer) is RowParallelLinear
    (wrapped,) = int8_linears([layer], [comm])
    out = wrapped(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)  # was x W^T + 2 b
    out.sum().backward()
    # The bias's gradient: the output gradient summed once (ones here): was twice that.
    torch.testing.assert_close(layer.bias.grad, torch.full((OUT,), 2.0 * TOKENS))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_a_float8_row_parallel_layer_stays_float8_and_adds_its_bias_once(scaling):
    linear, x = _inputs(1)
    plain = F.linear(x, linear.weight, linear.bias)
    f8 = Float8Linear.from_linear(linear, Float8Recipe(scaling), "emulated")
    expected = f8(x)
    layer, _ = _row_parallel(f8)
    assert isinstance(layer, Float8Linear), type(layer).__name__  # was a plain RowParallelLinear
    assert (layer.recipe, layer.backend) == (f8.recipe, f8.backend)
    out = layer(x)
    assert torch.equal(out, expected)
    assert not torch.allclose(out, plain, rtol=1e-3, atol=0)  # float8's rounding, not the fp32 product
    out.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((OUT,), 2.0 * TOKENS))
    # The record's check, which parallelize runs after the plans, accepts it and names a plain layer.
    Float8Linears(("layer",), f8.recipe, f8.backend).check_kept(nn.ModuleDict({"layer": layer}))
    with pytest.raises(ValueError, match="layer no longer compute in float8.*RowParallelLinear"):
        Float8Linears(("layer",), f8.recipe, f8.backend).check_kept(
            nn.ModuleDict({"layer": RowParallelLinear.replacing(nn.Linear(IN, OUT, device="meta"))}))


def test_a_biased_linear_of_another_class_is_refused_rather_than_made_plain():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match="Scaled with a bias has no row-parallel form"):
        _row_parallel(Scaled(IN, OUT))
