"""``bigtrain check``: the independent reference, putting a layout's pieces back together, and a
bisection that names the step, the unit and the ranks of an injected fault."""

import re

import pytest
import torch

from bigtrain.check.compare import TOLERANCES, assemble, relative_error
from bigtrain.check.reference import ReferenceRun, captured_module
from bigtrain.check.run import check_on_rank
from bigtrain.cli import main
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.testing import run_ranks
from helpers import lose_one_ranks_gradients, tiny_config

SIZES = {"dp": 2, "tp": 2, "sp": 2, "pp": 1}


def _coords(dp=0, tp=0, sp=0):
    return {"dp": dp, "tp": tp, "sp": sp, "pp": 0}


def test_assemble_puts_batch_sequence_and_vocabulary_pieces_back_in_order():
    full = torch.randn(4, 8, 10)
    # dp cuts the batch; Ulysses (sp) then Megatron SP (tp) cut the sequence.
    seq = [(_coords(dp, tp, sp), full[2 * dp:2 * dp + 2, 4 * sp + 2 * tp:4 * sp + 2 * tp + 2])
           for dp in range(2) for sp in range(2) for tp in range(2)]
    assert torch.equal(assemble(seq, full.shape, SIZES), full)
    # A vocabulary cut over tp with padding (10 -> 12), the sequence over sp.
    padded = torch.cat([full, torch.zeros(4, 8, 2)], dim=-1)
    vocab = [(_coords(dp, tp, sp), padded[2 * dp:2 * dp + 2, 4 * sp:4 * sp + 4, 6 * tp:6 * tp + 6])
             for dp in range(2) for sp in range(2) for tp in range(2)]
    assert torch.equal(assemble(vocab, full.shape, SIZES), full)


def test_assemble_refuses_what_it_cannot_place():
    full = torch.randn(4, 8, 10)
    only_one_replica = [(_coords(0), full[:2])]
    assert assemble(only_one_replica, full.shape, {"dp": 2}) is None
    odd = [(_coords(0), full[:, :3])]
    assert assemble(odd, full.shape, {"dp": 1}) is None


def test_relative_error_is_of_the_whole_tensor_and_can_fail():
    a = torch.ones(100)
    assert relative_error(a, a) == 0
    b = a.clone()
    b[0] += 1e-3
    assert relative_error(b, a) == pytest.approx(1e-4, rel=1e-3)  # b was rounded to fp32
    assert not relative_error(b, a) <= TOLERANCES["fp32"].loss
    assert relative_error(torch.ones(3), torch.ones(4)) == float("inf")


def test_the_reference_records_every_compared_module_in_forward_order(corpus_cache):
    cfg = tiny_config(corpus_cache, "--train.global_batch=4", "--train.micro_batch=2")
    step = ReferenceRun(cfg).train_step(capture=True)
    assert list(step.outputs) == ["tok_embeddings", "layers.0.attention", "layers.0.feed_forward", "layers.0",
                                  "layers.1.attention", "layers.1.feed_forward", "layers.1", "norm", "output"]
    assert step.outputs["output"].shape == (4, 32, 256)
    assert all(captured_module(n) for n in step.outputs)
    assert set(step.grads) == set(step.weights)


def test_check_agrees_on_a_correct_layout(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=2", "--train.global_batch=4",
                      "--train.micro_batch=1")
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3)[0]
    assert report.agree and report.steps == 3 and report.first_step is None, report.text()
    assert 0 < report.worst["loss"] <= 1e-5 and report.worst["weight"] <= 1e-4  # measured, not just passed


def test_check_names_the_step_the_unit_and_the_ranks_of_a_broken_reduction(corpus_cache, tmp_path, monkeypatch):
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=2", "--train.global_batch=4",
                      "--train.micro_batch=1")
    monkeypatch.setattr(ZeroEngine, "_reduce", lose_one_ranks_gradients("unit1", rank=1))  # layers.1
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3)[0]
    assert not report.agree
    assert report.first_step == 0
    assert report.first("forward") is None  # the first step's forward ran on the initial weights
    wrong = [f.name for f in report.findings if f.kind == "gradient"]
    assert wrong and all(name.startswith("layers.1.") for name in wrong), report.text()
    assert report.first("gradient").ranks == [0, 1]
    assert report.first("gradient").error > 0.1
    assert "layers.1." in report.text() and "DIFFER from step 1" in report.text()


def test_the_check_command_exits_0_when_the_layout_agrees(corpus_cache, tmp_path, capsys):
    code = main(["check", "--steps", "2", "--output-dir", str(tmp_path), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000", "--train.global_batch=4", "--train.micro_batch=2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "agree: 2 steps" in out
    assert (tmp_path / "check.json").exists()


def test_the_report_numbers_steps_as_the_trainer_does():
    """Step k is the k-th update everywhere (README): train's console said 'step 1/N' for the loss the
    check printed as 'step 0'. A resumed check (start = the checkpoint's step) goes on from there."""
    from bigtrain.check.report import CheckReport

    tolerance = next(iter(TOLERANCES.values()))
    report = CheckReport(agree=False, steps=2, tolerance=tolerance, losses=[(5.0, 5.0), (4.0, 4.5)], first_step=1)
    assert report.text().splitlines()[:3] == ["step 1: loss 5.000000 (reference 5.000000)",
                                              "step 2: loss 4.000000 (reference 4.500000)",
                                              f"DIFFER from step 2 (bounds: {tolerance.text()}):"]
    resumed = CheckReport(agree=True, steps=1, tolerance=tolerance, losses=[(3.0, 3.0)], start=4)
    assert resumed.text().startswith("step 5: loss 3.000000")


def test_the_check_command_rejects_a_bad_layout_before_starting(tmp_path, capsys):
    assert main(["check", "--parallel.dp=3", "--output-dir", str(tmp_path)]) == 2
    assert "train.global_batch" in capsys.readouterr().err


def test_the_check_command_refuses_absurd_steps_in_one_line_before_anything_runs(monkeypatch, capsys):
    """--steps 10**20 was taken (a check that never ends), 1e20 and 2.5 answered with argparse's
    usage block: each is one line naming --steps and its range, before the config is even read."""
    import bigtrain.check.cli as check_cli

    monkeypatch.setattr(check_cli, "check_config", lambda *a: pytest.fail("read the config"))
    for bad in ("1e20", str(10**20), "10001", "0", "-3", "2.5", "x", ""):
        assert main(["check", "--steps", bad]) == 2, bad
        err = capsys.readouterr().err
        assert err == f"bigtrain check: --steps = {bad!r}: give a whole number of steps from 1 to 10,000\n", err


@pytest.mark.slow
def test_the_check_command_runs_several_ranks_under_torchrun(corpus_cache, tmp_path, capsys):
    code = main(["check", "--steps", "2", "--output-dir", str(tmp_path), "--parallel.dp=2", "--parallel.zero=3",
                 f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000", "--train.global_batch=4",
                 "--train.micro_batch=1"])
    assert code == 0
    assert "agree: 2 steps" in capsys.readouterr().out


def test_steps_both_sides_skip_on_fp16_overflow_compare_as_equal(corpus_cache, tmp_path):
    # A loss scale of 2^16 overflows this model's first fp16 gradients on both sides: the skipped
    # steps must agree (inf gradients are not a difference), and the later ones be compared.
    cfg = tiny_config(corpus_cache, "--parallel.zero=3", "--precision.mode=fp16", "--train.global_batch=2",
                      "--train.micro_batch=2", "--model.vocab_size=258", "--model.n_layers=3")
    report = check_on_rank(0, 1, cfg, str(tmp_path), 3)
    assert report.agree, report.text()


def test_in_bf16_the_gradient_norm_decides_and_the_bisection_still_names_the_unit(corpus_cache, tmp_path,
                                                                                  monkeypatch):
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=2", "--train.global_batch=4",
                      "--train.micro_batch=1", "--precision.mode=bf16")
    monkeypatch.setattr(ZeroEngine, "_reduce", lose_one_ranks_gradients("unit1", rank=1))
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3)[0]
    assert not report.agree and report.first_step == 0
    assert report.first("grad_norm") is not None  # what decides in bf16
    wrong = [f.name for f in report.findings if f.kind == "gradient"]
    assert wrong and all(name.startswith("layers.1.") for name in wrong), report.text()


def test_a_lion_element_whose_sign_ties_passes_and_a_wrong_update_does_not(corpus_cache):
    """Lion moves each element by +-lr: an element whose interpolated momentum is a rounding error
    from 0 flips between two exact runs (fuzz seed 20261131 sample 9: one element of 12,288). Its
    tensor bound admits a few such elements; a wrong update (every sign, or a tenth of them) fails."""
    from bigtrain.check.compare import tolerance_for
    from bigtrain.check.fuzz import run_sample

    bound = tolerance_for("fp32", "lion")
    assert (bound.loss, bound.grad_norm) == (1e-5, 1e-5)  # the loss still catches a wrong earlier step
    torch.manual_seed(0)
    weight, lr = torch.randn(12_288) * 0.02, 3e-4
    update = lr * torch.sign(torch.randn(12_288))
    one_flip, tenth, all_flipped = update.clone(), update.clone(), -update
    one_flip[129] *= -1
    tenth[::10] *= -1
    assert relative_error(weight + one_flip, weight + update) < bound.tensor
    for wrong in (tenth, all_flipped):
        assert relative_error(weight + wrong, weight + update) > bound.tensor
    sample = ["--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=1", "--parallel.sp=1", "--parallel.zero=1",
              "--model.n_layers=2", "--train.micro_batch=2", "--train.global_batch=2", "--model.n_kv_heads=1",
              "--model.vocab_size=260", "--model.tie_embeddings=True", "--data.ignore_target=-1",
              "--precision.mode=fp32", "--optim.grad_clip=1.0", "--memory.checkpointing=full",
              "--model.fused_loss=true",
              "--model.fused_loss_chunk=1024", "--optim.name=lion", "--optim.lr=3e-4", "--optim.beta2=0.99",
              "--model.moe_experts=8", "--model.moe_top_k=2", "--parallel.ep=1", "--model.moe_every=2",
              "--model.moe_capacity_factor=0.0", "--model.moe_router=softmax", "--model.moe_aux_loss_coef=0.01",
              "--model.moe_ffn_hidden=0", "--model.moe_shared_expert=True", "--parallel.moe_grouped_mm=False"]
    outcome = run_sample(sample, corpus_cache, steps=3)
    assert outcome.verdict == "agree", outcome.detail


DEFERRED_CALLS: list[int] = []  # appended to inside each forked rank (its own copy)


def _check_2bw(rank, world_size, cfg, run_dir, steps):
    from bigtrain.check.run import check_layout
    from bigtrain.distributed.mesh import Mesh

    report = check_layout(cfg, Mesh.from_config(cfg.parallel, rank, world_size), run_dir, steps)
    return report, len(DEFERRED_CALLS)


TWO_BW = ("--model.n_layers=4", "--train.micro_batch=2", "--parallel.pp=2", "--parallel.pp_schedule=pipedream-2bw",
          "--train.global_batch=4")


def test_check_runs_2bw_with_its_deferred_boundary_against_the_delayed_reference(corpus_cache, tmp_path, monkeypatch):
    """2BW trains with the deferred boundary wherever it can (fit starts it), so the check does too:
    each step is compared once its update has landed, in the next step's forwards."""
    from bigtrain.train import Trainer

    real = Trainer.train_step_deferred

    def counted(self, *args, **kwargs):
        DEFERRED_CALLS.append(self.step)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step_deferred", counted)
    cfg = tiny_config(corpus_cache, *TWO_BW)
    (report, calls), (_, other) = run_ranks(_check_2bw, 2, cfg, str(tmp_path), 3)
    assert calls == other == 3
    assert report.agree and report.steps == 3, report.text()
    assert 0 < report.worst["weight"] <= 1e-5 and report.worst["loss"] <= 1e-5


def test_a_resume_across_a_change_of_schedule_replays_the_steps_as_the_saved_run_took_them(corpus_cache):
    """A resumed check replayed the steps before its checkpoint with the resumed run's gradient delay:
    2BW saved then resumed at 1F1B (or the other way round) had a reference on another trajectory,
    and the check said the layout diverged at its first step, 6.6e-3 on the loss (found by running
    the fuzzer's run_sample on such resumes: the slow test below)."""
    from bigtrain.check.reference import config_gradient_delay, replay_to_checkpoint

    two_bw = tiny_config(corpus_cache, *TWO_BW)
    one_f1b = tiny_config(corpus_cache, *TWO_BW, "--parallel.pp_schedule=1f1b")
    for saved_cfg, resumed_cfg in ((two_bw, one_f1b), (one_f1b, two_bw)):
        saved = ReferenceRun(saved_cfg)
        for _ in range(2):
            saved.train_step()
        resumed = ReferenceRun(resumed_cfg)
        replay_to_checkpoint(resumed, 2, config_gradient_delay(saved_cfg), restart=False)
        for (name, want), got in zip(saved.master.named_parameters(), resumed.master.parameters()):
            assert torch.equal(want, got), name
        # On from the checkpoint, both the synchronous step and the restarted (empty) asynchronous
        # pipeline's first take the gradient at the weights loaded: the same step as one process's.
        plain = ReferenceRun(one_f1b)
        replay_to_checkpoint(plain, 2, config_gradient_delay(saved_cfg), restart=False)
        assert resumed.train_step().loss == plain.train_step().loss
        assert (resumed.stale is None) == (resumed_cfg is one_f1b)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("pipedream-2bw", "1f1b"), ("1f1b", "pipedream-2bw")])
def test_a_pipeline_resumed_at_another_schedule_and_its_delay_agree_with_the_reference(saved, resumed, corpus_cache):
    from bigtrain.check.fuzz import run_sample

    sample = [*TWO_BW, "--train.global_batch=8", f"--parallel.pp_schedule={saved}", "resume-after=2",
              f"then:--parallel.pp_schedule={resumed}"]
    outcome = run_sample(sample, corpus_cache, steps=2)
    assert outcome.verdict == "agree", outcome.detail


def test_check_refuses_pipedream_without_vertical_sync_before_launch(corpus_cache):
    """Each stage of PipeDream without vertical sync computes with weights of its own age, which the
    reference's one delay for the whole model does not state: `bigtrain check` launched the ranks and
    crashed in them (ValueError from config_gradient_delay); now it is refused naming the field."""
    from bigtrain.check.run import reference_problems

    cfg = tiny_config(corpus_cache, "--parallel.pp=2", "--parallel.pp_schedule=pipedream", "--train.global_batch=8",
                      "--train.micro_batch=8")
    assert any("parallel.pp_vertical_sync = true" in p for p in reference_problems(cfg))
    cfg.parallel.pp_vertical_sync = True
    assert reference_problems(cfg) == []


class _TorchWithoutZeroing:
    """``torch`` for deferred.py, whose zeroing of a landed step's gradients does nothing."""

    def __getattr__(self, name):
        return (lambda tensors: None) if name == "_foreach_zero_" else getattr(torch, name)


def test_check_catches_a_deferred_update_that_leaves_a_stale_gradient(corpus_cache, tmp_path, monkeypatch):
    from bigtrain.parallel.pipeline import deferred

    monkeypatch.setattr(deferred, "torch", _TorchWithoutZeroing())  # step s's gradient joins step s + 2's
    cfg = tiny_config(corpus_cache, *TWO_BW)
    report, _ = run_ranks(_check_2bw, 2, cfg, str(tmp_path), 4)[0]
    assert not report.agree and report.first_step == 2, report.text()


@pytest.mark.parametrize("world,extra", [
    (3, ("--parallel.pp=3", "--model.n_layers=6", "--model.tie_embeddings=true")),  # the middle stage holds no tied weight
    (2, ("--model.n_layers=2", "--model.moe_experts=2", "--model.moe_every=2")),  # stage 0 holds no MoE block
])
def test_2bw_ranks_agree_on_the_boundary_they_run_when_only_some_stages_hold_what_forbids_deferring(
        world, extra, corpus_cache, tmp_path, monkeypatch):
    """Found by the layout fuzzer: each rank decided from its own stage, so a middle stage deferred
    while the end stages, holding the tied weights, did not, and their collectives never met."""
    from bigtrain.train import Trainer

    real = Trainer.train_step_deferred
    monkeypatch.setattr(Trainer, "train_step_deferred",
                        lambda self, *a, **k: (DEFERRED_CALLS.append(self.step), real(self, *a, **k))[1])
    cfg = tiny_config(corpus_cache, *TWO_BW, *extra)
    reports = run_ranks(_check_2bw, world, cfg, str(tmp_path), 3, timeout=120)
    assert reports[0][0].agree, reports[0][0].text()
    assert {calls for _, calls in reports} == {0}  # all synchronous


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_the_reference_starts_from_init_from_weights_and_check_takes_the_folders_shape(family, corpus_cache,
                                                                                        tmp_path):
    """`bigtrain check` with model.init_from: its reference started from the seed's random weights
    while the layout started from the folder's, so every check said DIFFER from step 1 (a loss 3e-3
    apart, the embedding 1.4 relative); and `check --config` refused a file `bigtrain train` ran,
    naming each [model] field the folder's config.json sets. The reference's first loss is
    transformers' own on the folder's model and the same batch."""
    transformers = pytest.importorskip("transformers")
    from bigtrain.check.cli import check_config
    from bigtrain.families.hf_reference import HFReference

    torch.manual_seed(3)
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    made = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)) if family == "llama" else
            transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=8)))
    folder = tmp_path / "hf"
    made.save_pretrained(str(folder))
    overrides = [f"--model.init_from=hf:{folder}", f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000"]
    overrides += ["--model.family=hf", f"--model.hf_config={folder}"] if family == "hf" else []
    cfg = check_config("tiny", None, overrides)  # the llama family: dim, layers and heads from the folder
    reference = ReferenceRun(cfg) if family == "llama" else HFReference(cfg)
    tokens, targets = reference.sampler.batch(0, 0, cfg.train.global_batch)
    with torch.no_grad():
        logits = made.float().eval()(tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert reference.train_step().loss == pytest.approx(expected, rel=1e-5)


def test_train_steps_given_to_check_without_steps_is_said_to_set_the_schedule_not_the_steps_compared(
        corpus_cache, tmp_path, capsys, monkeypatch):
    """docs/optimizers.md measured with ``bigtrain check --train.steps=5``, meaning 5 steps compared:
    the check compared --steps' default 4, of a 5-step schedule, without a word. It says so now."""
    from pathlib import Path

    from bigtrain.check import cli as check_cli

    compared = []
    monkeypatch.setattr(check_cli, "_check_rank",
                        lambda cfg, out, steps: compared.append((steps, cfg.train.steps)) or 0)
    base = ["check", "--output-dir", str(tmp_path), f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000"]
    assert main(base + ["--train.steps=5"]) == 0
    assert ("bigtrain check: note: --train.steps=5 sets the learning-rate schedule's length; the steps compared "
            "are --steps (default 4): give --steps 5 to compare 5") in capsys.readouterr().err
    assert main(base + ["--steps", "5", "--train.steps", "5"]) == 0  # both given: the user said which is which
    assert main(base + ["--steps", "3"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert compared == [(4, 5), (5, 5), (3, 20)]
    docs = Path(__file__).resolve().parents[1] / "docs"
    for page in docs.glob("*.md"):  # a documented check command that means --steps says it
        for command in re.findall(r"`(bigtrain check [^`]*)`", page.read_text()):
            assert "--train.steps" not in command or "--steps" in command.replace("--train.steps", ""), \
                (page.name, command)


def test_the_check_command_neither_replaces_nor_refuses_by_mistake_a_config_toml_in_output_dir(
        corpus_cache, tmp_path, capsys, monkeypatch):
    """`bigtrain check --output-dir DIR` wrote the ranks' resolved config over a config.toml the user
    kept in DIR (their --config, even). Refused before anything runs now, by the rule and the function
    `bigtrain train` uses (bigtrain.run_dir.users_config_problem); the config.toml the check writes
    for its ranks is marked as bigtrain's, so the next check into DIR may replace it."""
    import json

    import bigtrain.distributed.launch as launch
    from bigtrain.run_dir import CONFIG_HEADER

    mine = "# my experiment\n[optim]\nlr = 0.001\n"
    (tmp_path / "config.toml").write_text(mine)
    base = ["check", "--output-dir", str(tmp_path), f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000",
            "--parallel.dp=2"]
    launched = []

    def ranks(world, argv):  # the ranks' check, as far as the launching process sees it
        launched.append((tmp_path / "config.toml").read_text())
        (tmp_path / "check.json").write_text(json.dumps({"agree": True, "text": "agree"}))
        return 0

    monkeypatch.setattr(launch, "launch_local", ranks)
    for extra in ([], ["--config", str(tmp_path / "config.toml")]):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert (f"--output-dir = '{tmp_path}' holds a config.toml that bigtrain did not "
                                         f"write") in err and "the check would write" in err, err
        assert (tmp_path / "config.toml").read_text() == mine and not launched
    (tmp_path / "config.toml").unlink()
    assert main(base) == 0 and main(base) == 0  # the second replaces the first's own config.toml
    assert len(launched) == 2 and all(text.startswith(CONFIG_HEADER + "\n") for text in launched)
