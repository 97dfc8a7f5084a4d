"""Named timeouts: a frozen rank makes its peers fail after distributed.timeout_s, each naming itself,
the collective, its axis and tag, and the collectives it completed before (the odd one out shows)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from bigtrain.config import load_config
from bigtrain.distributed.comm import CollectiveError, world_timeout
from bigtrain.distributed.mesh import Mesh
from bigtrain.testing import RankFailure, run_ranks


def test_a_report_names_a_dead_peer_and_survives_pickling():
    import pickle

    from bigtrain.distributed.comm import Collective

    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5548")
    error = CollectiveError(0, Collective("send to rank 3", "pp", "activations", 2048), [0, 3], 0.01,
                            [Collective("all_reduce", "dp", "grads", 3 * 2**20)], cause)
    error.step = 7
    text = str(pickle.loads(pickle.dumps(error)))
    assert text.startswith("rank 0 at step 7: send to rank 3 on axis 'pp' tag 'activations' (2.0 KiB) failed after "
                           "0.0 s in the group of ranks [0, 3]: [pair.cc:553] Connection closed by peer")
    assert "did not take part" not in text  # that line is for timeouts
    assert "    all_reduce on axis 'dp' tag 'grads' (3.0 MiB)" in text


def _freeze(note: Path | None = None) -> None:
    if note is not None:
        note.write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)  # the harness kills it with SIGKILL, which a stopped process obeys


def _collectives_then_rank_1_freezes(rank, world_size):
    mesh = Mesh({"dp": world_size}, rank)
    comm = mesh.comm("dp")
    assert world_timeout().total_seconds() == 3  # the mesh's groups wait as long as the world group
    comm.all_reduce(torch.ones(4), tag="first")
    comm.all_gather(torch.empty(2 * world_size), torch.ones(2), tag="params")
    comm.all_reduce(torch.ones(8), tag="grads", async_op=True).wait()
    if rank == 1:
        _freeze()
    comm.all_reduce(torch.ones(16), tag="metrics")


def test_a_frozen_peer_is_named_with_the_collective_axis_tag_and_history():
    start = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_ranks(_collectives_then_rank_1_freezes, 2, timeout=60, group_timeout=3)
    assert time.monotonic() - start < 20
    text = str(e.value)
    assert "CollectiveError: rank 0: all_reduce on axis 'dp' tag 'metrics' (64 B) timed out after" in text
    assert "in the group of ranks [0, 1]" in text and "Timed out" in text
    assert "last 3 collectives rank 0 completed (oldest first):" in text
    history = text[text.index("oldest first"):]
    order = [history.index(s) for s in ("all_reduce on axis 'dp' tag 'first' (16 B)",
                                        "all_gather on axis 'dp' tag 'params' (16 B)",
                                        "all_reduce on axis 'dp' tag 'grads' (32 B)")]
    assert order == sorted(order)  # an async collective counts once its wait returns


def _rank_1_waits_elsewhere(rank, world_size):
    """Rank 1 enters a different collective: both fail, each naming its own, so the mismatch shows."""
    mesh = Mesh({"dp": world_size}, rank)
    comm = mesh.comm("dp")
    if rank == 0:
        comm.all_reduce(torch.ones(4), tag="grads")
    else:
        comm.broadcast(torch.ones(3), src_global_rank=1, tag="init")


def test_each_rank_names_the_collective_it_is_in():
    with pytest.raises(RankFailure) as e:
        run_ranks(_rank_1_waits_elsewhere, 2, timeout=60, group_timeout=2)
    text = str(e.value)
    # Whichever rank reports first (or both), each names its own collective.
    assert ("rank 0: all_reduce on axis 'dp' tag 'grads'" in text
            or "rank 1: broadcast on axis 'dp' tag 'init'" in text), text
    assert "had completed no collective before this one" in text


def _train_until_rank_1_freezes(rank, world_size, run_dir, cache):
    from bigtrain.train import Trainer

    cfg = load_config(preset="tiny", overrides=[
        "--parallel.dp=2", "--train.steps=6", "--logging.progress=false", "--logging.report=false",
        "--checkpoint.save_final=false", f"--data.cache_dir={cache}", "--data.max_bytes=400000",
        "--distributed.timeout_s=20"])
    trainer = Trainer(cfg, run_dir, Mesh.from_config(cfg.parallel, rank, world_size))
    if rank == 1:
        step = trainer.train_step

        def stop_at_step_2(*args, **kwargs):
            if trainer.step == 2:
                _freeze(Path(run_dir) / "frozen_at")
            return step(*args, **kwargs)

        trainer.train_step = stop_at_step_2
    try:
        trainer.fit()
    except CollectiveError as e:
        e.step = trainer.step
        raise


def test_a_run_with_a_frozen_rank_fails_within_30_s_naming_collective_and_axis(tmp_path, corpus_cache):
    """The acceptance test of issue 11: distributed.timeout_s = 20, one of two ranks SIGSTOPped at step 2."""
    with pytest.raises(RankFailure) as e:
        run_ranks(_train_until_rank_1_freezes, 2, tmp_path, corpus_cache, timeout=90, group_timeout=20)
    since_freeze = time.time() - float((tmp_path / "frozen_at").read_text())
    text = str(e.value)
    assert since_freeze < 30, since_freeze
    assert "--- rank 0 ---" in text and "--- rank 1 ---" not in text  # the frozen rank says nothing
    assert "rank 0 at step 2: all_reduce on axis 'dp' tag 'grads'" in text
    assert "timed out after 2" in text  # 20.x s
    assert "last 8 collectives rank 0 completed" in text
