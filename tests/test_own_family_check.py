"""``bigtrain check`` of a family of one's own: examples/own_family's GPT-2 against the generic
reference (bigtrain/check/reference_own.py: the family's model in one plain process, the Trainer's
initial values and batches, torch's AdamW) at dp 2 x ZeRO-2 and at tp 2 by its tp_plan, agreeing at
docs/correctness.md's fp32 bounds; and the same check failing a layout that is wrong on purpose (a
tp_plan that drops the backward all-reduce at the MLPs' entry, a 1 % scale of a gradient), so the
agreement is not the check's blindness."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from bigtrain.check.reference_own import OwnReference, captured_of
from bigtrain.check.run import check_on_rank, reference_problems
from bigtrain.cli import main
from bigtrain.config import load_config
from bigtrain.families import registry
from bigtrain.parallel.tensor.styles import ColumnParallel, RowParallel, Style
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from tests.test_own_family import CONFIG, EXAMPLE, clean_registry  # noqa: F401 (autouse: a clean registry)

STEPS = 3


def _config(corpus_cache: str, *overrides: str):
    cfg = load_config(path=CONFIG, overrides=[f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000",
                                              "--logging.progress=false", "--logging.report=false",
                                              "--checkpoint.save_final=false", *overrides])
    validate(cfg, world_size=cfg.parallel.world_size)  # imports gpt2_family: the forked ranks inherit it
    return cfg


def _check(cfg, tmp_path):
    assert reference_problems(cfg) == []
    return run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), STEPS, timeout=180)[0]


@pytest.mark.parametrize("layout", [("--parallel.dp=2", "--parallel.zero=2"),
                                    ("--parallel.dp=1", "--parallel.zero=0", "--parallel.tp=2")],
                         ids=["dp2-zero2", "tp2"])
def test_bigtrain_check_of_the_example_family_agrees(corpus_cache, tmp_path, layout):
    """Every step's loss and gradient norm within 1e-5, each block's output, reduced gradient and
    updated weight within 1e-4 (the key third of each c_attn.bias, whose gradient is rounding alone,
    is judged against the float64 reference: tests/test_own_family.py ``comparable``)."""
    report = _check(_config(corpus_cache, *layout), tmp_path)
    assert report.agree, report.text()
    assert report.steps == STEPS
    assert report.worst["loss"] <= 1e-6 and report.worst["forward"] <= 1e-4, report.text()
    assert all(f.name.endswith("attn.c_attn.bias") for f in report.within_rounding), report.text()


def test_lion_steps_the_key_bias_by_its_rounding_and_the_check_tells_it_from_a_defect(corpus_cache, tmp_path):
    """The key third of c_attn.bias has a gradient of rounding alone, so Lion steps each of its
    elements by +-lr as fp32's rounding falls, the layout one way and the reference another (0.56
    apart by step 2); the float64 twin measures the fp32 reference as far from the exact run, so
    that tensor is within rounding, and every other tensor keeps its bound."""
    cfg = _config(corpus_cache, "--parallel.dp=2", "--parallel.zero=2", "--optim.name=lion", "--optim.lr=3e-4")
    report = _check(cfg, tmp_path)
    assert report.agree, report.text()
    assert report.within_rounding and all(f.name.endswith("attn.c_attn.bias") for f in report.within_rounding)


class ScaledGradient(Style):
    """Wrong on purpose: a column-parallel cut whose output's gradient is taken 1.01 times (a layout
    that scales what it reduces), the forward untouched."""

    def apply(self, module, ctx) -> None:
        module.register_full_backward_pre_hook(lambda m, grad_output: tuple(g * 1.01 for g in grad_output))
        ColumnParallel().apply(module, ctx)


def _no_entry(model, tp, sequence_parallel, ulysses) -> dict:
    """The example's plan without PrepareInput at the MLPs: the forward is right, and the input
    gradient of each MLP lacks the other tp rank's part (no backward all-reduce)."""
    from bigtrain.parallel.tensor.styles import VocabParallelEmbedding, VocabParallelOutput

    return {"wte": VocabParallelEmbedding(), "lm_head": VocabParallelOutput(),
            "h.*.mlp.c_fc": ColumnParallel(), "h.*.mlp.c_proj": RowParallel()}


def _scaled(model, tp, sequence_parallel, ulysses) -> dict:
    import gpt2_family

    plan = gpt2_family.tp_plan(model, tp, sequence_parallel, ulysses)
    entry, _ = plan.pop("h.*.mlp.c_fc")  # a pattern names each module once: h.0's as it was, h.1's scaled
    return {**plan, "h.0.mlp.c_fc": [entry, ColumnParallel()], "h.1.mlp.c_fc": [entry, ScaledGradient()]}


@pytest.mark.parametrize("plan,first_gradient", [(_no_entry, "h.1.ln_2"), (_scaled, "h.1.mlp.c_fc")],
                         ids=["no-backward-all-reduce", "gradient-times-1.01"])
def test_bigtrain_check_reports_a_wrong_tp_plan_as_diverged(corpus_cache, tmp_path, plan, first_gradient):
    """The check can fail: a tp_plan of the family that is wrong on purpose diverges at the first
    step, the bisection naming the first parameter (in backward order) whose gradient is wrong."""
    cfg = _config(corpus_cache, "--parallel.dp=1", "--parallel.zero=0", "--parallel.tp=2")
    import gpt2_family

    registry.FAMILIES["gpt2"] = replace(gpt2_family.GPT2_FAMILY, tp_plan=plan)
    report = _check(cfg, tmp_path)
    assert not report.agree and report.first_step == 0, report.text()
    assert report.first("forward") is None  # the forward is right: the backward is not
    assert report.first("gradient").name.startswith(first_gradient), report.text()
    assert report.first("grad_norm") is not None


def test_the_reference_starts_from_the_trainers_values_and_compares_the_blocks(corpus_cache):
    """Its model is the family's, tied head included, valued by the Trainer's own init function;
    the outputs compared are the family's blocks."""
    from bigtrain.families.own import initial_values

    cfg = _config(corpus_cache, "--parallel.dp=1", "--parallel.zero=0")
    family = registry.FAMILIES["gpt2"]
    reference = OwnReference(cfg)
    assert reference.model.lm_head.weight is reference.model.wte.weight
    values = initial_values(family, cfg, family.build_meta(cfg))
    for name, p in reference.model.named_parameters():
        assert torch.equal(p, values(name, tuple(p.shape))), name
    captured = captured_of(family, cfg)
    assert [n for n, _ in reference.model.named_modules() if captured(n)] == ["h.0", "h.1"]


def test_check_refuses_what_the_reference_does_not_state_naming_the_field(corpus_cache, capsys, monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    assert main(["check", "--config", "gpt2.toml", "--offload.optimizer=cpu", "--offload.delayed_update=true"]) == 2
    assert "offload.delayed_update = true: the reference of a family of one's own (model.family = 'gpt2') does " \
           "not state it (a gradient one update old); set offload.delayed_update = false" in capsys.readouterr().err


def test_fp16_skips_the_same_overflowing_steps_on_both_sides(corpus_cache, tmp_path):
    """A loss scale of 1e12, backed off by 1e-6: the first two steps overflow fp16 on both sides
    and are skipped (their inf gradients are no difference), the third is compared at fp16's bounds."""
    scale = ("--precision.mode=fp16", "--precision.loss_scale=1e12", "--precision.scale_backoff=1e-6")
    cfg = _config(corpus_cache, "--parallel.dp=2", "--parallel.zero=2", *scale)
    report = _check(cfg, tmp_path)
    assert report.agree, report.text()
    assert report.tolerance.loss == 1e-3
    reference = OwnReference(cfg)
    assert [reference.train_step().skipped for _ in range(STEPS)] == [True, True, False]


def test_bigtrain_check_runs_from_the_command_line(corpus_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    assert main(["check", "--config", "gpt2.toml", "--steps", "2", "--output-dir", str(tmp_path),
                 "--parallel.dp=1", "--parallel.zero=0", f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000"]) == 0
    assert "agree: 2 steps" in capsys.readouterr().out
    assert "gpt2_family" in sys.modules


class TupleBlock(torch.nn.Module):
    """A block returning (hidden, None), as Hugging Face's layers do: no single tensor to compare."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x)))), None


class TupleDecoder(torch.nn.Module):
    """Token embeddings scaled by a buffer its constructor computes (lost on the meta device: the
    family's init_fn gives it), blocks of tuples, a final norm and an untied head."""

    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, dim), persistent=False)
        self.layers = torch.nn.ModuleList(TupleBlock(dim) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) * self.gain
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(self.norm(x))


def _tuple_init(cfg, model):
    from bigtrain.families.own import seeded_init

    weights = seeded_init(cfg, model)
    return lambda name, shape: torch.linspace(0.5, 1.5, shape[0]) if name == "gain" else weights(name, shape)


def test_a_family_with_its_own_init_and_tuple_blocks_is_checked_at_dp2_zero3(corpus_cache, tmp_path):
    """The family's init_fn values the reference too (its buffer included); blocks returning tuples
    are not compared, the final norm and head are; ZeRO-3 with the blocks as units agrees."""
    from bigtrain.families import Family

    def build(cfg):
        with torch.device("meta"):
            return TupleDecoder(cfg.model.vocab_size, cfg.model.dim, cfg.model.n_layers)

    registry.register_family(Family(name="tuples", summary="a test decoder of tuples", build_meta=build,
                                    init_fn=_tuple_init, blocks=lambda m: m.layers, final_norm="norm",
                                    head="head"))
    cfg = _config(corpus_cache, "--model.family=tuples", "--model.family_module=", "--parallel.dp=2",
                  "--parallel.zero=3")
    report = _check(cfg, tmp_path)
    assert report.agree, report.text()
    assert report.worst["loss"] <= 1e-6, report.text()
    reference = OwnReference(cfg)
    assert torch.equal(reference.model.gain, torch.linspace(0.5, 1.5, cfg.model.dim))
    step = reference.train_step(capture=True)
    assert sorted(step.outputs) == ["head", "norm"]  # the blocks' tuples are not compared


def test_a_familys_own_reference_replaces_the_generic_one(corpus_cache):
    import gpt2_family

    class Mine:
        @staticmethod
        def problems(cfg):
            return ["mine"]

    cfg = _config(corpus_cache, "--parallel.dp=1", "--parallel.zero=0")
    registry.FAMILIES["gpt2"] = replace(gpt2_family.GPT2_FAMILY, reference=Mine)
    assert reference_problems(cfg) == ["mine"]


def _frozen_positions(cfg):
    """The example's GPT-2 with its learned positions frozen (``requires_grad = False``), as a user
    fine-tuning part of a model sets it in their family's build."""
    import gpt2_family

    model = gpt2_family.build(cfg)
    model.wpe.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("layout", [("--parallel.dp=2", "--parallel.zero=3"),
                                    ("--parallel.dp=2", "--parallel.zero=1"),
                                    ("--parallel.dp=1", "--parallel.zero=0", "--parallel.tp=2")],
                         ids=["dp2-zero3", "dp2-zero1", "tp2"])
def test_a_frozen_parameter_stays_at_its_initial_value_and_the_rest_agrees(corpus_cache, tmp_path, layout):
    """A parameter the family freezes is in no optimizer, no gradient norm and no update on either
    side; the check compares every weight by name each step, so a layout that moved it diverges at
    its first step (a reference that trains it was reported 5e-2 off at step 1)."""
    import gpt2_family

    registry.FAMILIES["gpt2"] = replace(gpt2_family.GPT2_FAMILY, build_meta=_frozen_positions)
    cfg = _config(corpus_cache, *layout)
    report = _check(cfg, tmp_path)
    assert report.agree, report.text()
    assert report.worst["loss"] <= 1e-6, report.text()
    reference = OwnReference(cfg)
    start = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    step = reference.train_step(capture=True)
    assert "wpe.weight" not in step.grads and torch.equal(step.weights["wpe.weight"], start["wpe.weight"])
    assert not torch.equal(step.weights["wte.weight"], start["wte.weight"])  # the rest trains


# -- a family that takes no tokens: its own step and its own reference --------------------------------
REGRESSION = EXAMPLE / "regression.toml"


def _regression_config(*overrides: str):
    cfg = load_config(path=REGRESSION, overrides=["--logging.progress=false", "--logging.report=false",
                                                  "--checkpoint.save_final=false", *overrides])
    validate(cfg, world_size=cfg.parallel.world_size)  # imports regression_family: the forked ranks inherit it
    return cfg


@pytest.mark.slow
def test_a_family_with_its_own_step_and_reference_is_checked_at_dp2_zero3(tmp_path):
    """examples/own_family/regression_family.py (float features, Family.own_step built on
    parallelize) at dp 2 x ZeRO-3 against its Family.reference (the model in one plain process,
    torch's AdamW): every loss, gradient norm, reduced gradient and updated weight within fp32's
    bounds. Until 2026-11-28 bigtrain check took no reference from a family with its own step (the
    DLRM's, by class, only) and refused it: 'bigtrain check has no reference for its step'."""
    cfg = _regression_config("--train.steps=3")
    assert reference_problems(cfg) == []
    report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 3, timeout=180)[0]
    assert report.agree, report.text()
    assert report.steps == 3 and report.worst["loss"] <= 1e-6 and report.worst["weight"] <= 1e-5, report.text()


def test_a_step_of_its_own_without_a_reference_or_planner_names_the_slot_to_write(capsys, monkeypatch):
    """bigtrain check and bigtrain plan of a family with its own step say which Family slot would do
    it and what it is (check: a reference class and what it returns; plan: no decoder of its shapes
    prices it, a plan_command would)."""
    cfg = _regression_config()
    registry.FAMILIES["regression"] = replace(registry.FAMILIES["regression"], reference=None)
    problems = reference_problems(cfg)
    assert len(problems) == 1 and "none for this family (model.family = 'regression' has no Family.reference)" \
        in problems[0] and "train_step(capture) -> ReferenceStep" in problems[0], problems
    monkeypatch.chdir(EXAMPLE)
    capsys.readouterr()
    assert main(["plan", "--config", "regression.toml"]) == 2
    err = capsys.readouterr().err
    assert "trains by its own step: none for this family (model.family = 'regression' has no " \
           "Family.plan_command); choose its layout by hand" in err, err
    # train --parallel auto said "give the family a planner_config", which a family with its own step
    # cannot use: it says what bigtrain plan says (one function, families/own.py: own_step_unpriced).
    capsys.readouterr()
    assert main(["train", "--config", "regression.toml", "--parallel", "auto"]) == 2
    auto = capsys.readouterr().err
    assert "planner_config" not in auto, auto
    planned = err[err.index("bigtrain plan prices decoders"):].strip()
    assert planned.replace("bigtrain plan prices", "--parallel auto prices") in auto, (planned, auto)


def test_parallel_auto_of_a_family_with_its_own_step_and_planner_names_that_planner():
    """DLRM trains by its own step and has a planner of its own (Family.plan_command): --parallel
    auto points at it (bigtrain plan --config) instead of asking for a planner_config."""
    from bigtrain.config import ConfigError
    from bigtrain.plan.auto import auto_overrides

    with pytest.raises(ConfigError) as e:
        auto_overrides(load_config(preset="dlrm-tiny"), 1, hardware="cpu")
    assert "--parallel auto prices decoders (bigtrain's Llama of their shapes), and model.family = 'dlrm' trains " \
           "by its own step: its own planner (Family.plan_command) prices it, run by bigtrain plan --config; " \
           "choose its layout by hand (parallel.dp, parallel.zero)" in str(e.value), str(e.value)
