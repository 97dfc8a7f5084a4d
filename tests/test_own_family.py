"""A family of one's own (``register_family``, ``model.family_module``) through ``bigtrain train``:
examples/own_family's GPT-2 at dp 2 x ZeRO-2 through the launcher against a plain one-process
PyTorch loop on the same weights and data (fp32, 1e-5 relative: losses and final weights), its
tp_plan at tp 2 through the Trainer (docs/correctness.md's fp32 bounds), and what is refused before
launch, naming the field or the slot the family leaves None."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bigtrain.cli import main
from bigtrain.config import ConfigError, load_config
from bigtrain.families import Family, registry
from bigtrain.validation import validate
from tests.helpers import assert_rel_close

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_family"
CONFIG = EXAMPLE / "gpt2.toml"
MODULES = ("gpt2_family", "gpt2_renamed", "registers_another", "regression_family")


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    """Each test imports the example afresh and leaves the registry as it found it (a family
    registered here would otherwise be one of every later test's choices)."""
    saved = dict(registry.FAMILIES)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in MODULES:
        sys.modules.pop(name, None)
    yield
    registry.FAMILIES.clear()
    registry.FAMILIES.update(saved)
    for name in MODULES:
        sys.modules.pop(name, None)


def _overrides(cache: str, out: Path, *extra: str) -> list[str]:
    return ["--output-dir", str(out), f"--data.cache_dir={cache}", "--data.max_bytes=400000",
            "--logging.progress=false", "--logging.report=false", "--logging.log_every=1", *extra]


# -- dp 2 x ZeRO-2 through the launcher, against a plain loop ----------------------------------
STEPS = 4
# A constant learning rate (no warmup, a floor at the peak): the plain loop's AdamW runs at optim.lr.
CONSTANT_LR = ("--optim.warmup_steps=0", "--optim.min_lr_ratio=1.0")


def plain_loop(cfg, steps: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The example's GPT-2 in one process on the CPU, on one thread as each forked rank computes:
    the family's initial values, the global batch at once, the mean next-token cross-entropy,
    clip_grad_norm_, torch.optim.AdamW (decay on matrices). (losses, final weights, the first
    step's gradients)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _plain_loop(cfg, steps)
    finally:
        torch.set_num_threads(threads)


def _plain_loop(cfg, steps: int):
    from bigtrain.data import TokenSampler, load_corpus
    from bigtrain.families.own import seeded_init
    import gpt2_family

    model = gpt2_family.build(cfg, "cpu")
    init = seeded_init(cfg, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init(name, tuple(p.shape)))
    d, t, o = cfg.data, cfg.train, cfg.optim
    sampler = TokenSampler(load_corpus(d), d.seq_len, t.global_batch, t.seed, d.ignore_target, d.val_fraction,
                           vocab_size=cfg.model.vocab_size)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses, first_grads = [], {}
    for step in range(steps):
        tokens, targets = sampler.batch(step, 0, t.global_batch)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, first_grads


@pytest.mark.slow
def test_the_example_family_trained_by_bigtrain_train_at_dp2_zero2_equals_a_plain_loop(corpus_cache, tmp_path):
    """``bigtrain train --config gpt2.toml`` from the example's folder: the launcher imports the
    module named by model.family_module, so does each of the 2 ranks; every loss within fp32 1e-5 of
    the plain loop, and every final weight (the checkpoint's) within fp32's single-tensor 1e-4."""
    from bigtrain.checkpoint.export import checkpoint_weights
    from bigtrain.checkpoint.commit import newest_valid_checkpoint
    from bigtrain.metrics import read_metrics

    out = tmp_path / "run"
    extra = _overrides(corpus_cache, out, f"--train.steps={STEPS}", *CONSTANT_LR)
    # One thread per rank whatever the machine's cores (the launcher's default is cores / ranks), as
    # the plain loop computes: the GEMMs' summation order then does not change with the machine.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "bigtrain", "train", "--config", "gpt2.toml", *extra],
                          cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting 2 ranks with torchrun" in done.stdout
    losses = [r["loss"] for r in read_metrics(out)]
    path, _ = newest_valid_checkpoint(out / "checkpoints")
    weights = checkpoint_weights(path)

    cfg = load_config(path=CONFIG, overrides=extra[2:])  # the run's fields (not validated: no import needed)
    expected_losses, expected_weights, _ = plain_loop(cfg, STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    assert set(weights) == set(expected_weights)  # the tied head is saved once, as wte.weight
    # Each weight at fp32's single-tensor bound, 1e-4 (bigtrain/check/compare.py's Tolerance: Adam
    # divides g by |g| + eps, so elements whose gradient is near 0 turn summation-order rounding into
    # updates a sizeable part of the learning rate). Measured after these 4 steps: 2e-6 to 1.02e-5,
    # largest h.1.mlp.c_fc.weight on an AVX2 EPYC (under 1e-5 on the AVX-512 Xeons that ran it first);
    # a lost or doubled reduction moves a weight by far more, and every loss keeps 1e-5.
    for name, expected in comparable(expected_weights, cfg.model.dim).items():
        assert_rel_close(comparable(weights, cfg.model.dim)[name], expected, 1e-4, name)


def comparable(weights: dict[str, torch.Tensor], dim: int) -> dict[str, torch.Tensor]:
    """The weights by name, each attention's ``c_attn.bias`` as its query and value parts: its key
    part's gradient is zero but for rounding (a bias on every key adds q . b to each of a query's
    scores alike, and the softmax cancels it), so Adam's normalized step turns that rounding noise
    into full-size updates that differ with any change of summation order (docs/families.md: Qwen2's
    key biases, the same effect)."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith("attn.c_attn.bias"):
            out[f"{name}[q]"], out[f"{name}[v]"] = tensor[:dim], tensor[2 * dim:]
        else:
            out[name] = tensor
    return out


def _tensor_parallel_run(rank: int, world_size: int, cfg, run_dir: str, steps: int):
    from tests.helpers import trainer_on_rank

    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    first_grads = []
    losses = [trainer.train_step(before_update=lambda: first_grads.append(trainer.parallel.full_grads())).loss]
    losses += [trainer.train_step().loss for _ in range(steps - 1)]
    return losses, trainer.parallel.full_weights(), first_grads[0]


@pytest.mark.slow
def test_the_familys_tp_plan_at_tp2_equals_the_plain_loop(corpus_cache, tmp_path):
    """The example's tp_plan (the MLPs and the tied vocabulary cut, attention whole) through the
    Trainer on 2 forked ranks against the plain loop, at docs/correctness.md's fp32 bounds: every
    loss within 1e-5, the first step's reduced gradients within 1e-5 (measured: 3.8e-7) and the final
    weights within 1e-4 (each tensor). A weight is not held to 1e-5 here: AdamW divides g by |g| + eps,
    so an element whose gradient is near eps (1e-8; here 1.5e-9) moves by a part of the learning rate
    for a reduction order's rounding. Measured (2026-11-28): h.1.mlp.c_fc.weight 1.5e-5 off after the
    first step, which is exactly the difference AdamW's first update, lr c g / (|c g| + eps) (c the
    clip coefficient), makes of the two runs' gradients (its worst element: |g| 1.5e-9), and 1.4e-5
    after 4 steps."""
    from bigtrain.testing import run_ranks

    cfg = load_config(path=CONFIG, overrides=["--parallel.dp=1", "--parallel.tp=2", "--parallel.zero=0",
                                              f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000",
                                              "--logging.progress=false", "--logging.report=false",
                                              "--checkpoint.save_final=false", *CONSTANT_LR])
    validate(cfg, world_size=2)  # imports gpt2_family: the forked ranks inherit the registered family
    expected_losses, expected_weights, expected_grads = plain_loop(cfg, STEPS)
    for losses, weights, grads in run_ranks(_tensor_parallel_run, 2, cfg, str(tmp_path), STEPS, timeout=120):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        for name, expected in comparable(expected_grads, cfg.model.dim).items():
            assert_rel_close(comparable(grads, cfg.model.dim)[name], expected, 1e-5, f"gradient of {name}")
        assert set(weights) == set(expected_weights)
        for name, expected in comparable(expected_weights, cfg.model.dim).items():
            assert_rel_close(comparable(weights, cfg.model.dim)[name], expected, 1e-4, name)


# -- refused before launch ---------------------------------------------------------------------
def _config(tmp_path: Path, module: str, family: str = "gpt2", extra: str = "") -> Path:
    text = CONFIG.read_text().replace('family_module = "gpt2_family"', f'family_module = "{module}"')
    text = text.replace('family = "gpt2"', f'family = "{family}"') + extra
    path = tmp_path / "my.toml"
    path.write_text(text)
    return path


def test_a_missing_family_module_is_refused_before_launch_naming_the_field(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--config", str(_config(tmp_path, "no_such_module")), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "model.family_module = 'no_such_module': no module 'no_such_module' can be imported from the working " \
           "directory" in err and "PYTHONPATH" in err
    assert not out.exists()  # nothing launched, nothing written


def test_a_module_that_registers_no_such_family_is_refused_naming_both_fields(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(_config(tmp_path, "gpt2_family", family="gpt3"))]) == 2
    err = capsys.readouterr().err
    assert "model.family = 'gpt3': model.family_module = 'gpt2_family' imported, and registered no family of " \
           "that name" in err and "'gpt2'" in err


def test_a_module_that_raises_on_import_is_refused_with_its_error_once(tmp_path, capsys, monkeypatch):
    """Its error, naming the field, before launch; imported once by validation (not again by each rule)."""
    (tmp_path / "broken_family.py").write_text("print('importing broken_family')\nraise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"model.family_module = 'broken_family': importing it raised "
                                          r"RuntimeError: boom"):
        validate(load_config(path=_config(tmp_path, "broken_family")))
    assert capsys.readouterr().out.count("importing broken_family") == 1


def test_a_module_path_written_as_a_file_is_refused_naming_the_form(tmp_path):
    cfg = load_config(path=_config(tmp_path, "gpt2_family.py"))
    with pytest.raises(ConfigError, match=r"model.family_module = 'gpt2_family.py'.*dotted.*no '\.py'"):
        validate(cfg)


def test_the_family_module_is_imported_from_the_working_directory(tmp_path, monkeypatch):
    """The ``bigtrain`` script's sys.path holds its own folder, not the working directory (where
    ``python -m`` and the launched ranks look): the module is found there all the same."""
    (tmp_path / "registers_another.py").write_text(
        "from gpt2_family import GPT2_FAMILY\nfrom dataclasses import replace\n"
        "from bigtrain.families import register_family\n"
        "register_family(replace(GPT2_FAMILY, name='gpt2-local'))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    validate(load_config(path=_config(tmp_path, "registers_another", family="gpt2-local"),
                         overrides=["--parallel.dp=1"]))


def test_register_family_refuses_a_name_another_family_holds_naming_it():
    import gpt2_family

    with pytest.raises(ValueError, match=r"model.family = 'llama' is taken by another family \(bigtrain's own"):
        registry.register_family(replace(gpt2_family.GPT2_FAMILY, name="llama"))
    with pytest.raises(ValueError, match=r"'gpt2' is taken by another family \(registered from gpt2_family"):
        registry.register_family(Family(name="gpt2", summary="another", build_meta=lambda cfg: None))
    assert registry.register_family(gpt2_family.GPT2_FAMILY) is gpt2_family.GPT2_FAMILY  # again: a no-op
    with pytest.raises(ValueError, match="has no build_meta"):
        registry.register_family(Family(name="empty", summary="nothing"))
    with pytest.raises(ValueError, match="reads_tokens=False and no own_step"):
        registry.register_family(Family(name="features", summary="no tokens", build_meta=gpt2_family.build,
                                        reads_tokens=False))


@pytest.mark.parametrize("override,slot,fix", [
    ("--parallel.pp=2", "split_stages", "set parallel.pp = 1"),
    ("--model.fused_loss=true", "head", "set model.fused_loss = false"),
    ("--model.init_from=hf:somewhere", "init_fn", "set model.init_from = ''"),
])
def test_a_layout_that_needs_a_slot_the_family_leaves_none_is_refused_naming_it(override, slot, fix):
    cfg = load_config(path=CONFIG, overrides=["--parallel.dp=1", override])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert f"none for this family (model.family = 'gpt2' has no Family.{slot}); {fix}" in str(e.value)


def test_what_the_familys_tp_plan_does_not_do_is_refused():
    """Without a tp_plan, tp is refused naming the slot; Ulysses is refused for any family of one's
    own (a plan that ignored it would attend within each shard); the example's own rule refuses
    sequence parallelism, which its plan does not do."""
    import gpt2_family

    def problems(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(load_config(path=CONFIG, overrides=["--parallel.dp=1", *overrides]))
        return str(e.value)

    assert "parallel.sp = 2: Ulysses attention is built for bigtrain's Llama" in problems("--parallel.sp=2")
    assert "gpt2 family's attention needs the whole sequence" in problems("--parallel.tp=2",
                                                                           "--parallel.sequence_parallel=true")
    validate(load_config(path=CONFIG, overrides=["--parallel.dp=1", "--parallel.tp=2"]))
    registry.FAMILIES["gpt2"] = replace(gpt2_family.GPT2_FAMILY, tp_plan=None)
    assert "parallel.tp = 2 (tensor parallelism cuts the modules by the family's plan of styles): none for this " \
           "family (model.family = 'gpt2' has no Family.tp_plan); set parallel.tp = 1" in problems("--parallel.tp=2")


def test_recomputation_takes_the_blocks_the_family_gives():
    """The example gives ``blocks``: full recomputation is accepted (a family without them is refused)."""
    validate(load_config(path=CONFIG, overrides=["--memory.checkpointing=full"]))
    import gpt2_family

    registry.FAMILIES["gpt2"] = replace(gpt2_family.GPT2_FAMILY, blocks=None)
    with pytest.raises(ConfigError, match="memory.checkpointing = 'full'.*has no Family.blocks"):
        validate(load_config(path=CONFIG, overrides=["--memory.checkpointing=full"]))


def test_recomputing_the_familys_blocks_changes_no_loss(corpus_cache, tmp_path, monkeypatch):
    """``blocks`` is what full recomputation wraps: the same losses, bit for bit, as without it."""
    from bigtrain.metrics import read_metrics

    monkeypatch.chdir(EXAMPLE)
    losses = {}
    for policy in ("none", "full"):
        out = tmp_path / policy
        assert main(["train", "--config", "gpt2.toml", *_overrides(corpus_cache, out, "--parallel.dp=1",
                     "--parallel.zero=0", "--train.steps=2", "--checkpoint.save_final=false",
                     f"--memory.checkpointing={policy}")]) == 0
        losses[policy] = [r["loss"] for r in read_metrics(out)]
    assert losses["full"] == losses["none"]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["checkpointed_blocks"] == [0, 1]  # the family's two blocks were recomputed


def test_the_trainer_imports_the_family_module_itself(corpus_cache, tmp_path, monkeypatch):
    """From Python: a Trainer of a config naming the module, nothing imported before it."""
    from tests.helpers import trainer_on_rank

    monkeypatch.chdir(EXAMPLE)
    assert "gpt2" not in registry.FAMILIES
    cfg = load_config(path=CONFIG, overrides=["--parallel.dp=1", "--parallel.zero=0", "--train.steps=1",
                                              f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000",
                                              "--logging.progress=false", "--logging.report=false"])
    trainer = trainer_on_rank(0, 1, cfg, str(tmp_path))
    assert trainer.family.name == "gpt2" and type(trainer.model).__name__ == "GPT2"


# -- a one-process run: resume, plan, export, generate ----------------------------------
@pytest.fixture
def one_process_run(corpus_cache, tmp_path, monkeypatch):
    """2 steps of the example's family in this process, from the example's folder; its run dir."""
    monkeypatch.chdir(EXAMPLE)
    out = tmp_path / "run"
    assert main(["train", "--config", "gpt2.toml", *_overrides(corpus_cache, out, "--parallel.dp=1",
                                                                "--parallel.zero=0", "--train.steps=2")]) == 0
    return out


def test_a_resume_naming_another_family_module_is_refused(one_process_run, tmp_path, capsys, monkeypatch):
    """The checkpoint's config records model.family_module: a resume whose module differs (the same
    family name from another module) would load the weights into whatever that module builds."""
    from bigtrain.metrics import read_metrics

    (tmp_path / "gpt2_renamed.py").write_text("import gpt2_family  # registers 'gpt2' from another module path\n")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = main(["train", "--output-dir", str(one_process_run), "--resume", "--train.steps=3",
                 "--model.family_module=gpt2_renamed"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model.family_module = 'gpt2_renamed', but the checkpoint" in err
    assert "written with model.family_module = 'gpt2_family'" in err
    monkeypatch.chdir(EXAMPLE)  # the run's own module: it goes on from its checkpoint
    assert main(["train", "--output-dir", str(one_process_run), "--resume", "--train.steps=3"]) == 0
    assert [r["step"] for r in read_metrics(one_process_run)] == [1, 2, 3]


def test_plan_export_and_generate_say_none_for_this_family(one_process_run, capsys, tmp_path):
    """(``bigtrain check`` has a reference for it: tests/test_own_family_check.py.)"""
    capsys.readouterr()
    assert main(["plan", "--config", "gpt2.toml"]) == 2
    assert "none for this family (model.family = 'gpt2' has no Family.planner_config)" in capsys.readouterr().err
    assert main(["export", str(one_process_run), str(tmp_path / "hf"), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert "--format hf (a Hugging Face folder of the model): none for this family" in err
    assert "--format safetensors" in err
    assert main(["export", str(one_process_run), str(tmp_path / "model.safetensors")]) == 0  # by name: any family
    assert main(["generate", str(one_process_run), "--prompt", "def "]) != 0
    assert "none for this family (model.family = 'gpt2' has no Family.generation_model)" in capsys.readouterr().err
