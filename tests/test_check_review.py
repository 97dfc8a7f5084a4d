"""Adversarial review of ``bigtrain check``'s two relaxations (bigtrain/check/exact.py's float64
twin, bigtrain/check/replay.py's replayed fp32 AdamW step that "explains" an updated weight):
concrete layout faults each of them must not excuse."""

import torch

from bigtrain.check.run import check_on_rank
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.testing import run_ranks
from helpers import tiny_config


def _stale_copy(name: str):
    """ZeroEngine.step that leaves the unit holding ``name`` (the last stage's copy of a tied
    weight) as it was before the step: the two copies of one weight part ways."""
    original = ZeroEngine.step

    def faulty(self, lr, max_norm, skip=None):
        held = [u for u in self.units if any(s.name == name for s in u.slots)]
        kept = [u.master.detach().clone() for u in held]
        out = original(self, lr, max_norm, skip)
        with torch.no_grad():
            for unit, master in zip(held, kept):
                unit.master.copy_(master)
                self.publish_unit(unit)
        return out

    return faulty


def test_a_stale_tied_copy_is_not_explained_by_the_replay(corpus_cache, tmp_path, monkeypatch):
    """pp = 2 with tied embeddings: the last stage's copy of the embedding (``output.weight``) is
    not updated. Its gradient (the summed one) is the reference's, but full_state leaves copies
    out, so the replay never steps it: the copy's wrong value must still be a divergence."""
    cfg = tiny_config(corpus_cache, "--parallel.pp=2", "--model.tie_embeddings=true", "--parallel.zero=1",
                      "--train.global_batch=4", "--train.micro_batch=2")
    monkeypatch.setattr(ZeroEngine, "step", _stale_copy("output.weight"))
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 1)[0]
    assert not report.agree, report.text()
    assert report.first_step == 0 and any(f.name == "output.weight" for f in report.findings), report.text()


def _moments_lost_after_step(lost: int):
    """ZeroEngine.step whose step ``lost`` (counted from 0) resets every rank's first moments."""
    original, steps = ZeroEngine.step, []

    def faulty(self, lr, max_norm, skip=None):
        out = original(self, lr, max_norm, skip)
        if len(steps) == lost:
            for state in self.optimizer.state.values():
                state["exp_avg"].zero_()
        steps.append(lr)
        return out

    return faulty


def test_a_resumed_check_does_not_explain_updates_from_moments_it_never_verified(corpus_cache, tmp_path, monkeypatch):
    """The replay steps from the layout's own moments; a fresh run's first step starts from none,
    so every moment is one the replays made. A resumed run starts from the moments it loaded,
    which are checked against what was saved, not against the reference's: a saving run whose
    first moments were lost resumes with them lost, every step replays, every gradient is within
    bound, and its weights must still be a divergence, not an explained update."""
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=1", "--train.global_batch=4",
                      "--train.micro_batch=1")
    from bigtrain.check.run import save_on_rank

    with monkeypatch.context() as patch:
        patch.setattr(ZeroEngine, "step", _moments_lost_after_step(1))  # the last before the save
        saved = run_ranks(save_on_rank, 2, cfg, str(tmp_path), 2)[0]
    assert not any(s["exp_avg"].any() for s in saved[1]["state"].values())  # the fault took
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 1, saved)[0]
    assert not report.agree and report.first_step == 2, report.text()
    assert any(f.kind == "weight" for f in report.findings), report.text()


def test_a_checked_saving_run_catches_lost_moments_and_hands_its_chain_to_the_resumed_check(corpus_cache, tmp_path,
                                                                                           monkeypatch):
    """The fuzzer checks a resumed sample's first part as well (``check_layout``'s ``save``), so the
    resumed check may continue its chain of replayed updates (``saved_anchored``): a Hugging Face
    Qwen2's key bias, whose gradient is near Adam's eps, drifted 2.1e-4 in the unchecked saving run
    and was then a false divergence after the resume (fuzz seed 20261442, sample 11). The moments
    lost in the saving run above are caught there, at the step that lost them, and nothing is saved."""
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=1", "--train.global_batch=4",
                      "--train.micro_batch=1")
    with monkeypatch.context() as patch:
        patch.setattr(ZeroEngine, "step", _moments_lost_after_step(1))
        lost = run_ranks(check_on_rank, 2, cfg, str(tmp_path / "lost"), 2, None, False, True)[0]
    assert not lost.agree and lost.first_step == 1 and lost.saved is None, lost.text()
    assert any(f.kind == "replayed" for f in lost.findings), lost.text()
    before = run_ranks(check_on_rank, 2, cfg, str(tmp_path / "kept"), 2, None, False, True)[0]
    assert before.agree and before.anchored and before.saved is not None, before.text()
    after = run_ranks(check_on_rank, 2, cfg, str(tmp_path / "kept"), 1, before.saved, True)[0]
    assert after.agree and after.anchored and after.start == 2, after.text()
    unchained = run_ranks(check_on_rank, 2, cfg, str(tmp_path / "kept"), 1, before.saved)[0]
    assert not unchained.anchored  # a checkpoint nothing checked: its moments are not the chain's


def test_the_replay_vouches_for_a_tied_copy_only_while_it_equals_the_weight_it_copies():
    from bigtrain.check.replay import stepped_parameters

    w, g = torch.randn(4, 3), torch.randn(4, 3)
    before = ({"emb": w, "norm": torch.ones(3)}, {})
    grads = {"emb": g}  # "norm" gathered no gradient: not stepped
    updated = w - 1e-2 * g
    assert stepped_parameters(before, grads, {"emb": updated, "head": updated.clone()}, {"head": "emb"}) == {"emb", "head"}
    assert stepped_parameters(before, grads, {"emb": updated, "head": w.clone()}, {"head": "emb"}) == {"emb"}


def test_a_chain_of_replays_starts_fresh_only_from_no_moments_or_zero_ones():
    from bigtrain.check.replay import starts_fresh

    zero = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    assert starts_fresh({"state": {}}) and starts_fresh({}) and starts_fresh({"state": {"w": zero}})  # offload allocates ahead
    for changed in ({"step": torch.tensor(2.0)}, {"exp_avg": torch.tensor([0.0, 1e-30, 0.0])}):
        assert not starts_fresh({"state": {"w": {**zero, **changed}}})  # a resumed run's loaded state
