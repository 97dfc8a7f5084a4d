"""Whole layouts against the independent reference (``bigtrain.check.reference``): the
reproductions of silent divergences, each a regression test. fp32: loss, gradient norm and every
weight within 1e-5 relative at every step (``check_layout``)."""

import pytest

from bigtrain.check.run import check_layout
from bigtrain.distributed.mesh import Mesh
from bigtrain.testing import run_ranks
from helpers import tiny_config

SMALL_BATCH = ["--train.global_batch=4", "--train.micro_batch=1"]

REPRODUCTIONS = {
    # The vocabulary-parallel loss counted masked targets that the single-device loss skips.
    "tp2-masked-targets": ["--parallel.tp=2", "--data.ignore_target=32"],
    "tp2-sp-masked-targets-padded-vocab": ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                           "--data.ignore_target=10", "--model.vocab_size=257"],
}


def _check(rank, world_size, cfg, run_dir, steps):
    return check_layout(cfg, Mesh.from_config(cfg.parallel, rank, world_size), run_dir, steps)


@pytest.mark.parametrize("name", list(REPRODUCTIONS))
def test_reproduction_matches_the_reference(name, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *SMALL_BATCH, *REPRODUCTIONS[name])
    report = run_ranks(_check, cfg.parallel.world_size, cfg, str(tmp_path), 4, timeout=240)[0]
    assert report.agree, report.text()
