"""The learning-rate schedules (optim.schedule): their rates step by step, written out here by hand,
the trainer taking them, and a check against the independent reference under each."""

from __future__ import annotations

import math

import pytest

from bigtrain.check.run import check_layout
from bigtrain.config import load_config
from bigtrain.core.reference_step import reference_learning_rate
from bigtrain.distributed.mesh import Mesh
from bigtrain.optim.schedule import SCHEDULES, lr_at
from bigtrain.train import Trainer
from helpers import tiny_config


def _config(schedule: str, steps: int = 10, **optim):
    optim = {"lr": 1.0, "warmup_steps": 2, "min_lr_ratio": 0.1, "decay_fraction": 0.3, **optim}
    return load_config(preset="tiny", overrides=[f"--optim.schedule={schedule}", f"--train.steps={steps}"] +
                       [f"--optim.{k}={v}" for k, v in optim.items()])


# 10 steps, peak 1, floor 0.1, warm-up 2: steps 0-1 rise to the peak, the decay runs from step 2 to
# step 10 (whose rate, the floor, no step takes); WSD's decay is the last 3 steps' (7, 8, 9).
_COSINE = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
EXPECTED = {
    "cosine": _COSINE,
    "linear": [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125],
    "wsd": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4],
    "constant": [0.5] + [1.0] * 9,
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_schedule_takes_the_rates_written_out_by_hand(schedule):
    cfg = _config(schedule)
    trainer_rates = [lr_at(s, 10, cfg.optim, cfg.train.global_batch) for s in range(10)]
    reference_rates = [reference_learning_rate(cfg, s) for s in range(10)]
    assert trainer_rates == pytest.approx(EXPECTED[schedule], rel=1e-12)
    assert reference_rates == pytest.approx(EXPECTED[schedule], rel=1e-12)


def test_wsd_s_rates_before_its_decay_do_not_depend_on_the_run_s_length():
    """What makes WSD the schedule for a run that may be extended: resumed with more steps before
    its decay began, it has taken exactly the rates of the longer run."""
    short, long = _config("wsd", steps=100, decay_fraction=0.2), _config("wsd", steps=300, decay_fraction=0.2)
    assert [lr_at(s, 100, short.optim, 8) for s in range(80)] == [lr_at(s, 300, long.optim, 8) for s in range(80)]
    assert lr_at(81, 100, short.optim, 8) < 1.0 == lr_at(81, 300, long.optim, 8)  # 80: the decay's first, at the peak
    # a decay longer than what follows the warm-up starts when the warm-up ends
    squeezed = _config("wsd", steps=10, warmup_steps=5, decay_fraction=0.9)
    assert [lr_at(s, 10, squeezed.optim, 8) for s in range(4, 7)] == pytest.approx([1.0, 1.0, 0.82])


def test_the_trainer_steps_at_the_schedule_s_rates(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--optim.schedule=wsd", "--optim.decay_fraction=0.5", "--optim.warmup_steps=1",
                      "--train.steps=4", "--optim.lr=0.01")
    with Trainer(cfg, tmp_path / "run", Mesh({})) as trainer:
        rates = [r.lr for r in trainer.fit()]
    assert rates == pytest.approx([0.01, 0.01, 0.01, 0.0055], rel=1e-12)


@pytest.mark.parametrize("schedule", ["linear", "wsd"])
def test_a_run_under_the_schedule_matches_the_independent_reference(schedule, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, f"--optim.schedule={schedule}", "--optim.decay_fraction=0.5",
                      "--optim.warmup_steps=1", "--train.steps=4")
    report = check_layout(cfg, Mesh({}), tmp_path / "run", steps=4)
    assert report.agree, report.text()
