"""The optimizer seam (``bigtrain.optim``): an optimizer plugged in by its declaration alone.

``sgd_momentum`` (tests/sgd_momentum.py) is known to no engine, checkpoint or planner code: it is
registered here, and must match the independent reference (``torch.optim.SGD``) in every layout,
move between ZeRO stages through a checkpoint by its declared state names, and be counted by the
planner from its declared bytes. fp32 tolerances: 1e-5 relative (``check_layout``).
"""

from __future__ import annotations

import json

import pytest
import torch

import sgd_momentum
from bigtrain.check.reference import reference_losses
from bigtrain.check.run import check_on_rank
from bigtrain.checkpoint.sharded import ChunkReader
from bigtrain.config import ConfigError, ModelConfig, OptimConfig, PrecisionConfig
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import build_model, init_value
from bigtrain.optim import OptimizerSpec, StateTensor, get_optimizer, register_optimizer, unregister_optimizer
from bigtrain.parallel.zero.engine import ZeroEngine
from bigtrain.plan import PRESETS, Layout, ModelSpec, estimate_memory, state_bytes
from bigtrain.plan.memory import Unit
from bigtrain.precision import Precision
from bigtrain.testing import run_ranks
from helpers import save_after_steps, tiny_config, trainer_on_rank

# A learning rate at which SGD moves the weights visibly in a few steps (clipping active: norms > 1),
# so a wrong or lost momentum buffer shows far above 1e-5.
SGD = ["--optim.name=sgd_momentum", "--optim.lr=0.1", "--optim.warmup_steps=0", "--train.global_batch=4",
       "--train.micro_batch=1"]

LAYOUTS = {
    "zero0-dp2": ["--parallel.dp=2"],
    "zero1-dp2": ["--parallel.dp=2", "--parallel.zero=1"],
    "zero2-dp2": ["--parallel.dp=2", "--parallel.zero=2"],
    "zero3-dp2": ["--parallel.dp=2", "--parallel.zero=3"],
    "tp2": ["--parallel.tp=2"],
    "pp2": ["--parallel.pp=2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sgd_momentum_matches_the_reference(name, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *SGD, *LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 4, timeout=240)[0]
    assert report.agree, report.text()


def test_the_engine_runs_the_configured_optimizer(corpus_cache, tmp_path):
    """The mutation the parity must catch: an engine that builds AdamW whatever optim.name says."""
    cfg = tiny_config(corpus_cache, *SGD, "--parallel.dp=2", "--parallel.zero=2")
    adamw = get_optimizer("adamw")
    try:
        register_optimizer(OptimizerSpec("sgd_momentum", sgd_momentum.SGD_MOMENTUM.state, adamw.build),
                           replace=True)
        report = run_ranks(check_on_rank, 2, cfg, str(tmp_path), 2, timeout=240)[0]
    finally:
        register_optimizer(sgd_momentum.SGD_MOMENTUM, replace=True)
    assert not report.agree


# -- checkpoints: state moves between stages by its declared names -----------------------------
def _resume(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    return [r.loss for r in trainer.fit()]


def _resumed_tail(corpus_cache, tmp_path, saved_layout, resumed_layout):
    common = [*SGD, "--train.steps=8"]
    saved = tiny_config(corpus_cache, *common, *saved_layout)
    run_ranks(save_after_steps, saved.parallel.world_size, saved, str(tmp_path / "run"), 4)
    resumed = tiny_config(corpus_cache, *common, *resumed_layout, "--checkpoint.resume=auto")
    return run_ranks(_resume, resumed.parallel.world_size, resumed, str(tmp_path / "run"))[0], resumed


@pytest.mark.parametrize("saved,resumed", [(LAYOUTS["zero1-dp2"], LAYOUTS["zero3-dp2"]),
                                           (LAYOUTS["zero3-dp2"], LAYOUTS["tp2"])],
                         ids=["zero1-to-zero3", "zero3-to-tp2"])
def test_sgd_momentum_checkpoint_resumes_under_another_stage(saved, resumed, corpus_cache, tmp_path):
    tail, cfg = _resumed_tail(corpus_cache, tmp_path, saved, resumed)
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(reference_losses(cfg, 8)[4:]), rtol=1e-5, atol=0)
    path = next((tmp_path / "run" / "checkpoints").iterdir())
    assert json.loads((path / "meta.json").read_text())["optimizer"] == "sgd_momentum"
    assert {k.rsplit("/", 1)[1] for k in ChunkReader(path).entries if k.startswith("optim/")} == {"momentum_buffer"}


def test_a_resume_that_drops_the_momentum_fails_the_tolerance(corpus_cache, tmp_path, monkeypatch):
    """The mutation the resume test must catch: the loaded momentum never reaches the optimizer."""
    monkeypatch.setattr("bigtrain.parallel.zero.state.load_state", lambda optimizer, states, spec: None)
    tail, cfg = _resumed_tail(corpus_cache, tmp_path, LAYOUTS["zero1-dp2"], LAYOUTS["zero3-dp2"])
    reference = reference_losses(cfg, 8)[4:]
    assert max(abs(a - b) / b for a, b in zip(tail, reference)) > 1e-3


def test_a_checkpoint_of_another_optimizer_is_refused_by_name(corpus_cache, tmp_path):
    saved = tiny_config(corpus_cache, "--train.steps=4")
    save_after_steps(0, 1, saved, str(tmp_path), 2)
    resumed = tiny_config(corpus_cache, *SGD, "--train.steps=4", "--checkpoint.resume=auto")
    with pytest.raises(ValueError, match=r"optimizer state is 'adamw''s but optim.name = 'sgd_momentum'"):
        _resume(0, 1, resumed, str(tmp_path))


# -- the declaration is checked --------------------------------------------------------------
MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, vocab_size=64)


def _engine(stage: int, name: str, mode: str = "fp32") -> ZeroEngine:
    model = build_model(MODEL)
    model.init_buffers("cpu")
    return ZeroEngine(model, Mesh({"dp": 1}, 0).comm("dp"), stage, Precision.from_config(PrecisionConfig(mode=mode)),
                      OptimConfig(name=name), init_fn=lambda n, s: init_value(n, s, 0, MODEL))


def _step(engine) -> None:
    tokens = torch.randint(0, MODEL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine.model(tokens).float().logsumexp(-1).mean())
    engine.finish_grad_sync()
    engine.step(0.1, 1.0)


@pytest.fixture
def registered():
    """Register test specs for one test; unregistered after it."""
    names = []

    def add(spec: OptimizerSpec) -> OptimizerSpec:
        names.append(spec.name)
        return register_optimizer(spec)

    yield add
    for name in names:
        unregister_optimizer(name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_the_declaration_misses_fails_loudly(stage, registered):
    """A spec whose names are not the optimizer's state: saving must not drop the state silently."""
    registered(OptimizerSpec("sgd_misdeclared", (StateTensor("velocity"),), sgd_momentum.build))
    engine = _engine(stage, "sgd_misdeclared")
    _step(engine)
    with pytest.raises(ValueError, match=r"declares state \['velocity'\] but .* holds \['momentum_buffer'\]"):
        engine.full_state()


def _shaped_spec() -> OptimizerSpec:
    return OptimizerSpec("needs_shapes", sgd_momentum.SGD_MOMENTUM.state, sgd_momentum.build, needs="whole")


@pytest.mark.parametrize("stage,mode", [(0, "bf16"), (1, "fp32"), (2, "fp32"), (3, "bf16")])
def test_zero_refuses_an_optimizer_that_needs_shapes(stage, mode, registered):
    registered(_shaped_spec())
    with pytest.raises(ValueError, match=r"optim.name = 'needs_shapes' needs each parameter's shape"):
        _engine(stage, "needs_shapes", mode)


def test_validation_refuses_shapes_under_zero_and_the_replicated_engine_runs_it(corpus_cache, tmp_path, registered):
    registered(_shaped_spec())
    with pytest.raises(ConfigError, match=r"optim.name = 'needs_shapes' needs each parameter's shape"):
        tiny_config(corpus_cache, "--optim.name=needs_shapes", "--parallel.zero=1")
    cfg = tiny_config(corpus_cache, *SGD, "--optim.name=needs_shapes", "--train.steps=3")
    trainer = trainer_on_rank(0, 1, cfg, str(tmp_path))  # fp32, zero 0: whole parameters
    trainer.fit()
    _, optim = trainer.parallel.full_state()
    assert optim["optimizer"] == "needs_shapes" and optim["state"]


def test_unknown_and_duplicate_names():
    with pytest.raises(ConfigError, match=r"optim.name = 'lamb': must be one of 'adamw'"):
        tiny_config("", "--optim.name=lamb")
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer(get_optimizer("adamw"))


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_declares_the_state_torch_keeps(fused):
    spec = get_optimizer("adamw")
    p = torch.nn.Parameter(torch.randn(6, 4))
    p.grad = torch.randn(6, 4)
    optimizer = spec.build([{"params": [p], "weight_decay": 0.1}], OptimConfig())
    assert optimizer.defaults["fused"] is True  # CPU has the fused kernel in torch 2.13
    optimizer = torch.optim.AdamW([p], fused=fused, foreach=not fused)
    optimizer.step()
    spec.check_state(optimizer.state[p], "torch's AdamW")
    assert (spec.bytes_per_param, spec.bytes_per_tensor) == (8, 4)


def test_both_engines_build_fused_adamw_on_cpu(corpus_cache, tmp_path):
    for stage, mode in ((0, "fp32"), (2, "bf16")):
        cfg = tiny_config(corpus_cache, f"--parallel.zero={stage}", f"--precision.mode={mode}")
        assert trainer_on_rank(0, 1, cfg, str(tmp_path)).engine.optimizer.defaults["fused"] is True


# -- the planner reads the declared bytes --------------------------------------------------------
def test_planner_counts_the_declared_state_bytes():
    units = [Unit(numel=1000, decay_numel=600, tensors=3)] * 2
    sgd, adamw = (state_bytes(units, 2, "bf16", 4, name)["optimizer"] for name in ("sgd_momentum", "adamw"))
    shard, pieces = 2 * 250, 2 * 2  # each 250-element shard of a unit holds decayed and non-decayed parts
    assert sgd == (4 + 4) * shard and adamw == (4 + 8) * shard + 4 * pieces
    assert state_bytes(units, 0, "fp32", 1, "sgd_momentum")["optimizer"] == 4 * 2000


def _measured(rank, world_size, cfg, run_dir):
    return trainer_on_rank(rank, world_size, cfg, run_dir).train_step(measure=True).mem


@pytest.mark.parametrize("layout", [Layout(dp=2, zero=2, micro_batch=1, precision="bf16"),
                                    Layout(dp=2, zero=0, micro_batch=1, precision="fp32")],
                         ids=["zero2-bf16", "replicated-fp32"])
def test_planner_predicts_the_measured_sgd_state(layout, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *SGD, *layout.to_overrides())
    measured = run_ranks(_measured, 2, cfg, str(tmp_path))[0]
    model = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    predicted = estimate_memory(model, layout, PRESETS["cpu"], cfg.train.global_batch, optimizer="sgd_momentum")
    for key in ("params", "grads", "optimizer"):
        assert abs(getattr(predicted, key) - measured[key]) <= 0.01 * measured[key], (key, predicted, measured)
