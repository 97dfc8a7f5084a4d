"""The planner's block-causal attention (``model.attn_mask = "block_causal"``, ``model.attention``):
the one mask a stage chunk's layers share, per micro-batch in flight (plan/activations.py,
``document_mask_bytes``), against the trainer's measured saved tensors."""

from __future__ import annotations

import dataclasses

import pytest

from bigtrain.distributed.mesh import Mesh
from bigtrain.plan import PRESETS, Layout, ModelSpec, estimate_memory
from bigtrain.plan.fit import _layout
from bigtrain.plan.gemm import block_times
from bigtrain.plan.memory import chunk_activation_bytes
from bigtrain.train import Trainer
from helpers import tiny_config

NBYTES = {"fp32": 4, "bf16": 2}


def _saved_and_predicted(corpus_cache, run_dir, *overrides) -> tuple[int, int]:
    cfg = tiny_config(corpus_cache, "--data.document_end=\n", "--train.global_batch=2", "--train.micro_batch=2",
                      "--data.seq_len=64", "--model.max_seq_len=64", *overrides)
    measured = Trainer(cfg, run_dir, Mesh({}), "cpu").train_step(measure=True).mem["activations"]
    spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len, device="cpu")
    predicted = estimate_memory(spec, _layout(cfg), PRESETS["cpu"], cfg.train.global_batch).activations
    return measured, predicted


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planned_mask_is_the_one_the_trainer_saves(precision, corpus_cache, tmp_path):
    """sdpa's additive mask (on a CPU, 'auto' is sdpa): micro_batch x seq^2 in the compute dtype, saved
    once for the block's layers. What block-causal attention adds to the saved bytes is measured to
    the byte and predicted to the byte; the whole prediction stays within the planner's 5%."""
    causal = _saved_and_predicted(corpus_cache, tmp_path / "causal", f"--precision.mode={precision}")
    masked = _saved_and_predicted(corpus_cache, tmp_path / "masked", f"--precision.mode={precision}",
                                  "--model.attn_mask=block_causal")
    mask = 2 * 64 * 64 * NBYTES[precision]
    assert masked[0] - causal[0] == mask, (masked, causal)
    assert masked[1] - causal[1] == mask, (masked, causal)
    assert abs(masked[1] - masked[0]) <= 0.05 * masked[0], masked


def test_a_pipeline_holds_one_mask_per_micro_batch_in_flight_on_each_stage():
    """1F1B over 4 stages: each stage's chunk holds one mask a micro-batch, and the first stage holds
    4 micro-batches; FlexAttention's BlockMask is (seq / 128)^2 tiles' indices, not seq^2 elements."""
    seq, samples = 4096, 1
    plain = ModelSpec.build(layers=8, hidden=512, heads=8, vocab=1000, seq=seq)
    layout = Layout(pp=4, micro_batch=samples, precision="bf16")
    tiles = seq // 128
    per_micro_batch = {"sdpa": samples * seq * seq * 2, "flex": samples * (16 * (tiles + tiles ** 2) + 8 * seq)}
    base = estimate_memory(plain, layout, PRESETS["h100-80g"], 16)
    assert base.pp_rank == 0 and base.inflight == 4
    for kind, mask in per_micro_batch.items():
        spec = dataclasses.replace(plain, document_mask=kind)
        for rank in range(4):
            assert chunk_activation_bytes(spec, layout, rank) - chunk_activation_bytes(plain, layout, rank) == mask
        masked = estimate_memory(spec, layout, PRESETS["h100-80g"], 16)
        assert (masked.pp_rank, masked.activations - base.activations) == (0, 4 * mask), kind


def test_the_time_model_prices_the_documents_attention_not_the_window_s():
    """One block of 8192 tokens in bf16 on an H100's profile: sdpa under the dense mask adds the
    causal half a kernel with a mask cannot skip and the mask's read per head; FlexAttention over
    documents of 1024 tokens keeps 9 x 10 / 2 tiles a document, 90 x 128^2 / (1024 x 8192) of the
    causal work; with the documents' length unknown it is priced as causal."""
    hw, layout = PRESETS["h100-80g"], Layout(micro_batch=1, precision="bf16")
    assert hw.gemm_fraction > 0 and hw.attention_kernel == "flash"
    plain = ModelSpec.build(layers=2, hidden=2048, heads=16, vocab=32000, seq=8192)
    causal = block_times(plain, layout, hw).forward
    attention = 2 * 16 * 8192 ** 2 * 128 / (hw.peak_flops("bf16") * hw.attention_fraction)
    mask_read = 16 * 8192 ** 2 * 2 / (hw.hbm_bandwidth * hw.memory_fraction)
    sdpa = block_times(dataclasses.replace(plain, document_mask="sdpa"), layout, hw).forward
    assert sdpa - causal == pytest.approx(attention + mask_read, rel=1e-9)
    flex = block_times(dataclasses.replace(plain, document_mask="flex", document_tokens=1024), layout, hw).forward
    assert causal - flex == pytest.approx((1 - 90 * 128 ** 2 / (1024 * 8192)) * attention, rel=1e-9)
    unknown = block_times(dataclasses.replace(plain, document_mask="flex"), layout, hw).forward
    assert unknown == causal


def test_the_planner_gives_block_causal_context_parallelism_a_ring_the_run_accepts(corpus_cache):
    """cp is searched at 8192 tokens and more. `bigtrain train --parallel auto` on 8 CPU ranks at
    16384 tokens once planned dp=4 x cp=2 ring for a block-causal model, which its own validation
    then refused (the review of 2026-11-29); the ring now masks its pairs by the documents' ids, so
    the run takes it, and the planner prices the ids, not a (seq, seq) mask (test_ring_documents.py)."""
    from bigtrain.config import with_overrides
    from bigtrain.plan.layout import Cluster, layout_problems
    from bigtrain.plan.search import candidate_layouts
    from bigtrain.validation import validate

    spec = dataclasses.replace(ModelSpec.build(layers=2, hidden=256, heads=4, vocab=1000, seq=16384),
                               document_mask="sdpa")
    cluster = Cluster.build(8, PRESETS["cpu"], gpus_per_node=8)
    fixed = {"tp": 1, "pp": 1, "sp": 1, "zero": 0, "micro_batch": 1, "recompute": "none"}
    ring = [layout for layout in candidate_layouts(spec, cluster, fixed) if layout.cp > 1 and layout.cp_mode == "ring"]
    assert ring and not layout_problems(ring[0], spec, cluster, 8)
    cfg = tiny_config(corpus_cache, "--data.document_end=\n", "--model.attn_mask=block_causal", "--data.seq_len=64",
                      "--model.max_seq_len=64")
    validate(with_overrides(cfg, ring[0].to_overrides(), "the planner's layout"))  # raises ConfigError if refused

