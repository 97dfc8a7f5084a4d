"""Pipeline fields the run would ignore are refused before launch, naming the field and the fix:
a schedule or stages per rank with parallel.pp = 1 (one stage runs no pipeline schedule), and
parallel.pp_balance beside a parallel.pp_split (the split decides). Their defaults stay accepted,
and so do the overrides the planner writes (``--parallel auto``, ``bigtrain plan``'s "run it with")."""

from __future__ import annotations

import pytest

from bigtrain.config import ConfigError, load_config, with_overrides
from bigtrain.plan.layout import Layout
from bigtrain.validation import validate


def _problems(*overrides: str) -> list[str]:
    try:
        validate(load_config(preset="tiny", overrides=list(overrides)))
    except ConfigError as e:
        return list(e.problems)
    return []


@pytest.mark.parametrize("kind", ["gpipe", "naive", "zb-h1", "interleaved"])
def test_a_schedule_with_one_stage_is_refused_naming_the_field_and_the_fix(kind):
    problems = _problems(f"--parallel.pp_schedule={kind}", *(["--parallel.pp_virtual=2"] if kind == "interleaved"
                                                             else []))
    ours = [p for p in problems if p.startswith("parallel.pp_schedule")]
    assert len(ours) == 1, problems
    assert f"parallel.pp_schedule = '{kind}' with parallel.pp = 1" in ours[0]
    assert "set parallel.pp >= 2, or remove parallel.pp_schedule" in ours[0]


def test_stages_per_rank_with_one_stage_are_refused_naming_the_field_and_the_fix():
    assert _problems("--parallel.pp_virtual=2") == [
        "parallel.pp_virtual = 2 with parallel.pp = 1: one stage runs no pipeline, so its stages per rank would be "
        "ignored; set parallel.pp >= 2, or remove parallel.pp_virtual (its default 1)"]
    both = _problems("--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2")
    assert len(both) == 2 and both[1].startswith("parallel.pp_virtual = 2 with parallel.pp = 1"), both


def test_the_defaults_and_the_other_checks_stay_as_they_were():
    assert _problems("--parallel.pp_schedule=1f1b", "--parallel.pp_virtual=1") == []
    assert _problems("--parallel.pp=2", "--parallel.pp_schedule=gpipe") == []
    # an unknown name, an asynchronous kind, a split: named by their own checks, once
    assert len(_problems("--parallel.pp_schedule=chimera")) == 1
    assert _problems("--parallel.pp_schedule=pipedream-2bw")[0].startswith("parallel.pp_schedule = 'pipedream-2bw' "
                                                                           "needs parallel.pp >= 2")
    assert len(_problems("--parallel.pp_split=1")) == 1


def test_the_planners_overrides_of_one_stage_carry_the_defaults():
    """A layout of one pipeline stage (a fixed ``--layout schedule=gpipe`` reaches pp = 1 ones) is
    written with the default schedule, which the run accepts: at pp = 1 every schedule is the same
    gradient accumulation (the planner prices it so: plan/pipeline.py)."""
    cfg = load_config(preset="tiny")
    layout = Layout(dp=1, tp=1, pp=1, sp=1, zero=0, micro_batch=cfg.train.micro_batch, schedule="gpipe",
                    precision=cfg.precision.mode)
    run = with_overrides(cfg, layout.to_overrides(), "the planner's layout")
    assert (run.parallel.pp_schedule, run.parallel.pp_virtual) == ("1f1b", 1)
    validate(run)


def test_a_fuzzer_resume_at_one_stage_resets_the_schedule_fields_it_would_ignore():
    """The layout fuzzer's resumes into pp = 1 from a pipeline write the defaults back (drawing
    nothing, so each seed's resumed layouts stay as they were)."""
    from bigtrain.check.fuzz import _one_stage_pipeline, _valid

    saved = ["--model.n_layers=4", "--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"]
    assert _valid(saved) and not _valid(saved + ["--parallel.pp=1"])
    assert _one_stage_pipeline(saved) == ["--parallel.pp_schedule=1f1b", "--parallel.pp_virtual=1"]
    assert _valid(saved + ["--parallel.pp=1", *_one_stage_pipeline(saved)])
    assert _one_stage_pipeline(["--parallel.pp=2", "--parallel.pp_schedule=1f1b"]) == []


def test_a_split_beside_a_balance_is_refused_naming_both_fields():
    """parallel.pp_split decides where the stages start; a parallel.pp_balance beside it was ignored."""
    pipeline = ["--model.n_layers=4", "--parallel.pp=2"]
    assert _problems(*pipeline, "--parallel.pp_split=1", "--parallel.pp_balance=params") == [
        "parallel.pp_split = '1' with parallel.pp_balance = 'params': the split decides where the stages start, "
        "so the balance would be ignored; remove one of them (parallel.pp_balance = 'layers' is its default, "
        "parallel.pp_split = '' balances by it)"]
    # either at its default: accepted
    assert _problems(*pipeline, "--parallel.pp_split=1", "--parallel.pp_balance=layers") == []
    assert _problems(*pipeline, "--parallel.pp_balance=params") == []


def test_the_planners_split_is_written_with_the_default_balance():
    """--parallel auto prices a config's pp_balance = 'params' cut and writes it as parallel.pp_split
    (plan/fit.py: stage_split): the run's config then carries the cut once, as the split."""
    cfg = load_config(preset="tiny", overrides=["--model.n_layers=4", "--parallel.pp_balance=params"])
    layout = Layout(dp=1, tp=1, pp=2, sp=1, zero=0, micro_batch=cfg.train.micro_batch, split=(1,),
                    precision=cfg.precision.mode)
    run = with_overrides(cfg, layout.to_overrides(), "the planner's layout")
    assert (run.parallel.pp_split, run.parallel.pp_balance) == ("1", "layers")
    validate(run)
