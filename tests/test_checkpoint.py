"""Checkpoints: a resumed run continues the same loss curve; corrupt or half-written ones are skipped."""

import json
import sys
import warnings

import pytest
import torch

from bigtrain import checkpoint as ckpt
from bigtrain.testing import run_ranks
from helpers import run_steps, tiny_config, trainer_on_rank


def _config(cache, **extra):
    return tiny_config(cache, "--train.steps=10", "--logging.log_every=1",
                       *(f"--{k}={v}" for k, v in extra.items()))


def test_resume_continues_the_same_losses(corpus_cache, tmp_path):
    straight = trainer_on_rank(0, 1, _config(corpus_cache), tmp_path / "straight")
    expected = run_steps(straight, 10)

    first = trainer_on_rank(0, 1, _config(corpus_cache), tmp_path / "resumed")
    head = run_steps(first, 5)
    first.save()  # the run "crashes" here, after its step-5 checkpoint
    second = trainer_on_rank(0, 1, _config(corpus_cache, **{"checkpoint.resume": "auto"}), tmp_path / "resumed")
    tail = [r.loss for r in second.fit()]
    assert second.step == 10 and len(tail) == 5
    assert head + tail == expected  # bit-identical on CPU


def _resume_on_ranks(rank, world_size, cfg, run_dir, steps_before):
    first = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(first, steps_before)
    first.save()
    cfg.checkpoint.resume = "auto"
    second = trainer_on_rank(rank, world_size, cfg, run_dir)
    return [r.loss for r in second.fit()]


def test_resume_with_two_ranks_matches_one_process(corpus_cache, tmp_path):
    expected = run_steps(trainer_on_rank(0, 1, _config(corpus_cache), tmp_path / "one"), 10)
    cfg = _config(corpus_cache, **{"parallel.dp": 2})
    tails = run_ranks(_resume_on_ranks, 2, cfg, str(tmp_path / "two"), 4)
    torch.testing.assert_close(torch.tensor(tails[0]), torch.tensor(expected[4:]), rtol=1e-5, atol=0)


def test_a_corrupt_checkpoint_is_skipped_with_a_warning(corpus_cache, tmp_path):
    cfg = _config(corpus_cache, **{"checkpoint.keep": 3})
    trainer = trainer_on_rank(0, 1, cfg, tmp_path)
    run_steps(trainer, 3)
    trainer.save()
    run_steps(trainer, 2)
    trainer.save()
    newest = ckpt.list_checkpoints(trainer.checkpoint_root)[0]
    assert newest.name == "step_00000005"
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    resumed = trainer_on_rank(0, 1, cfg, tmp_path)
    with pytest.warns(UserWarning, match=f"checksum mismatch in {shard.name}"):
        assert resumed.resume("auto")
    assert resumed.step == 3


def test_unfinished_saves_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    good = ckpt.save_checkpoint(root, 2, {"model.pt": {"w": torch.ones(3)}}, {}, keep=5)
    (root / "step_00000009.tmp-4242").mkdir()  # a crash mid-write leaves only a temp dir
    half = root / "step_00000007"
    half.mkdir()
    (half / "model.pt").write_bytes(b"partial")  # no meta.json: the rename never happened
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, meta = ckpt.newest_valid_checkpoint(root)
    assert path == good and meta["step"] == 2
    assert any("step_00000007" in str(w.message) for w in caught)


def test_only_the_newest_k_are_kept(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        ckpt.save_checkpoint(root, step, {"model.pt": {"w": torch.full((2,), float(step))}}, {}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000005", "step_00000004"]
    meta = json.loads((root / "step_00000005" / "meta.json").read_text())
    assert set(meta["sha256"]) == {"model.pt"}
    assert torch.equal(ckpt.load_file(root / "step_00000005", "model.pt")["w"], torch.full((2,), 5.0))


def _async_saves_then_resume(rank, world_size, cfg, run_dir):
    cfg.checkpoint.keep = 3
    first = trainer_on_rank(rank, world_size, cfg, run_dir)
    head = run_steps(first, 2)
    first.save()  # returns at once: the write runs while steps 3-4 train
    pending = first.checkpoint_writer.pending is not None
    head += run_steps(first, 2)
    first.save()
    first.wait_for_save()
    tails = {}
    for where, step in (("auto", 4), (str(first.checkpoint_root / "step_00000002"), 2)):
        again = trainer_on_rank(rank, world_size, cfg, run_dir)
        assert again.resume(where) and again.step == step
        tails[step] = run_steps(again, 10 - step)
    return pending, head, tails


def test_async_saves_resume_identically(corpus_cache, tmp_path):
    """checkpoint.async: the snapshot is the state at the save step although training went on
    while it was written, and the run resumes from it as from a synchronous save."""
    expected = run_steps(trainer_on_rank(0, 1, _config(corpus_cache), tmp_path / "one"), 10)
    cfg = _config(corpus_cache, **{"parallel.dp": 2, "parallel.zero": 2, "checkpoint.async": "true"})
    for pending, head, tails in run_ranks(_async_saves_then_resume, 2, cfg, str(tmp_path / "two")):
        assert pending
        for start, tail in tails.items():
            torch.testing.assert_close(torch.tensor(head[:start] + tail), torch.tensor(expected), rtol=1e-5, atol=0)
    committed = ckpt.list_checkpoints(tmp_path / "two" / "checkpoints")
    # both were committed (the resumes found them); resuming step 2 last removed the later step 4
    # (a timeline that resume trains again: tests/test_resume_timeline.py)
    assert [p.name for p in committed] == ["step_00000002"]
    assert not list((tmp_path / "two" / "checkpoints").glob("*.tmp*"))


@pytest.mark.parametrize("safetensors_installed", [True, False])
def test_export_writes_one_consolidated_file(corpus_cache, tmp_path, capsys, monkeypatch, safetensors_installed):
    from bigtrain.cli import main

    if safetensors_installed:
        load_file = pytest.importorskip("safetensors.torch").load_file  # a test extra: scripts/setup.sh has it
    else:
        monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails as if not installed
    trainer = trainer_on_rank(0, 1, _config(corpus_cache), tmp_path / "run")
    run_steps(trainer, 2)
    trainer.save()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "model.safetensors")]) == 0
    printed = capsys.readouterr().out
    if safetensors_installed:
        weights = load_file(str(tmp_path / "model.safetensors"))
    else:
        assert "safetensors is not installed" in printed
        weights = torch.load(tmp_path / "model.pt", weights_only=True)["weights"]
    expected = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert set(weights) == set(expected)
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


def test_a_time_based_interval_becomes_a_step_every_rank_agrees_on(monkeypatch):
    """checkpoint.every_minutes: the pace of steps 2-3 (the slowest rank's) sets the next save."""
    from bigtrain.checkpoint import interval

    clock = iter([0.0, 10.0, 130.0, 400.0])  # end of step 1, of step 3 (2 steps: 60 s each), after the save
    monkeypatch.setattr(interval.time, "perf_counter", lambda: next(clock))

    class World:  # a slower rank measured 90 s a step
        def max(self, tensor, tag=None):
            tensor.clamp_(min=90.0)
            return tensor

    saves = interval.SaveInterval(minutes=6.0, comm=World())
    assert not saves.due(1) and not saves.due(2)
    assert not saves.due(3) and saves.next_step == 3 + 4  # 6 minutes of 90 s steps
    assert not saves.due(6) and saves.due(7)
    saves.replan(7)  # after the save: steps 4-7 took 270 s (67.5 s each), the slow rank's 90 s rules
    assert saves.next_step == 11
    assert not interval.SaveInterval(minutes=0.0, comm=World()).due(100)


def test_checkpoints_are_written_by_time_by_default(corpus_cache, tmp_path, monkeypatch):
    from bigtrain.checkpoint.interval import SaveInterval
    from bigtrain.config import Config

    assert Config().checkpoint.every_minutes == 15.0 and Config().checkpoint.every == 0
    monkeypatch.setattr(SaveInterval, "replan", lambda self, step: setattr(self, "next_step", step + 2))
    cfg = tiny_config(corpus_cache, "--train.steps=7", "--checkpoint.keep=10")
    trainer_on_rank(0, 1, cfg, tmp_path).fit()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000005", "step_00000007"]  # planned at step 3 for 5, then 7 (the last, not saved twice)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_the_save_finiteness_check_agrees_with_isfinite_everywhere(dtype):
    """The check before a save reads each chunk in place (min and max) instead of making a bool copy
    of it: it must say what ``isfinite(x).all()`` says, wherever the bad element is, also in a
    strided view and an empty chunk."""
    from bigtrain.parallel.chunks import all_finite

    base = torch.randn(64, 48).to(dtype)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in ((0, 0), (31, 17), (63, 47)):
            x = base.clone()
            x[where] = bad
            for view in (x, x[:, 17], x.t()[5:]):
                assert bool(all_finite(view)) == bool(torch.isfinite(view).all()), (bad, where)
    assert bool(all_finite(base)) and bool(all_finite(base[:0])) and bool(all_finite(torch.arange(5)))


def _verify_shares(rank, world_size, cfg, run_dir, corrupt):
    """Two ranks save at steps 3 and 5; the files each hashes on resume, and the step it resumes at
    (``corrupt``: one byte of the newest checkpoint's last file in name order flipped first)."""
    import bigtrain.checkpoint.commit as commit

    first = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(first, 3)
    first.save()
    run_steps(first, 2)
    first.save()
    first.wait_for_save()
    newest = ckpt.list_checkpoints(first.checkpoint_root)[0]
    names = sorted(ckpt.read_manifest(newest)["sha256"])
    world = first.mesh.comm("world")
    world.all_reduce(torch.zeros(1), tag="saved")  # both ranks past the save before one corrupts it
    if corrupt and rank == 0:
        victim = newest / names[-1]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    world.all_reduce(torch.zeros(1), tag="corrupted")
    hashed, original = [], commit._sha256
    commit._sha256 = lambda path: (hashed.append(path.name), original(path))[1]
    second = trainer_on_rank(rank, world_size, cfg, run_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert second.resume("auto")
    commit._sha256 = original
    return names, hashed, second.step, [str(w.message) for w in caught if "corrupt" in str(w.message)]


@pytest.mark.parametrize("corrupt", [False, True], ids=["whole", "corrupt"])
def test_ranks_verify_a_checkpoint_together_each_hashing_its_share(corpus_cache, tmp_path, corrupt):
    """Two ranks resuming hash disjoint halves of the newest checkpoint's files, together all of
    them (each hashed every file: ranks x checkpoint size read before the first step); a file that
    does not verify, in one rank's share, makes both fall back to the previous checkpoint, that rank
    naming the file and the other the rank that found it."""
    cfg = _config(corpus_cache, **{"parallel.dp": 2, "parallel.zero": 1, "checkpoint.keep": 3})
    results = run_ranks(_verify_shares, 2, cfg, str(tmp_path), corrupt)
    names = results[0][0]
    hashed = [set(r[1]) for r in results]
    if not corrupt:
        assert hashed[0] | hashed[1] == set(names) and not hashed[0] & hashed[1], hashed
        assert all(len(r[1]) == len(set(r[1])) for r in results)  # each file once
        assert [r[2] for r in results] == [5, 5] and not any(r[3] for r in results)
        return
    assert [r[2] for r in results] == [3, 3], results
    finder = next(i for i, r in enumerate(results) if names[-1] in r[1][:len(names)])
    assert any(f"checksum mismatch in {names[-1]}" in w for w in results[finder][3]), results
    assert any(f"rank {finder} found a file" in w for w in results[1 - finder][3]), results


def _save_shares(rank, world_size, cfg, run_dir, failing_rank):
    """Two ranks save at step 2; the files each hashed while saving (``failing_rank``: that rank's
    checksumming raises instead), and the error the save raised (None when it committed)."""
    import bigtrain.checkpoint.commit as commit
    import bigtrain.checkpoint.writer as writer

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 2)
    hashed, original, share = [], commit._sha256, writer.file_checksums
    commit._sha256 = lambda path: (hashed.append(path.name), original(path))[1]
    if rank == failing_rank:
        def failing(*args):
            raise OSError("disk went away")
        writer.file_checksums = failing
    try:
        trainer.save()
        trainer.wait_for_save()
        error = None
    except ckpt.CheckpointWriteError as e:
        error = str(e)
    finally:
        commit._sha256, writer.file_checksums = original, share
    saved = ckpt.list_checkpoints(trainer.checkpoint_root)
    return hashed, error, [p.name for p in saved], sorted(ckpt.read_manifest(saved[0])["sha256"]) if saved else []


def test_ranks_checksum_a_save_together_and_a_rank_that_cannot_fails_the_save_on_all(corpus_cache, tmp_path):
    """Each of two ranks hashes its share of the checkpoint's files while saving (rank 0 hashed them
    all); one that cannot checksum its share fails the save on both ranks, nothing committed."""
    cfg = _config(corpus_cache, **{"parallel.dp": 2, "parallel.zero": 1})
    results = run_ranks(_save_shares, 2, cfg, str(tmp_path / "both"), -1)
    hashed = [set(r[0]) for r in results]
    names = results[0][3]
    assert names and hashed[0] | hashed[1] == set(names) and not hashed[0] & hashed[1], results
    assert [r[1] for r in results] == [None, None] and results[0][2] == ["step_00000002"]
    failed = run_ranks(_save_shares, 2, cfg, str(tmp_path / "failed"), 1)
    assert all(r[1] is not None and r[2] == [] for r in failed), failed
    assert "disk went away" in failed[1][1] and "another rank" in failed[0][1], failed
