"""The NaN policy: a non-finite loss or gradient norm skips the step on every rank, weights and
optimizer state untouched; ``train.max_bad_steps`` bad steps in a row stop the run with exit code 3,
and its newest checkpoint is the last finite state."""

import json
import math
import subprocess
import sys

import pytest
import torch

from bigtrain.checkpoint import list_checkpoints
from bigtrain.checkpoint.sharded import ChunkReader
from bigtrain.cli import main
from bigtrain.metrics import read_metrics
from bigtrain.nonfinite import BadSteps, NonFiniteStop
from bigtrain.testing import run_ranks
from helpers import run_steps, tiny_config, trainer_on_rank


class _NanGradient(torch.autograd.Function):
    """The identity forward, NaN backward: a finite loss whose gradients are all NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _inject(trainer, fault: str) -> None:
    """Make this rank's next loss (``loss``) or gradients (``grad``) NaN, through the loss function
    every layout calls (the pipeline's last stage, every tp rank, each dp rank on its own data)."""
    original = trainer.parallel.loss_sum

    def faulty(logits, targets):
        loss = original(logits, targets)
        return loss + float("nan") if fault == "loss" else _NanGradient.apply(loss)

    trainer.parallel.loss_sum = faulty


def _state(trainer):
    weights, optim = trainer.parallel.full_state()
    return weights, optim["state"], (trainer.engine.scaler.scale if trainer.engine.scaler else None)


def _skips_on_rank(rank, world_size, cfg, run_dir, faulty_ranks):
    """Two clean steps, then a NaN loss, then NaN gradients (each on ``faulty_ranks``), then a clean
    step; per faulty step (skipped, loss, grad norm, optimizer states compared), and whether the
    last step applied."""
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 2)
    original, out = trainer.parallel.loss_sum, []
    for fault in ("loss", "grad"):
        weights, optim, _ = _state(trainer)
        if rank in faulty_ranks:
            _inject(trainer, fault)
        skipped = trainer.train_step()
        trainer.parallel.loss_sum = original
        after_weights, after_optim, _ = _state(trainer)
        for name, value in weights.items():
            assert torch.equal(after_weights[name], value), f"{fault}: {name} changed on a skipped step"
        for name, state in optim.items():
            for key, value in state.items():
                assert torch.equal(after_optim[name][key], value), f"{fault}: optimizer {key} of {name} changed"
        out.append((skipped.skipped, skipped.loss, skipped.grad_norm, len(optim)))
    applied = trainer.train_step()
    now = _state(trainer)[0]  # a collective: once on every rank
    changed = any(not torch.equal(now[n], v) for n, v in weights.items())
    return out, not applied.skipped and (changed or not weights)


LAYOUTS = {
    "replicated-dp2": ["--parallel.dp=2"],
    "zero1-dp2": ["--parallel.dp=2", "--parallel.zero=1"],
    "zero2-bf16-dp2": ["--parallel.dp=2", "--parallel.zero=2", "--precision.mode=bf16"],
    "zero3-fp16-dp2": ["--parallel.dp=2", "--parallel.zero=3", "--precision.mode=fp16",
                       "--precision.loss_scale=1024"],
    "pp2": ["--parallel.pp=2"],
    "tp2": ["--parallel.tp=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched_on_every_rank(layout, corpus_cache, tmp_path):
    """The fault is on rank 0 alone where ranks see different data (dp): every rank must still skip."""
    cfg = tiny_config(corpus_cache, *LAYOUTS[layout])
    faulty = {0} if cfg.parallel.dp > 1 else set(range(cfg.parallel.world_size))
    results = run_ranks(_skips_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), faulty)
    for faults, applied in results:
        (loss_skipped, loss, _, _), (grad_skipped, _, norm, _) = faults
        assert loss_skipped and grad_skipped, f"{layout}: a rank applied a bad step"
        assert not math.isfinite(loss) and not math.isfinite(norm)
        assert applied  # the next, clean step applies
    assert results[0][0][0][3] > 0  # AdamW's state (step count and moments) was compared


def test_the_policy_counts_bad_steps_and_lets_fp16_calibrate():
    bad = BadSteps(max_bad_steps=2, min_loss_scale=1.0)
    # fp16 overflows while the scale can still back off: calibration, not counted, however many
    for step in range(20):
        assert "overflowed at loss scale" in bad.observe(step, 2.0, math.inf, True, 2.0 ** (16 - step % 16), 1.0)
    assert bad.streak == 0
    assert "1 of train.max_bad_steps = 2" in bad.observe(20, 2.0, math.inf, True, 1.0, 1.0)  # at the floor
    assert bad.observe(21, 2.0, 0.5, False) is None and bad.streak == 0  # an applied step ends the streak
    assert "the loss was nan" in bad.observe(22, math.nan, math.nan, True, 1024.0, 512.0)  # forward overflow
    with pytest.raises(NonFiniteStop, match=r"stopped at step 23: the loss was inf .* \(steps 22-23\), "
                                            r"train.max_bad_steps = 2"):
        bad.observe(23, math.inf, math.nan, True, 512.0, 256.0)
    fp32 = BadSteps(max_bad_steps=1)
    with pytest.raises(NonFiniteStop, match="stopped at step 0: the gradient norm was inf"):
        fp32.observe(0, 2.0, math.inf, True)


def test_fp16_overflowing_forever_stops_once_the_scale_is_at_its_minimum(corpus_cache, tmp_path):
    """Finite losses, gradients that overflow on every step: two halvings (4 -> 2 -> 1) are
    calibration, then three overflows at the minimum scale stop the run."""
    cfg = tiny_config(corpus_cache, "--precision.mode=fp16", "--precision.loss_scale=4", "--train.max_bad_steps=3",
                      "--train.steps=20", "--logging.log_every=1")
    trainer = trainer_on_rank(0, 1, cfg, tmp_path)
    _inject(trainer, "grad")
    with pytest.raises(NonFiniteStop, match=r"stopped at step 5: the gradient norm was nan \(loss 5.\d+\); "
                                            r"3 consecutive steps were not finite \(steps 3-5\)"):
        trainer.fit()
    records = read_metrics(tmp_path)
    assert [r["loss_scale"] for r in records] == [2.0, 1.0, 1.0, 1.0, 1.0] and all(r["skipped"] for r in records)


def _args(cache, out, *extra):
    return ["train", "--preset", "tiny", "--output-dir", str(out), "--logging.progress=false",
            "--logging.report=false", f"--data.cache_dir={cache}", "--data.max_bytes=400000",
            "--logging.log_every=1", *extra]


def _assert_stopped_with_last_finite_checkpoint(run_dir, max_bad=5):
    records = read_metrics(run_dir)
    applied = [r["step"] for r in records if not r["skipped"]]
    trailing = [r for r in records if r["step"] > max(applied, default=0)]
    # Stopped at the max_bad-th bad step in a row, every one of them logged as skipped and not finite.
    assert len(trailing) == max_bad and trailing[-1]["step"] == records[-1]["step"]
    assert all(not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])) for r in trailing)
    newest = list_checkpoints(run_dir / "checkpoints")
    if not applied:
        assert not newest
        return
    assert newest[0].name == f"step_{applied[-1]:08d}"  # the state after the last applied step
    reader = ChunkReader(newest[0])
    for fqn in reader.entries:
        tensor = reader.empty(fqn)
        reader.read([(fqn, (0,) * tensor.dim(), tensor)])
        assert torch.isfinite(tensor).all(), f"{newest[0].name}: {fqn} is not finite"


@pytest.mark.parametrize("overrides", [["--precision.mode=fp32", "--optim.lr=1e6", "--optim.weight_decay=0"],
                                       ["--precision.mode=bf16", "--optim.lr=1e6", "--optim.weight_decay=0"],
                                       ["--precision.mode=fp16", "--optim.lr=1e6", "--optim.weight_decay=0"],
                                       ["--model.init_std=1e300"], ["--model.rope_theta=1e-300"]],
                         ids=["fp32-lr1e6", "bf16-lr1e6", "fp16-lr1e6", "init_std", "rope_theta"])
def test_a_diverging_run_stops_with_exit_3_and_keeps_the_last_finite_checkpoint(overrides, corpus_cache, tmp_path,
                                                                               capsys):
    code = main(_args(corpus_cache, tmp_path, "--train.steps=40", "--checkpoint.every=1", *overrides))
    err = capsys.readouterr().err
    assert code == 3, err[-2000:]
    line = [text for text in err.splitlines() if "stopped at step" in text]
    assert len(line) == 1 and "train.max_bad_steps = 5" in line[0], err[-2000:]
    _assert_stopped_with_last_finite_checkpoint(tmp_path)


@pytest.mark.slow
def test_two_ranks_through_torchrun_stop_with_exit_3(corpus_cache, tmp_path):
    """Through torchrun the launcher exits 3 (read from stopped.json); the ranks of a stop on purpose
    exit 0, so that torchrun neither restarts them under --max-restarts (going on would only diverge
    again) nor prints a traceback. Under --max-restarts 1: the launch without it is the same
    launch_local with torchrun's --max-restarts=0, and this run asserts all it would, and no restart."""
    cmd = [sys.executable, "-m", "bigtrain", *_args(corpus_cache, tmp_path, "--train.steps=40", "--parallel.dp=2",
                                                    "--parallel.zero=1", "--checkpoint.every=1", "--optim.lr=1e6",
                                                    "--optim.weight_decay=0", "--max-restarts", "1")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.count("stopped at step") == 1  # rank 0 says it once
    assert "restart" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    _assert_stopped_with_last_finite_checkpoint(tmp_path)


@pytest.mark.parametrize("overrides, bad", [(["--optim.lr=1e6", "--optim.weight_decay=0", "--train.steps=4"], 3),
                                            (["--optim.lr=1e6", "--optim.weight_decay=0", "--train.steps=2"], 1),
                                            (["--model.init_std=1e300", "--train.steps=3"], 3)],
                         ids=["lr1e6-4-steps", "lr1e6-2-steps", "init_std-3-steps"])
def test_a_run_that_ends_on_bad_steps_exits_3_whatever_their_number(overrides, bad, corpus_cache, tmp_path, capsys):
    """Fewer than train.max_bad_steps bad steps at the end (3, 1, 3 of 5): exit 3, one line, stopped.json
    as the max_bad_steps stop writes it, and no final checkpoint of the bad steps (exit 0 and "loss -> nan")."""
    code = main(_args(corpus_cache, tmp_path, "--checkpoint.every=1", *overrides))
    err = capsys.readouterr().err
    assert code == 3, err[-2000:]
    line = [text for text in err.splitlines() if "stopped at the end of the run" in text]
    assert len(line) == 1 and "train.max_bad_steps = 5" in line[0] and "not finite" in line[0], err[-2000:]
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert stopped["exit_code"] == 3 and stopped["message"] == line[0].removeprefix("bigtrain: ")
    _assert_stopped_with_last_finite_checkpoint(tmp_path, max_bad=bad)


def test_normal_fp16_calibration_does_not_stop_a_healthy_run(corpus_cache, tmp_path, capsys):
    """A loss scale too high (2^20; the tiny model's gradients overflow fp16 from about 2^17 on)
    overflows for several steps while it backs off: a healthy run must not count those, even with
    max_bad_steps = 1."""
    code = main(_args(corpus_cache, tmp_path, "--train.steps=10", "--precision.mode=fp16",
                      f"--precision.loss_scale={2.0 ** 20}", "--train.max_bad_steps=1"))
    out = capsys.readouterr().out
    assert code == 0
    records = read_metrics(tmp_path)
    skipped = [r for r in records if r["skipped"]]
    assert len(skipped) >= 3 and "fp16 gradients overflowed at loss scale" in out
    assert not records[-1]["skipped"] and records[-1]["loss"] < records[0]["loss"]
