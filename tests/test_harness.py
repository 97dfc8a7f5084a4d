"""The forked-rank harness itself: results come back, failures name the rank, hangs are killed."""

import time

import pytest
import torch
import torch.distributed as dist

from bigtrain.testing import RankFailure, run_ranks


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _rank_zero_hangs(rank, world_size):
    dist.barrier()  # the group is fully connected before rank 1 finishes and exits
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum_of_ranks, 3) == [6.0, 6.0, 6.0]


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1.*ValueError: boom on purpose"):
        run_ranks(_rank_one_raises, 2, timeout=30)


def test_a_hanging_rank_is_killed_and_named():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish"):
        run_ranks(_rank_zero_hangs, 2, timeout=5)
    assert time.monotonic() - start < 15
