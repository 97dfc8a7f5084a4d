"""bigtrain check at fp16's overflow boundary (bigtrain/check/fp16_boundary.py): a layout that cuts a
micro-batch's tokens stays under fp16's overflow where the reference's whole sum does not; the check
names that step instead of reporting a divergence, and only when everything else of the step agrees."""

import pytest
import torch

from bigtrain.check.fp16_boundary import overflow_boundary, token_cuts
from bigtrain.check.fuzz import _verdict
from bigtrain.check.report import CheckReport, Finding
from bigtrain.check.run import check_on_rank
from bigtrain.testing import run_ranks
from helpers import tiny_config

# The fuzzer's fp16 draw at the overflow (bigtrain/check/fuzz_layouts.py FP16_OVERFLOW): the scale
# climbs back to fp16's boundary every step. Seed 20261128's sample 15, cut to cp 2 alone.
AT_THE_BOUNDARY = ("--precision.mode=fp16", "--precision.loss_scale=1e9", "--precision.scale_backoff=0.001",
                   "--precision.scale_growth_interval=1", "--train.micro_batch=2", "--train.global_batch=16",
                   "--model.n_layers=4", "--optim.grad_clip=1.0")


def test_context_parallelism_at_the_boundary_agrees_up_to_it_and_names_it(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--parallel.cp=2", *AT_THE_BOUNDARY)
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 4)[0]
    # Measured: step 1 agrees; at step 2 the reference's output-head gradient overflows (it skips),
    # each cp rank's half of the tokens does not.
    assert report.agree and report.first_step == 1 and report.steps == 2, report.text()
    assert "overflow boundary" in report.boundary and "parallel.cp = 2" in report.boundary
    assert "output.weight" in report.boundary
    assert report.first("skipped").detail == "layout False, reference True"
    assert _verdict(report) == "boundary"
    text = report.text()
    assert "stopped at step 2" in text and "DIFFER" not in text
    # The boundary step's weights (one run stepped, the other not) are not among the largest differences.
    assert report.worst["loss"] <= 1e-3 and report.worst.get("weight", 0.0) <= 5e-2, report.worst


def _grads(head: float) -> dict[str, torch.Tensor]:
    return {"output.weight": torch.full((2, 2), head), "norm.weight": torch.ones(2)}


def _findings(*extra: Finding) -> list[Finding]:
    return [Finding("skipped", "", float("inf")), Finding("grad_norm", "", float("nan")),
            Finding("gradient", "output.weight", float("nan")), Finding("weight", "norm.weight", 0.1), *extra]


@pytest.mark.parametrize("case", ["named", "bf16", "no-cut", "both-skipped", "layout-overflowed", "finite-gradient-differs",
                                  "loss-differs", "reference-finite"])
def test_only_a_step_the_boundary_explains_is_named(corpus_cache, case):
    cut = () if case == "no-cut" else ("--parallel.cp=2",)
    mode = ("--precision.mode=bf16",) if case == "bf16" else ("--precision.mode=fp16",)
    cfg = tiny_config(corpus_cache, *cut, *mode)
    layout, reference = _grads(3.0), _grads(float("inf"))
    findings = _findings()
    layout_skipped = case == "both-skipped"
    if case == "layout-overflowed":
        layout = _grads(float("inf"))
    if case == "finite-gradient-differs":
        findings = _findings(Finding("gradient", "norm.weight", 0.2))
    if case == "loss-differs":
        findings = _findings(Finding("loss", "", 2e-3))
    if case == "reference-finite":
        reference = _grads(3.0)
    named = overflow_boundary(cfg, layout_skipped, True, layout, reference, {}, findings)
    assert (named is not None) == (case == "named"), named
    if named:
        assert "output.weight" in named and "parallel.cp = 2" in named


def test_the_axes_that_cut_a_micro_batchs_tokens(corpus_cache):
    assert token_cuts(tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=2")) == []
    assert token_cuts(tiny_config(corpus_cache, "--parallel.sp=2")) == ["parallel.sp = 2"]
    assert token_cuts(tiny_config(corpus_cache, "--parallel.tp=2", "--parallel.sequence_parallel=true")) == [
        "parallel.tp = 2 with sequence_parallel"]


def test_a_diverged_report_is_never_a_boundary():
    from bigtrain.check.compare import TOLERANCES

    report = CheckReport(agree=False, steps=2, tolerance=TOLERANCES["fp16"], losses=[], first_step=1,
                         boundary="")
    assert _verdict(report) == "diverged"
