"""Several machines: what a run needs of them, and the refusal when it lacks it.

CI runs on one machine, where every rank sees one filesystem. A cluster whose machines have only
disks of their own gives each machine's ranks a different folder under the same ``--output-dir``.
These tests give the ranks different folders (forked ranks, each its own run directory, as two
machines with node-local disks would), and one runs two torchrun "machines" on localhost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bigtrain.checkpoint.commit import CheckpointWriteError, list_checkpoints
from bigtrain.distributed.mesh import Mesh
from bigtrain.run_dir import SHARED_CHECK_FILE, check_shared_run_dir
from bigtrain.testing import run_ranks
from helpers import tiny_config, trainer_on_rank

ROOT = Path(__file__).resolve().parents[1]


def _save_into_own_folder(rank: int, world_size: int, cfg, folders: list[str]) -> str:
    """A rank of a dp=2 run whose run directory is a folder of its own (node-local disks)."""
    trainer = trainer_on_rank(rank, world_size, cfg, folders[rank])
    trainer.train_step()
    try:
        trainer.save()
    except CheckpointWriteError as e:
        return str(e)
    return "saved"


def test_a_checkpoint_whose_parts_went_to_other_folders_is_not_committed(corpus_cache, tmp_path):
    # Before: rank 0 committed step_00000001 holding only its own part (__0_0.distcp) beside a
    # .metadata that names rank 1's: a checkpoint that verifies and never loads.
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--train.global_batch=8", "--train.micro_batch=4")
    folders = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    results = run_ranks(_save_into_own_folder, 2, cfg, folders, timeout=120)
    assert all(r != "saved" for r in results), results
    assert "__1_0.distcp" in results[0] and "different folders" in results[0], results[0]
    assert list_checkpoints(Path(folders[0]) / "checkpoints") == []
    assert list_checkpoints(Path(folders[1]) / "checkpoints") == []


def _shared_check(rank: int, world_size: int, folders: list[str]) -> tuple[bool, str | None]:
    mesh = Mesh({"dp": world_size}, rank)
    return check_shared_run_dir(Path(folders[rank]), mesh.comm("world"), torch.device("cpu"), wait_s=0.2)


def test_ranks_that_do_not_share_the_run_directory_are_refused_by_name(tmp_path):
    own = [str(tmp_path / "a"), str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "b")]
    results = run_ranks(_shared_check, 4, own, timeout=60)
    assert [stop for stop, _ in results] == [True] * 4
    message = results[0][1]
    assert "ranks 2, 3 on " in message and str(tmp_path / "b") in message and "shares" in message, message
    assert results[1][1] is None  # it saw the folder: quiet, rank 0 says why
    assert "rank 2 on " in results[2][1] and "rank 3 on " in results[3][1]
    assert not list((tmp_path / "a").glob(f"{SHARED_CHECK_FILE}*"))  # rank 0 cleans up


def test_ranks_that_share_the_run_directory_go_on(tmp_path):
    shared = [str(tmp_path / "run")] * 2
    assert run_ranks(_shared_check, 2, shared, timeout=60) == [(False, None), (False, None)]
    assert not list((tmp_path / "run").glob(f"{SHARED_CHECK_FILE}*"))


def _torchrun_node(node: int, port: int, cwd: Path, corpus_cache: str, *extra: str) -> subprocess.Popen:
    """One "machine" of two: torchrun with 2 ranks, joining the other at localhost:``port``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "bigtrain", "train", "--preset", "tiny",
           "--train.steps=2", "--train.global_batch=16", "--checkpoint.every=1", "--output-dir", "run",
           "--logging.progress=false", "--logging.report=false", f"--data.cache_dir={corpus_cache}",
           "--data.max_bytes=200000", "--distributed.timeout_s=60", *extra]
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_machines(dirs: list[Path], corpus_cache: str, extra: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
                  ) -> tuple[list[subprocess.Popen], list[str]]:
    port = _free_port()
    nodes = [_torchrun_node(n, port, dirs[n], corpus_cache, *extra[n]) for n in (0, 1)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail("two torchrun machines did not finish within 240 s")
    return nodes, outputs


@pytest.mark.slow
def test_two_torchrun_machines_with_different_flags_are_refused(corpus_cache, tmp_path):
    """Machine 1 given another learning rate (its own copy of the command, edited): before, all four
    ranks trained, each machine's replicas at its own rate, and exited 0."""
    nodes, outputs = _two_machines([tmp_path, tmp_path], corpus_cache, ((), ("--optim.lr=0.01",)))
    assert all(n.returncode != 0 for n in nodes), outputs  # torchrun: 1 for any failed rank
    assert "2 different configurations" in outputs[0] and "ranks 2-3: optim.lr = 0.01" in outputs[0], outputs[0]
    assert not (tmp_path / "run" / "checkpoints").exists()



def test_a_refusal_before_training_leaves_the_folder_it_took_as_it_was(tmp_path, capsys):
    """Rank 0 of a user's torchrun takes the folder (creating it and its run.lock) before the ranks
    find that they may not run; refused, it left both behind."""
    from bigtrain.run_rank import refuse_before_training
    from bigtrain.distributed.join import world_comm
    from bigtrain.run_lock import take_run_dir

    (tmp_path / "kept").mkdir()
    for run_dir in (tmp_path / "new" / "run", tmp_path / "kept"):
        lock = take_run_dir(run_dir)
        assert (run_dir / "run.lock").exists()
        assert refuse_before_training("the reason", world_comm(0, 1), torch.device("cpu"), run_dir, lock) == 2
        assert "invalid configuration:\n  - the reason" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not list((tmp_path / "kept").iterdir())

@pytest.mark.slow
def test_a_refused_config_mismatch_is_not_restarted(corpus_cache, tmp_path):
    """Under a user's torchrun with --max-restarts 2, ranks that resolved different configs (here:
    each rank its own learning rate) were refused three times, once per round (50 s here). The
    refusal repeats in every restart: the agent is stopped after the first. And the folder is as
    it was (none): it kept the run.lock rank 0 created."""
    entry = tmp_path / "rank_own_lr.py"  # as two machines, each with its own edited copy of the command
    entry.write_text("import os, sys\nfrom bigtrain.cli import main\n"
                     "sys.exit(main(sys.argv[1:] + [f\"--optim.lr=0.00{1 + int(os.environ['RANK'])}\"]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
           str(entry), "train", "--preset", "tiny", "--train.steps=2", "--train.global_batch=16",
           "--output-dir", str(tmp_path / "run"), "--logging.progress=false", "--logging.report=false",
           f"--data.cache_dir={corpus_cache}", "--data.max_bytes=200000", "--distributed.timeout_s=60"]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert done.returncode != 0, done.stdout
    assert done.stdout.count("2 different configurations") == 1, done.stdout
    assert "restart 1 of 2" not in done.stdout and "stopped this machine's torchrun agent" in done.stdout, done.stdout
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").iterdir())


def _config_check(rank: int, world_size: int, cfgs: list) -> tuple[bool, str | None]:
    from bigtrain.distributed.join import check_same_config, world_comm

    return check_same_config(cfgs[rank], world_comm(rank, world_size), torch.device("cpu"))


def test_ranks_that_resolved_different_configs_are_refused_naming_the_fields(corpus_cache):
    same = tiny_config(corpus_cache, "--parallel.dp=4", "--train.global_batch=16")
    other = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.tp=2", "--train.global_batch=16")
    results = run_ranks(_config_check, 4, [same, same, other, other], timeout=60)
    assert [stop for stop, _ in results] == [True] * 4
    message = results[0][1]
    differ = "ranks 0-1: parallel.dp = 4, parallel.tp = 1; ranks 2-3: parallel.dp = 2, parallel.tp = 2"
    assert differ in message, message
    assert [m for _, m in results[1:]] == [None] * 3
    assert run_ranks(_config_check, 2, [same, same], timeout=60) == [(False, None), (False, None)]


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False], ids=["shared-folder", "node-local-folders"])
def test_two_torchrun_machines(shared, corpus_cache, tmp_path):
    """Two torchrun invocations (static rendezvous, 2 ranks each), as on two machines: into one
    folder the run trains and its checkpoints hold all four parts; into a folder each (node-local
    disks) every rank stops before training, rank 0 naming the ranks that do not see its folder."""
    dirs = [tmp_path, tmp_path] if shared else [tmp_path / "node0", tmp_path / "node1"]
    nodes, outputs = _two_machines(dirs, corpus_cache)
    if shared:
        assert [n.returncode for n in nodes] == [0, 0], outputs
        newest = list_checkpoints(tmp_path / "run" / "checkpoints")[0]
        assert sorted(p.name for p in newest.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    else:
        assert all(n.returncode != 0 for n in nodes), outputs
        assert "ranks 2, 3 on " in outputs[0] and "not one folder for every rank" in outputs[0], outputs[0]
        # Each folder as it was (none): rank 0's kept the run.lock it took the folder with.
        assert not (dirs[0] / "run").exists() and not (dirs[1] / "run").exists()


def _cache_writer(cache: str, rounds: int, start, errors) -> None:
    """A process of another machine sharing ``cache``, whose pid happens to equal this one's."""
    import numpy as np

    from bigtrain.data import corpus

    os.getpid = lambda: 4242  # containers on two machines number their processes alike
    source = Path(cache).parent / "text.txt"
    try:
        for i in range(rounds):
            start.wait(timeout=30)  # both write the same cache file at once
            path = corpus.build_byte_corpus([source], Path(cache), 0, key=f"round-{i}")
            if np.fromfile(path, dtype=np.uint8).size != source.stat().st_size:
                errors.put(f"round {i}: {path} holds {path.stat().st_size} of {source.stat().st_size} bytes")
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(e).__name__}: {e}")


def test_two_machines_with_the_same_pid_build_one_shared_cache(tmp_path):
    # Before: both wrote text.u8.tmp-4242; one truncated the other's bytes, and the second rename
    # found no file (FileNotFoundError), or a reader mapped a corpus cut short.
    import multiprocessing as mp

    (tmp_path / "text.txt").write_bytes(bytes(range(256)) * (16 << 10))  # 4 MiB: a write takes a while
    cache = tmp_path / "cache"
    cache.mkdir()
    ctx = mp.get_context("fork")
    start, errors = ctx.Barrier(2), ctx.SimpleQueue()  # put() is written at once: nothing lost at exit
    writers = [ctx.Process(target=_cache_writer, args=(str(cache), 6, start, errors)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=60)
        if w.is_alive():
            w.kill()
    found = [f"a writer exited with {w.exitcode}" for w in writers if w.exitcode != 0]
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert not [p.name for p in cache.iterdir() if ".tmp-" in p.name]


def test_a_cache_folder_without_file_locks_is_tokenized_all_the_same(tmp_path, monkeypatch):
    # Before: a shared filesystem without flock (ENOLCK) stopped every rank with a raw OSError.
    import errno
    import json

    from bigtrain.config import DataConfig
    from bigtrain.data import shards
    from bigtrain.data.load import load_corpus, prepare_corpus

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(shards.fcntl, "flock", no_flock)
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    d = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
    manifest = prepare_corpus(d)
    assert manifest["documents"] == 50
    assert len(load_corpus(d)) == manifest["tokens"]
