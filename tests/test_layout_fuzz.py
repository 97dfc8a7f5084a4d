"""A fixed sample of the layout fuzzer (``bigtrain.check.fuzz``): each layout is rejected by
validation before launch with every problem naming a field, or trains like the independent
reference (fp32: 1e-5 relative; bf16/fp16: 1e-3 on the loss and gradient norm, 1e-2 per tensor).
``scripts/fuzz-layouts.sh N SEED`` samples more."""

import random

import pytest

from bigtrain.check.fuzz import run_sample, sample_layout

SEED, COUNT, MAX_WORLD = 20261123, 48, 8
LAYOUTS = [sample_layout(random.Random(f"{SEED}:{i}"), MAX_WORLD) for i in range(COUNT)]


def _short(overrides: list[str]) -> str:
    return " ".join(o.split(".", 1)[1] for o in overrides if not o.endswith(("=1", "=False", "=none", "=-1", "=0")))


@pytest.mark.parametrize("overrides", LAYOUTS, ids=[_short(o) for o in LAYOUTS])
def test_sampled_layout_is_rejected_or_matches_the_reference(overrides, corpus_cache):
    outcome = run_sample(overrides, corpus_cache, steps=3)
    assert outcome.ok, f"{outcome.verdict}: {' '.join(overrides)}\n{outcome.detail}"


def test_the_sample_spans_the_composition_space():
    seen = {o.split("=")[0] + ("" if o.endswith(("=1", "=False", "=none", "=-1", "=0", "=fp32")) else "*")
            for layout in LAYOUTS for o in layout}
    for key in ("dp", "tp", "pp", "sp", "zero", "sequence_parallel", "pp_virtual", "tie_embeddings",
                "checkpointing", "ignore_target", "mode", "activation_offload", "fused_loss", "moe_experts", "ep",
                "moe_capacity_factor", "offload.optimizer", "offload.params", "delayed_update", "fp8"):
        assert any(k.endswith(key + "*") for k in seen), f"no sampled layout sets {key}"
