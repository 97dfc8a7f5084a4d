"""Hybrid sharded data parallel (parallel.dp_replicate x parallel.dp_shard, docs/architecture.md):
ZeRO cuts within a group of dp_shard x cp x sp ranks and all-reduces the reduced shards across
dp_replicate groups. Whole runs against the independent one-process reference (``bigtrain.check``,
fp32: loss and gradient norm within 1e-5 relative, every weight, gradient and module output within
1e-4, over 4 steps), checkpoints moved between HSDP and plain layouts, the traffic of each level
against its formula, the mesh's groups and bad input refused before launch."""

import pytest

from bigtrain.check.run import check_on_rank, save_on_rank
from bigtrain.config import ConfigError
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from helpers import tiny_config

SMALL_BATCH = ["--train.global_batch=4", "--train.micro_batch=1"]
HSDP_2X2 = ["--parallel.dp=4", "--parallel.dp_replicate=2"]

LAYOUTS = {
    "hsdp-2x2-zero1": [*HSDP_2X2, "--parallel.zero=1"],
    "hsdp-2x2-zero2": [*HSDP_2X2, "--parallel.zero=2"],
    "hsdp-2x2-zero3": [*HSDP_2X2, "--parallel.zero=3"],
    "hsdp-2x2-cp2-zero3-8-ranks": ["--parallel.dp=4", "--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                   "--parallel.cp=2", "--parallel.zero=3", "--train.global_batch=8"],
}


def _check(corpus_cache, tmp_path, overrides, steps=4):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *overrides)
    return run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), steps, timeout=600)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_sharding_matches_the_reference(name, corpus_cache, tmp_path):
    report = _check(corpus_cache, tmp_path, LAYOUTS[name])
    assert report.agree, report.text()
