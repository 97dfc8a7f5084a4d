"""The gradient norm under int8 activation compression: held to fp32's 1e-5 at a fresh run's first
step; after an update the weights legitimately differ by int8 code flips that Adam carried, so the
norm is held to 1e-5 against the reference's recomputation at the layout's own weights, and where
the reference cannot compute there, to 1e-5 plus its own gradients' distance from the reference's
(bigtrain/check/compare.py, _INT8_ACTIVATIONS). Found by the layout fuzzer (seed 20261417, sample
16): a flip at step 1 left the norm 2.1e-5 off at step 3 with every tensor within its bound."""

import pytest
import torch

import bigtrain.memory.compression as compression
from bigtrain.check.compare import gradients_difference, scalar_error, tolerance_for
from bigtrain.check.fuzz import run_sample

INT8 = tolerance_for("fp32", "adamw", "int8")
# The fuzzer's sample 16 of seed 20261417, as it drew it.
SAMPLE = ["--model.family=hf", "--model.hf_config=tiny:mistral:3:2:False", "--parallel.dp=1", "--parallel.tp=4",
          "--parallel.pp=1", "--parallel.zero=3", "--train.micro_batch=1", "--train.global_batch=1",
          "--data.ignore_target=-1", "--optim.grad_clip=0.5", "--optim.warmup_steps=2",
          "--parallel.sequence_parallel=True", "--memory.checkpointing=none", "--memory.activation_compression=int8"]


def _gradients(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(128, 64, generator=g),
            "norm.weight": torch.randn(64, generator=g)}


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads.values()])))


def _flipped(grads: dict[str, torch.Tensor], error: float) -> dict[str, torch.Tensor]:
    """``grads`` with one tensor moved by ``error`` of the whole gradient's norm, as a flip would."""
    out = {n: g.clone() for n, g in grads.items()}
    direction = torch.randn(out["b.weight"].shape, generator=torch.Generator().manual_seed(7))
    out["b.weight"] += direction / direction.norm() * error * _norm(grads)
    return out


def test_the_first_step_keeps_the_fp32_bound_and_a_scaled_gradient_fails_it():
    ref = _gradients(0)
    mine = {n: g * 1.001 for n, g in ref.items()}  # e.g. a wrong int8 scale: every weight gradient 1.001x
    bound = INT8.grad_norm_bound(before_any_update=True, gradients_apart=gradients_difference(mine, ref))
    assert bound == 1e-5
    assert scalar_error(_norm(mine), _norm(ref)) > bound


def test_after_an_update_the_norm_follows_its_gradients():
    """The sample's step 3: gradients 2.3e-4 apart, the norm 2.1e-5: within; a norm not computed
    from the gradients compared (a dropped or doubled reduction: 50% and more; or 1.001x) fails."""
    ref = _gradients(0)
    mine = _flipped(ref, 2.25e-4)
    apart = gradients_difference(mine, ref)
    assert apart == pytest.approx(2.25e-4, rel=1e-4)  # fp32 rounding of the sum
    bound = INT8.grad_norm_bound(before_any_update=False, gradients_apart=apart)
    assert bound == 1e-5 + apart
    assert scalar_error(_norm(mine), _norm(ref)) <= apart  # | |a| - |b| | <= |a - b|, always
    assert scalar_error(_norm(ref) * (1 + 2.13e-5), _norm(ref)) <= bound
    for wrong in (_norm(mine) * 1.001, _norm({"a.weight": mine["a.weight"], "norm.weight": mine["norm.weight"]})):
        assert scalar_error(wrong, _norm(ref)) > bound


def test_without_the_layouts_gradients_the_norm_keeps_its_own_bound():
    """2BW's deferred steps compare no gradients: nothing backs a derived bound, so the norm keeps
    1e-5 (a review found the tensor bound given then, 500 times looser, implied by nothing); with
    gradients, never more than the tensor bound, however far they are."""
    ref = _gradients(0)
    assert gradients_difference({}, ref) is None
    assert INT8.grad_norm_bound(False, None) == INT8.grad_norm
    assert INT8.grad_norm_bound(False, 0.5) == pytest.approx(1e-5 + INT8.tensor)


@pytest.mark.parametrize("compression", ["none", "int8"])
@pytest.mark.parametrize("optimizer", ["adamw8bit", "lion"])
def test_a_discontinuous_optimizer_follows_its_gradients_with_int8_or_without(optimizer, compression):
    """8-bit AdamW's code flips and Lion's sign ties move weights apart after an update as int8's
    flips do (fuzz seed 20261428 sample 2: 8-bit AdamW, dp 2 resumed at pp 4, the norm 3.1e-5 off
    at the third step compared, its gradients 2.2e-4 apart); the first step keeps 1e-5."""
    tol = tolerance_for("fp32", optimizer, compression)
    assert tol.norm_follows_gradients and tol.tensor == 5e-3  # where the reference cannot recompute the norm
    assert tol.grad_norm_bound(True, 1e-3) == 1e-5
    assert tol.grad_norm_bound(False, 2.2e-4) == pytest.approx(1e-5 + 2.2e-4)


@pytest.mark.parametrize("precision,optimizer", [("fp32", "adamw"), ("fp32", "adafactor"), ("bf16", "adamw"),
                                                 ("bf16", "adamw8bit")])
def test_other_tolerances_keep_their_norm_bound_at_every_step(precision, optimizer):
    tol = tolerance_for(precision, optimizer)
    assert not tol.norm_follows_gradients
    assert tol.grad_norm_bound(False, 1e-3) == tol.grad_norm_bound(True, None) == tol.grad_norm


@pytest.mark.slow
def test_the_fuzzers_int8_tp4_sample_agrees(corpus_cache):
    outcome = run_sample(SAMPLE, corpus_cache, steps=3)
    assert outcome.verdict == "agree", outcome.detail
    # Where an int8 code flips (on the AVX-512 Xeons that found it: one code of 4,096 at step 1),
    # the norm lands beyond 1e-5 from the free reference's (measured 2.1e-5 at step 3) and 1.2e-7
    # from the reference's recomputation at the layout's own weights, which holds it to 1e-5. Whether
    # that code flips is the machine's rounding: on an AVX2 EPYC none did, and the norm stayed within
    # 1.2e-7 of the free reference's. Either way the sample agrees; the flip, where it happens, is
    # judged by the recomputation (its mechanism alone: tests/test_check_norm.py).
    worst_norm = float(outcome.detail.split("grad_norm ")[1].split(",")[0])
    if worst_norm > 1e-5:
        assert "recomputed by the reference at the layout's weights" in outcome.detail, outcome.detail


@pytest.mark.slow
def test_the_sample_fails_where_int8_weight_gradients_are_scaled(corpus_cache, monkeypatch):
    """The mutation: the layout dequantizes 0.1% high (a wrong scale), every weight gradient 1.001x,
    each within the tensor bound: the norm at the first step catches it."""
    dequantize = compression.dequantize_rows
    monkeypatch.setattr(compression, "dequantize_rows", lambda q, scale, dtype: dequantize(q, scale * 1.001, dtype))
    outcome = run_sample(SAMPLE, corpus_cache, steps=3)
    assert outcome.verdict == "diverged", outcome.detail
    assert "DIFFER from step 1" in outcome.detail and "gradient norm: relative" in outcome.detail, outcome.detail
