"""Issue 31's long-sequence criterion at a size a test can run: benchmarks/bench_long_context.py's
comparison (each cp rank's saved activations against the planner's), and the planner's time for a
ring's attention on a flash kernel."""

import dataclasses
import sys
from pathlib import Path

import pytest

from bigtrain.plan import ModelSpec, get_profile
from bigtrain.plan.gemm import block_times
from bigtrain.plan.layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_long_context  # noqa: E402


def _attention_forward(model, layout, hw) -> float:
    """Seconds of a block's attention forward alone: the block at attention_fraction 1/2 minus the
    same block at 1, which is the attention at 1 (everything else is the same)."""
    half, whole = (block_times(model, layout, dataclasses.replace(hw, attention_fraction=f)).forward for f in (0.5, 1.0))
    return half - whole


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_flash_ring_does_one_process_causal_work_in_all(cp):
    """With a flash kernel (the ring's on a CPU skips the masked half of a chunk against itself),
    the cp ranks' attention together is one process's causal attention over the sequence: not
    (2cp + 1) / 2cp of it, as when the two diagonal pairs are counted whole."""
    hw = dataclasses.replace(get_profile("cpu"), attention_kernel="flash")
    model = ModelSpec.from_model_config(bench_long_context.config(8192, 1, "unused.npy", 1).model, 8192)
    one = _attention_forward(model, Layout(micro_batch=1), hw)
    ring = _attention_forward(model, Layout(cp=cp, micro_batch=1), hw)
    assert cp * ring == pytest.approx(one, rel=1e-9)


def test_each_cp_rank_saves_the_activations_the_planner_predicts():
    """The benchmark's probe at 2048 tokens, cp 4: every rank's saved-activation bytes within 5% of
    the planner's activations for that layout (the 64k run is the same comparison, docs/benchmarks.md)."""
    seq, cp = 2048, 4
    results = bench_long_context.measure(seq, cp, steps=0, timeout=300)
    predicted, _ = bench_long_context.predict(seq, cp, get_profile("cpu"))
    assert len(results) == cp
    for r in results:
        assert abs(predicted - r.activations) <= 0.05 * r.activations, (r, predicted)
