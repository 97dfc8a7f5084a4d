"""The asynchronous pipelines: PipeDream-2BW and PipeDream weight stashing (docs/async.md).

Parity is against the independent one-process reference with a gradient delay
(:class:`bigtrain.check.reference.ReferenceRun`, ``gradient_delay``): step t's gradient is computed with
the weights of ``delay`` updates before and applied to the current ones. fp32, per-step loss and every
final weight within 1e-5 relative.
"""

import functools

import pytest
import torch

from bigtrain.check.reference import ReferenceRun
from bigtrain.parallel.pipeline import build_schedule, simulate, validate
from bigtrain.parallel.pipeline.schedules import step_segments, steady_segments
from bigtrain.parallel.pipeline.simulate import steady_step_time
from bigtrain.plan.pipeline import PipelineModel, weight_versions
from bigtrain.testing import run_ranks
from helpers import assert_rel_close, params_of, run_steps, tiny_config, trainer_on_rank

STEPS = 4
MODEL = ["--model.n_layers=4", f"--train.steps={STEPS}"]


# -- the schedules as data ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,p,m", [("pipedream-2bw", 2, 1), ("pipedream-2bw", 3, 2), ("pipedream-2bw", 4, 4),
                                      ("pipedream-2bw", 4, 8), ("pipedream", 2, 1), ("pipedream", 4, 1)])
def test_async_schedules_validate_and_repeat_a_steady_step(kind, p, m):
    schedule = build_schedule(kind, p, m)
    validate(schedule)
    for rank in range(p):
        first, steady = steady_segments(schedule, rank)
        segments = step_segments(schedule, rank)
        assert first == segments[0] and len(segments) == schedule.steps
        forwards = [a.microbatch for a in steady if a.kind.value == "F"]
        backwards = [a.microbatch for a in steady if a.kind.value == "B"]
        # a steady step: the step's m backwards, and m forwards run p - 1 - rank micro-batches ahead
        assert backwards == list(range(m, 2 * m))
        assert forwards == list(range(m + p - 1 - rank, 2 * m + p - 1 - rank))


def test_no_flush_removes_the_bubble_in_the_simulator_and_the_planner():
    p, m = 4, 4
    sync, two_bw = build_schedule("1f1b", p, m), build_schedule("pipedream-2bw", p, m)
    assert steady_step_time(sync, simulate(sync)) == (m + p - 1) * 3.0  # f = 1, b = 2
    assert steady_step_time(two_bw, simulate(two_bw)) == m * 3.0
    terms = PipelineModel().terms("pipedream-2bw", p, m, 1, 1.0, 2.0)
    assert terms.makespan == m * 3.0 and terms.bubble == 0.0
    with pytest.raises(ValueError, match="m=1"):
        build_schedule("pipedream", p, 2)


# -- training -----------------------------------------------------------------------------------------
def _train(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses = run_steps(trainer, STEPS)
    executor = trainer.executor
    stage_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    versions = {s: (v.peak, v.peak_bytes) for s, v in executor.versions.items()}
    return losses, params_of(trainer), versions, stage_bytes, executor.version_log


@functools.lru_cache(maxsize=None)
def _reference(cache_dir, args, delay):
    """Per-step losses and final weights of the one-process loop with a gradient delay;
    ``delay``: steps, or per stage of a pp = 2 split (embedding and layers 0-1; the rest)."""
    cfg = tiny_config(cache_dir, *args)
    if isinstance(delay, tuple):
        def of(name):
            first = name.startswith("tok_embeddings") or name.startswith(("layers.0.", "layers.1."))
            return delay[0] if first else delay[1]
    else:
        of = delay
    run = ReferenceRun(cfg, gradient_delay=of)
    losses = [run.train_step().loss for _ in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in run.master.named_parameters()}


def _check_parity(results, reference):
    ref_losses, ref_params = reference
    seen = set()
    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in params.items():
            assert_rel_close(value, ref_params[name], 1e-5, name)
            seen.add(name)
    assert seen == set(ref_params), "some weights were not compared"


@pytest.mark.parametrize("pp", [2, 4])
def test_2bw_applies_each_steps_gradient_one_step_late(pp, corpus_cache, tmp_path):
    args = (*MODEL, "--train.micro_batch=2", f"--parallel.pp={pp}", "--parallel.pp_schedule=pipedream-2bw")
    results = run_ranks(_train, pp, tiny_config(corpus_cache, *args), str(tmp_path), timeout=240)
    _check_parity(results, _reference(corpus_cache, args, 1))
    synchronous = _reference(corpus_cache, args, 0)[0]
    assert results[0][0][1] != pytest.approx(synchronous[1], rel=1e-4), "no delay: the check could not fail"
    for rank, (_, _, versions, stage_bytes, _) in enumerate(results):
        for peak, peak_bytes in versions.values():  # measured == the planner's figure
            assert peak == weight_versions("pipedream-2bw", pp, rank) == 2
            assert peak_bytes == peak * stage_bytes


@pytest.mark.parametrize("pp,vertical_sync", [(2, False), (2, True), (4, True)],
                         ids=["pp2-stage-versions", "pp2-vertical-sync", "pp4-vertical-sync"])
def test_pipedream_backward_uses_the_weights_its_forward_used(pp, vertical_sync, corpus_cache, tmp_path):
    args = (*MODEL, "--train.micro_batch=8", f"--parallel.pp={pp}", "--parallel.pp_schedule=pipedream",
            f"--parallel.pp_vertical_sync={str(vertical_sync).lower()}")
    results = run_ranks(_train, pp, tiny_config(corpus_cache, *args), str(tmp_path), timeout=240)
    # Each micro-batch's gradient is taken at the version its stage's forward used: rank r runs
    # micro-batch k with version k - (p - 1 - r), or k - (p - 1) on every rank with vertical sync.
    _check_parity(results, _reference(corpus_cache, args, pp - 1 if vertical_sync else (1, 0)))
    for rank, (_, _, versions, stage_bytes, log) in enumerate(results):
        for peak, peak_bytes in versions.values():
            assert peak == weight_versions("pipedream", pp, rank, vertical_sync)
            assert peak_bytes == peak * stage_bytes
        forward = {label[1:]: v for label, v in log if label[0] == "F"}
        backward = {label[1:]: v for label, v in log if label[0] == "B"}
        assert backward and set(backward) <= set(forward)
        for mb, version in backward.items():
            assert version == forward[mb]
        delay = pp - 1 if vertical_sync else pp - 1 - rank
        assert all(v == max(int(mb.split(".")[0]) - delay, 0) for mb, v in {**forward, **backward}.items())


def test_the_planner_counts_the_weight_versions_of_the_worst_rank():
    from bigtrain.plan import Layout, ModelSpec, estimate_memory, get_profile

    model = ModelSpec.build(layers=8, hidden=512, heads=8, vocab=32000, seq=1024)
    profile = get_profile("h100-80g")
    for kind, versions in (("1f1b", 0), ("pipedream-2bw", 2), ("pipedream", 4)):
        layout = Layout(pp=4, schedule=kind, precision="fp32")
        mem = estimate_memory(model, layout, profile, global_batch=4 if kind == "pipedream" else 16)
        assert mem.buffers.get("weight_versions", 0) == versions * mem.params


# -- the deferred 2BW boundary (bigtrain/parallel/pipeline/deferred.py) --------------------------------
def _nan_loss_on_last_stage(trainer, step: int, fault_step: int | None) -> None:
    """Make the loss of step ``fault_step`` NaN (the last stage runs only its own micro-batches)."""
    if not hasattr(trainer, "_clean_loss_sum"):
        trainer._clean_loss_sum = trainer.parallel.loss_sum
    clean = trainer._clean_loss_sum
    last = trainer.executor.schedule.num_stages - 1 in trainer.executor.stages
    faulty = step == fault_step and last
    trainer.parallel.loss_sum = (lambda logits, targets: clean(logits, targets) + float("nan")) if faulty else clean


def _train_deferred(rank, world_size, cfg, run_dir, fault_step=None):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    assert trainer.start_deferred_updates()
    results = []
    for step in range(STEPS):
        _nan_loss_on_last_stage(trainer, step, fault_step)
        results += trainer.train_step_deferred()
    results += trainer.flush_update()
    versions = {s: v.peak for s, v in trainer.executor.versions.items()}
    return ([(r.step, r.loss, r.grad_norm, r.skipped) for r in results], params_of(trainer), versions,
            trainer.deferred.landed_by_forward)


def _train_synchronous(rank, world_size, cfg, run_dir, fault_step=None):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    results = []
    for step in range(STEPS):
        _nan_loss_on_last_stage(trainer, step, fault_step)
        results.append(trainer.train_step())
    return [(r.step, r.loss, r.grad_norm, r.skipped) for r in results], params_of(trainer)


@pytest.mark.parametrize("pp", [2, 4])
def test_2bw_deferred_boundary_gives_the_synchronous_numbers(pp, corpus_cache, tmp_path):
    args = (*MODEL, "--train.micro_batch=2", f"--parallel.pp={pp}", "--parallel.pp_schedule=pipedream-2bw")
    cfg = tiny_config(corpus_cache, *args)
    deferred = run_ranks(_train_deferred, pp, cfg, str(tmp_path / "deferred"), timeout=240)
    synchronous = run_ranks(_train_synchronous, pp, cfg, str(tmp_path / "sync"), timeout=240)
    for rank, ((steps, params, versions, by_forward), (sync_steps, sync_params)) in enumerate(zip(deferred,
                                                                                                  synchronous)):
        # upstream ranks land step s's update inside step s + 1's segment (step s + 2's first forward
        # needs it), all but the last step's (flushed); the last stage at the end of the next segment
        assert by_forward == (0 if rank == pp - 1 else STEPS - 1)
        assert [s[0] for s in steps] == list(range(STEPS)), "every step reported once, in order"
        for (_, loss, norm, skipped), (_, sync_loss, sync_norm, sync_skipped) in zip(steps, sync_steps):
            assert (loss, norm, skipped) == (sync_loss, sync_norm, sync_skipped)
        for name, value in params.items():
            assert torch.equal(value, sync_params[name]), name
        assert all(peak <= weight_versions("pipedream-2bw", pp, rank) for peak in versions.values())


def _fit(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    history = trainer.fit()
    return [(r.step, r.loss, r.grad_norm) for r in history], params_of(trainer), trainer.deferred is not None


def _fit_noting_the_resume_warnings(rank, world_size, cfg, run_dir):
    """:func:`_fit`, and the warnings it gave on this rank about the resumed trajectory."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _fit(rank, world_size, cfg, run_dir)
    return (*result, [str(w.message) for w in caught if "trajectory" in str(w.message)])


def _steps_then_resume(rank, world_size, cfg, run_dir, first, total):
    """Today's boundary: ``first`` synchronous steps, save, then a new trainer resumes to ``total``."""
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    losses = [trainer.train_step().loss for _ in range(first)]
    trainer.save()
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    trainer.resume("auto")
    losses += [trainer.train_step().loss for _ in range(total - first)]
    return losses, params_of(trainer)


def test_2bw_deferred_fit_checkpoints_and_resumes_as_the_synchronous_boundary(corpus_cache, tmp_path):
    """Resumed, it continues as today's boundary does (not the uninterrupted 2BW run: rank 0 warns)."""
    args = ("--model.n_layers=4", "--train.micro_batch=2", "--parallel.pp=2", "--parallel.pp_schedule=pipedream-2bw",
            "--checkpoint.every=2", "--checkpoint.keep=5")
    # an interrupted run: 3 steps (checkpoints at 2), then resumed to 5 (a checkpoint at 4, the last flushed)
    first = tiny_config(corpus_cache, *args, "--train.steps=3")
    run_dir = str(tmp_path / "deferred")
    head = run_ranks(_fit, 2, first, run_dir, timeout=240)
    resumed = tiny_config(corpus_cache, *args, "--train.steps=5", "--checkpoint.resume=auto")
    tail = run_ranks(_fit_noting_the_resume_warnings, 2, resumed, run_dir, timeout=240)
    sync = run_ranks(_steps_then_resume, 2, first, str(tmp_path / "sync"), 2, 5, timeout=240)
    for rank in range(2):
        assert head[rank][2] and tail[rank][2], "fit ran the deferred boundary"
        # The stash is not saved (docs/async.md): said once, by rank 0, at the resume.
        assert len(tail[rank][3]) == (1 if rank == 0 else 0), tail[rank][3]
        assert all("written by parallel.pp_schedule = 'pipedream-2bw', which keeps a stashed weight version that no "
                   "checkpoint holds"
                   in said and "(docs/async.md, 'Limits')" in said for said in tail[rank][3])
        losses = [loss for _, loss, _ in head[rank][0][:2] + tail[rank][0]]
        assert [s for s, _, _ in tail[rank][0]] == [2, 3, 4]
        assert losses == sync[rank][0]
        for name, value in tail[rank][1].items():
            assert torch.equal(value, sync[rank][1][name]), name


def test_2bw_deferred_boundary_skips_a_non_finite_step_as_the_synchronous_one(corpus_cache, tmp_path):
    args = (*MODEL, "--train.micro_batch=2", "--parallel.pp=2", "--parallel.pp_schedule=pipedream-2bw")
    cfg = tiny_config(corpus_cache, *args)
    deferred = run_ranks(_train_deferred, 2, cfg, str(tmp_path / "deferred"), 2, timeout=240)
    synchronous = run_ranks(_train_synchronous, 2, cfg, str(tmp_path / "sync"), 2, timeout=240)
    for (steps, params, *_), (sync_steps, sync_params) in zip(deferred, synchronous):
        assert [skipped for *_, skipped in steps] == [False, False, True, False]
        assert str(steps) == str(sync_steps)  # NaN == NaN as text
        for name, value in params.items():
            assert torch.equal(value, sync_params[name]), name


@pytest.mark.parametrize("kind", ["pipedream-2bw", "pipedream"])
def test_the_balancing_bias_router_is_refused_without_a_flush(kind):
    """Found by the layout fuzzer (seed 20261146, sample 38): the sigmoid router's bias moves at the
    step boundary, after upstream stages began the next step's forwards with the old one."""
    from bigtrain.config import ConfigError, load_config
    from bigtrain.validation import validate as validate_config

    cfg = load_config(preset="tiny", overrides=["--parallel.pp=2", f"--parallel.pp_schedule={kind}",
                                                "--model.moe_experts=4", "--model.moe_router=sigmoid-bias",
                                                "--train.micro_batch=8", "--train.global_batch=8"])
    with pytest.raises(ConfigError, match="model.moe_router = 'sigmoid-bias' with parallel.pp_schedule"):
        validate_config(cfg)
