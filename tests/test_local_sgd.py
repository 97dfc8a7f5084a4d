"""Local SGD (parallel.dp_sync = 'local-sgd'): replicas step alone and average parameters every K steps.

K = 1 is synchronous data parallel, bit for bit. K = 4 against an independent plain-PyTorch local SGD on
2 Gloo ranks (each a :class:`ReferenceRun` on its slice of the batch, parameters averaged with
``dist.all_reduce`` every 4 steps): fp32, per-step loss and final weights within 1e-5 relative. The bytes
the dp axis moves per step are 1/K of the synchronous engine's.
"""

import functools
import tempfile

import pytest
import torch
import torch.distributed as dist

from bigtrain.check.reference import ReferenceRun
from bigtrain.testing import run_ranks
from helpers import assert_rel_close, params_of, run_steps, tiny_config, trainer_on_rank

STEPS = 8
K = 4
LOCAL = ["--parallel.dp=2", "--train.micro_batch=2", f"--train.steps={STEPS}"]


def _train(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses = run_steps(trainer, STEPS)
    stats = trainer.mesh.stats
    payload = {op: n for (axis, op), n in stats.payload.items() if axis == "dp"}
    return losses, params_of(trainer), payload


def _plain_local_sgd(rank, world_size, cfg):
    """Each rank a plain loop on its half of every batch; parameters averaged every K steps."""
    run = ReferenceRun(cfg, replica=(rank, world_size))
    losses = []
    for step in range(STEPS):
        local = torch.tensor([run.train_step().loss])
        dist.all_reduce(local)
        losses.append(float(local) / world_size)  # equal halves, no masking: the global mean
        if (step + 1) % K == 0:
            with torch.no_grad():
                for p in run.master.parameters():
                    dist.all_reduce(p)
                    p.div_(world_size)
    return losses, {n: p.detach().clone() for n, p in run.master.named_parameters()}


@functools.lru_cache(maxsize=None)
def _synchronous(cache_dir):
    with tempfile.TemporaryDirectory() as run_dir:
        return run_ranks(_train, 2, tiny_config(cache_dir, *LOCAL), run_dir)


def test_local_sgd_every_step_is_synchronous_data_parallel(corpus_cache, tmp_path):
    sync = _synchronous(corpus_cache)
    local = run_ranks(_train, 2, tiny_config(corpus_cache, *LOCAL, "--parallel.dp_sync=local-sgd",
                                             "--parallel.local_sgd_every=1"), str(tmp_path / "local"))
    for (sync_losses, sync_params, _), (local_losses, local_params, _) in zip(sync, local):
        assert sync_losses == local_losses
        for name, value in sync_params.items():
            assert torch.equal(local_params[name], value), name


def test_local_sgd_matches_plain_pytorch_and_moves_a_kth_of_the_bytes(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *LOCAL, "--parallel.dp_sync=local-sgd", f"--parallel.local_sgd_every={K}")
    results = run_ranks(_train, 2, cfg, str(tmp_path / "local"))
    reference = run_ranks(_plain_local_sgd, 2, cfg)
    ref_losses, ref_params = reference[0]
    for losses, params, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in ref_params.items():
            assert_rel_close(params[name], value, 1e-5, name)
    assert not torch.equal(results[0][1]["output.weight"], ReferenceRun(cfg).master.output.weight.detach()), \
        "the weights never moved"
    sync_bytes, local_payload = _synchronous(corpus_cache)[0][2]["all_reduce:grads"], results[0][2]
    assert "all_reduce:grads" not in local_payload
    assert local_payload["all_reduce:params"] * K == sync_bytes  # STEPS / K averages vs STEPS reductions


# -- checkpoints hold parameters every replica has: only after an average ------------------------
class _TimedSaveDueFromStep2:
    """A ``checkpoint.every_minutes`` interval whose save is due from step 2 on, once."""

    def __init__(self, *args):
        self.saved = False

    def due(self, step):
        return step >= 2 and not self.saved

    def replan(self, step):
        self.saved = True


def _fit_and_record_saves(rank, world_size, cfg, run_dir, stop_at_step):
    """``fit`` with a timed save due at step 2 (``stop_at_step`` 0), SIGTERM on rank 0 after step
    ``stop_at_step``, or as configured (None); the parameters each save was asked to write, and how
    the run ended."""
    import os
    import signal

    import bigtrain.train as train_module
    from bigtrain.preemption import Preempted
    from bigtrain.train import Trainer

    asked = {}
    save, train_step = Trainer.save, Trainer.train_step

    def recording_save(self):
        asked[self.step] = params_of(self)
        return save(self)

    def signalling_step(self, *args, **kwargs):
        result = train_step(self, *args, **kwargs)
        if result.step + 1 == stop_at_step and self.mesh.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    Trainer.save = recording_save  # this forked rank's copies only
    if stop_at_step:
        Trainer.train_step = signalling_step
    elif stop_at_step == 0:
        train_module.SaveInterval = _TimedSaveDueFromStep2
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    try:
        trainer.fit()
        code = 0
    except Preempted as stop:
        code = stop.exit_code
    return asked, code, trainer.step


def _saved_weights(path):
    from bigtrain.checkpoint.sharded import ChunkReader

    reader = ChunkReader(path)
    out = {}
    for name in reader.entries:
        if not name.startswith("optim/"):
            out[name] = reader.empty(name)
            reader.read([(name, (0,) * out[name].dim(), out[name])])
    return out


@pytest.mark.parametrize("stop_at_step", [0, 2], ids=["timed-save", "sigterm"])
def test_a_checkpoint_between_averages_waits_for_the_next_one(stop_at_step, corpus_cache, tmp_path):
    """A timed save (checkpoint.every_minutes, on by default) and the save of a SIGTERM fell between
    averages and wrote each replica's part of every range: half rank 0's parameters, half rank 1's,
    a model no replica had. They wait for the average at step K = 4 now."""
    from bigtrain import checkpoint as ckpt

    cfg = tiny_config(corpus_cache, *LOCAL, "--parallel.dp_sync=local-sgd", f"--parallel.local_sgd_every={K}")
    ranks = run_ranks(_fit_and_record_saves, 2, cfg, str(tmp_path), stop_at_step)
    (asked0, code, step), (asked1, _, _) = ranks
    assert (code, step) == ((143, K) if stop_at_step else (0, STEPS))
    assert list(asked0) == [K]
    saved = ckpt.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in saved] == [f"step_{K:08d}"]
    for name, value in _saved_weights(saved[0]).items():
        assert torch.equal(asked0[K][name], asked1[K][name]), name  # every replica holds them
        assert torch.equal(value, asked0[K][name]), name


def test_a_resumed_run_averages_at_the_multiples_of_k(corpus_cache, tmp_path):
    """Resumed at step 2 (a checkpoint of a synchronous run: the layout is free), local SGD's averages
    fall on steps 4 and 8, where checkpoint.every = 4 saves, not K steps after the resume (6, 10)."""
    from bigtrain import checkpoint as ckpt
    from helpers import save_after_steps

    run_ranks(save_after_steps, 2, tiny_config(corpus_cache, *LOCAL), str(tmp_path), 2)
    cfg = tiny_config(corpus_cache, *LOCAL, "--parallel.dp_sync=local-sgd", f"--parallel.local_sgd_every={K}",
                      f"--checkpoint.every={K}", "--checkpoint.resume=auto", "--checkpoint.keep=3")
    (asked0, _, _), (asked1, _, _) = run_ranks(_fit_and_record_saves, 2, cfg, str(tmp_path), None)
    assert list(asked0) == [4, 8]
    for step in asked0:
        for name, value in asked0[step].items():
            assert torch.equal(asked1[step][name], value), (step, name)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000008", "step_00000004", "step_00000002"]



def _resume_noting_warnings(rank, world_size, cfg, run_dir):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer_on_rank(rank, world_size, cfg, run_dir).resume("auto")
    return [str(w.message) for w in caught if "trajectory" in str(w.message)]


@pytest.mark.slow
def test_resuming_a_local_sgd_checkpoint_warns_once_that_the_moments_are_pieced(corpus_cache, tmp_path):
    """The replicas' moments are saved in pieces (docs/async.md), so a resume does not continue the
    uninterrupted run: rank 0 says so at the resume (nothing did). One replica (dp = 1) has whole
    moments: nothing to say."""
    from helpers import save_after_steps

    local = ["--parallel.dp_sync=local-sgd", f"--parallel.local_sgd_every={K}"]
    cfg = tiny_config(corpus_cache, *LOCAL, *local)
    run_ranks(save_after_steps, 2, cfg, str(tmp_path / "dp2"), K)
    said, quiet = run_ranks(_resume_noting_warnings, 2, cfg, str(tmp_path / "dp2"))
    assert quiet == [] and len(said) == 1, said
    assert said[0].startswith("resuming from step_00000004: the run goes on, but not along the trajectory of the "
                              "uninterrupted run: it was written by local SGD (parallel.dp_sync = 'local-sgd', "
                              "local_sgd_every = 4, parallel.dp = 2)")
    assert said[0].endswith("(docs/async.md, 'Local SGD')")
    one = tiny_config(corpus_cache, *local, f"--train.steps={STEPS}")
    save_after_steps(0, 1, one, str(tmp_path / "dp1"), K)
    assert _resume_noting_warnings(0, 1, one, str(tmp_path / "dp1")) == []


def test_the_resume_caveat_names_what_a_checkpoint_of_an_asynchronous_run_lacks(corpus_cache):
    """Which resumes warn (the one above and tests/test_async_pipeline.py see the warning itself):
    a checkpoint of local SGD over several replicas, and a checkpoint written by a pipeline without flush
    (its stash is not saved), whatever schedule resumes it; not a synchronous save resumed into one."""
    from bigtrain.async_checks import resume_caveat

    sync = tiny_config(corpus_cache)

    def written(**parallel):
        return {"parallel": {"dp_sync": "local-sgd", "local_sgd_every": 4, "dp": 2, **parallel}}

    assert "(docs/async.md, 'Local SGD')" in resume_caveat(sync, written(), "step_00000004")
    for whole in (written(dp=1), written(local_sgd_every=1), written(dp_sync="sync"), {}):
        assert resume_caveat(sync, whole, "step_00000004") is None, whole
    two_bw = tiny_config(corpus_cache, "--model.n_layers=4", "--train.micro_batch=2", "--parallel.pp=2",
                         "--parallel.pp_schedule=pipedream-2bw")
    one_f_one_b = tiny_config(corpus_cache, "--model.n_layers=4", "--train.micro_batch=2", "--parallel.pp=2")
    saved_2bw = {"parallel": {"pp": 2, "pp_schedule": "pipedream-2bw"}}
    saved_1f1b = {"parallel": {"pp": 2, "pp_schedule": "1f1b"}}
    # A 1F1B save (or one recording no schedule: the default, 1f1b) had no stash: nothing is lost.
    for saved in (saved_1f1b, {}):
        assert resume_caveat(two_bw, saved, "step_00000004") is None, saved
        assert resume_caveat(one_f_one_b, saved, "step_00000004") is None, saved
    # A 2BW save lost its stash, whichever schedule resumes it; the warning says what the resumed run gets.
    same = resume_caveat(two_bw, saved_2bw, "step_00000004")
    assert "it was written by parallel.pp_schedule = 'pipedream-2bw', which keeps a stashed weight version that " \
           "no checkpoint holds: the pipeline restarts empty" in same and same.endswith("(docs/async.md, 'Limits')")
    into_sync = resume_caveat(one_f_one_b, saved_2bw, "step_00000004")
    assert "it was written by parallel.pp_schedule = 'pipedream-2bw', which keeps a stashed weight version that " \
           "no checkpoint holds: the resumed run (parallel.pp_schedule = '1f1b') computes every step with the " \
           "newest weights" in into_sync and into_sync.endswith("(docs/async.md, 'Limits')")
