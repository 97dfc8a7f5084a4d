"""Invalid configs are rejected before any process starts: by validate(), and by the CLI with exit code 2.

Each row of CASES is one mistake on top of the (valid) tiny preset and the dotted field its message
must name. Every row is checked twice: in-process through load_config + validate, and through
``bigtrain.cli.main(["train", ...])`` with the rank entry points replaced by sentinels, so a case the
CLI failed to reject shows up as "a rank was started" instead of a 20-step training run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import bigtrain.cli as cli
import bigtrain.distributed.launch as launch
from bigtrain.config import ConfigError, load_config
from bigtrain.validation import validate

MISSING = "/nonexistent-bigtrain-dir"

# (id, overrides on top of the tiny preset, substring the single problem must contain)
CASES = [
    ("dp-zero", ["--parallel.dp=0"], "parallel.dp"),
    # the layout fuzzer's seed 20261308 sample 43: fewer micro-batches a step than stages under 2BW
    ("2bw-fewer-micro-batches-than-stages", ["--parallel.pp=4", "--model.n_layers=4", "--parallel.pp_schedule=pipedream-2bw",
                                             "--train.global_batch=2", "--train.micro_batch=1"], "train.global_batch >= 3"),
    ("global-batch-indivisible", ["--train.global_batch=6"], "train.global_batch"),
    # the planner's field for Qwen3's per-head norms (the Hugging Face family sets it): not built here
    ("qk-norm-on-bigtrain-llama", ["--model.qk_norm=true"], "model.qk_norm"),
    ("global-batch-indivisible-by-dp", ["--parallel.dp=2", "--train.micro_batch=8"], "train.global_batch"),
    ("dim-not-divisible-by-heads", ["--model.dim=66"], "model.dim"),
    ("kv-heads-not-dividing-heads", ["--model.n_kv_heads=3"], "model.n_kv_heads"),
    ("odd-head-dim", ["--model.dim=36"], "model.dim / model.n_heads"),
    ("negative-dim", ["--model.dim=-64"], "model.dim"),
    ("negative-layers", ["--model.n_layers=-1"], "model.n_layers"),
    ("negative-kv-heads", ["--model.n_kv_heads=-2"], "model.n_kv_heads"),
    ("negative-steps", ["--train.steps=-5"], "train.steps"),
    ("zero-micro-batch", ["--train.micro_batch=0"], "train.micro_batch"),
    ("negative-max-bytes", ["--data.max_bytes=-1"], "data.max_bytes"),
    ("seq-len-over-max", ["--data.seq_len=128"], "data.seq_len"),
    ("zero-stage-5", ["--parallel.zero=5"], "parallel.zero"),
    ("reduce-dtype", ["--precision.reduce_dtype=int8"], "precision.reduce_dtype"),
    ("scale-backoff", ["--precision.scale_backoff=2"], "precision.scale_backoff"),
    ("tp-not-dividing-heads", ["--parallel.tp=3", "--train.global_batch=8"], "model.n_heads"),
    ("tp-vs-kv-heads", ["--model.dim=96", "--model.n_heads=12", "--model.n_kv_heads=6", "--parallel.tp=4"], "model.n_kv_heads"),
    ("ulysses-heads", ["--parallel.sp=8"], "parallel.sp"),
    ("ulysses-kv-heads", ["--model.dim=96", "--model.n_heads=12", "--model.n_kv_heads=6", "--parallel.sp=4"],
     "model.n_kv_heads"),
    ("ulysses-seq-len", ["--model.n_kv_heads=4", "--parallel.sp=4", "--data.seq_len=30"], "data.seq_len"),
    ("sequence-parallel-seq-len", ["--parallel.tp=4", "--model.n_kv_heads=4", "--parallel.sequence_parallel=true",
                                   "--data.seq_len=30"], "parallel.sequence_parallel"),
    ("pp-more-than-layers", ["--parallel.pp=4"], "parallel.pp"),
    ("pp-interleaved-m", ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=1"], "parallel.pp_virtual"),
    ("pp-split-missing", ["--parallel.pp=2", "--parallel.pp_split=7"], "parallel.pp_split"),
    ("pp-schedule", ["--parallel.pp=2", "--parallel.pp_schedule=chimera"], "parallel.pp_schedule"),
    ("dp-sync-unknown", ["--parallel.dp_sync=async"], "parallel.dp_sync"),
    ("local-sgd-every-without-local-sgd", ["--parallel.local_sgd_every=4"], "parallel.local_sgd_every"),
    ("local-sgd-zero-2", ["--parallel.dp=2", "--parallel.dp_sync=local-sgd", "--parallel.local_sgd_every=4",
                          "--parallel.zero=2"], "parallel.zero"),
    ("local-sgd-checkpoint-between-averages", ["--parallel.dp=2", "--parallel.dp_sync=local-sgd",
                                               "--parallel.local_sgd_every=4", "--checkpoint.every=6"],
     "checkpoint.every"),
    ("local-sgd-final-checkpoint-between-averages", ["--parallel.dp=2", "--parallel.dp_sync=local-sgd",
                                                     "--parallel.local_sgd_every=4", "--train.steps=10",
                                                     "--checkpoint.save_final=true"], "train.steps = 10"),
    ("pipedream-m", ["--parallel.pp=2", "--parallel.pp_schedule=pipedream"], "pipedream-2bw"),
    ("2bw-recompute", ["--parallel.pp=2", "--parallel.pp_schedule=pipedream-2bw", "--memory.checkpointing=full"],
     "memory.checkpointing"),
    ("2bw-no-pipeline", ["--parallel.pp_schedule=pipedream-2bw"], "parallel.pp"),
    ("vertical-sync-without-pipedream", ["--parallel.pp=2", "--parallel.pp_vertical_sync=true"],
     "parallel.pp_vertical_sync"),
    ("ep-zero", ["--parallel.ep=0"], "parallel.ep"),
    ("ep-negative", ["--parallel.ep=-2"], "parallel.ep"),
    ("ep-dense-model", ["--parallel.dp=2", "--parallel.ep=2"], "mixture-of-experts"),
    ("ep-not-dividing-experts", ["--parallel.dp=4", "--parallel.ep=4", "--train.micro_batch=2", "--model.moe_experts=6"], "model.moe_experts"),
    ("ep-not-dividing-dp", ["--parallel.dp=3", "--parallel.ep=2", "--model.moe_experts=4", "--train.global_batch=12"], "parallel.ep"),
    ("moe-top-k-above-experts", ["--model.moe_experts=4", "--model.moe_top_k=5"], "model.moe_top_k"),
    ("moe-router-unknown", ["--model.moe_experts=4", "--model.moe_router=hash"], "model.moe_router"),
    ("moe-negative-capacity", ["--model.moe_experts=4", "--model.moe_capacity_factor=-1"], "model.moe_capacity_factor"),
    ("moe-shared-gate-without-shared-expert", ["--model.moe_experts=4", "--model.moe_shared_expert_gate=true"],
     "model.moe_shared_expert_gate"),
    ("moe-shared-size-without-shared-expert", ["--model.moe_experts=4", "--model.moe_shared_expert_hidden=64"],
     "model.moe_shared_expert_hidden"),
    ("moe-dense-layers-not-indices", ["--model.moe_experts=4", "--model.moe_dense_layers=first"],
     "model.moe_dense_layers"),
    ("moe-dense-layer-past-the-last", ["--model.moe_experts=4", "--model.moe_dense_layers=0,5"],
     "model.moe_dense_layers"),
    ("moe-every-block-kept-dense", ["--model.moe_experts=4", "--model.moe_dense_layers=0,1"],
     "model.moe_dense_layers"),
    # The experts and the shared expert have no biases: only the dense blocks would get them.
    ("moe-mlp-bias", ["--model.moe_experts=4", "--model.mlp_bias=true"], "model.mlp_bias"),
    ("moe-mlp-bias-shared-expert-dense-first", ["--model.n_layers=3", "--model.moe_experts=4",
                                                "--model.moe_shared_expert=true", "--model.moe_dense_layers=0",
                                                "--model.mlp_bias=true"], "model.mlp_bias"),
    ("moe-negative-shared-size", ["--model.moe_experts=4", "--model.moe_shared_expert=true",
                                  "--model.moe_shared_expert_hidden=-1"], "model.moe_shared_expert_hidden"),
    ("unknown-axis", ["--parallel.xp=2"], "parallel.xp"),
    ("precision-mode", ["--precision.mode=fp8"], "precision.mode"),
    ("checkpointing-policy", ["--memory.checkpointing=sometimes"], "memory.checkpointing"),
    ("checkpoint-every-zero", ["--memory.checkpoint_every=0"], "memory.checkpoint_every"),
    ("beta1-one", ["--optim.beta1=1.0"], "optim.beta1"),
    ("min-lr-ratio-two", ["--optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    ("lr-scaling-quadratic", ["--optim.lr_scaling=quadratic"], "optim.lr_scaling"),
    ("schedule-step", ["--optim.schedule=step"], "optim.schedule"),
    ("decay-fraction-zero", ["--optim.schedule=wsd", "--optim.decay_fraction=0"], "optim.decay_fraction"),
    ("negative-lr", ["--optim.lr=-0.001"], "optim.lr"),
    ("device-tpu", ["--train.device=tpu"], "train.device"),
    ("data-source-missing", [f"--data.source={MISSING}/corpus.txt"], "data.source"),
    ("resume-missing", [f"--checkpoint.resume={MISSING}/step-10"], "checkpoint.resume"),
    ("vocab-100-bytes", ["--model.vocab_size=100"], "model.vocab_size"),
    ("log-every-zero", ["--logging.log_every=0"], "logging.log_every"),
    ("keep-zero", ["--checkpoint.keep=0"], "checkpoint.keep"),
    ("model-family", ["--model.family=gpt2"], "model.family"),
    ("unknown-key", ["--train.stepz=5"], "train.stepz"),
    ("unknown-section", ["--trainer.steps=5"], "[trainer]"),
    ("non-integer", ["--train.steps=ten"], "train.steps"),
    ("float-for-int", ["--model.dim=64.5"], "model.dim"),
    ("bad-bool", ["--logging.progress=maybe"], "logging.progress"),
    ("malformed-override", ["--parallel.dp"], "--parallel.dp"),
    pytest.param("lr-nan", ["--optim.lr=nan"], "optim.lr", id="lr-nan"),
    pytest.param("lr-inf", ["--optim.lr=inf"], "optim.lr", id="lr-inf"),
    pytest.param("weight-decay-nan", ["--optim.weight_decay=nan"], "optim.weight_decay",
                 id="weight-decay-nan"),
    # decoupled decay: 1 - lr x weight_decay a step zeroes (at 1) or flips (above) every weight
    ("weight-decay-flips-weights", ["--optim.lr=0.5", "--optim.weight_decay=2"], "1 - lr x weight_decay = 0"),
    ("weight-decay-at-a-scaled-rate", ["--optim.lr=0.1", "--optim.weight_decay=1", "--optim.lr_scaling=linear",
                                       "--train.global_batch=800", "--optim.base_batch=8"], "scaled by optim.lr_scaling"),
    ("empty-source", ["--data.source="], "data.source is empty"),
    ("blank-source", ["--data.source= "], "data.source"),
    ("empty-resume", ["--checkpoint.resume="], "checkpoint.resume is empty"),
    ("seed-negative", ["--train.seed=-1"], "train.seed"),
    ("seed-beyond-generators", [f"--train.seed={2**50}"], "train.seed"),
    ("int-beyond-64-bits", [f"--train.steps={2**63}"], "train.steps"),
    ("timeout-zero", ["--distributed.timeout_s=0"], "distributed.timeout_s"),
    ("timeout-nan", ["--distributed.timeout_s=nan"], "distributed.timeout_s"),
    ("timeout-beyond-a-year", ["--distributed.timeout_s=1e308"], "distributed.timeout_s"),
    ("timeout-below-a-second", ["--distributed.timeout_s=5e-324"], "distributed.timeout_s"),
    ("bucket-beyond-1-tib", ["--parallel.bucket_mb=1e308"], "parallel.bucket_mb"),
    ("undecodable-text", ["--data.cache_dir=a\udcffb"], "data.cache_dir"),
    ("dim-prime-and-huge", [f"--model.dim={2**61 - 1}"], "model.dim"),
]


def _ids(cases):
    return [getattr(c, "id", None) or c[0] for c in cases]  # pytest.param is a tuple too


def test_the_table_is_big_enough():
    assert len(CASES) >= 24
    assert len(set(_ids(CASES))) == len(CASES)


def test_the_tiny_preset_itself_is_valid():
    validate(load_config(preset="tiny"), world_size=1, cuda_available=False)


def test_mlp_bias_is_refused_with_experts_naming_the_fix_and_valid_on_a_dense_model():
    """model.mlp_bias on an MoE model gave the dense blocks biases and the experts silently none;
    it is refused before launch, saying how to fix it. A dense model keeps its biases."""
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=["--model.moe_experts=4", "--model.mlp_bias=true"]))
    assert "model.mlp_bias = true with model.moe_experts = 4" in str(e.value)
    assert "set model.mlp_bias = false" in str(e.value)
    validate(load_config(preset="tiny", overrides=["--model.mlp_bias=true"]))
    validate(load_config(preset="tiny", overrides=["--model.moe_experts=4"]))


TIED_PIPELINES = {
    "pp2": ["--parallel.pp=2"],
    "interleaved": ["--model.n_layers=4", "--parallel.pp=2", "--parallel.pp_schedule=interleaved",
                    "--parallel.pp_virtual=2"],
}


@pytest.mark.parametrize("pipeline", list(TIED_PIPELINES.values()), ids=list(TIED_PIPELINES))
def test_tied_embeddings_are_valid_with_pipelines(pipeline):
    """The first and last stage each hold a copy and sum their gradients (tests/test_tied_embeddings.py)."""
    validate(load_config(preset="tiny", overrides=["--model.tie_embeddings=true", *pipeline]), world_size=2)


@pytest.mark.parametrize("case_id, overrides, field", CASES, ids=_ids(CASES))
def test_validate_rejects(case_id, overrides, field):
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=overrides))
    # One mistake, one problem, and that problem names the field.
    assert len(e.value.problems) == 1, e.value.problems
    assert field in e.value.problems[0]
    assert field in str(e.value)


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def train_cli(tmp_path, capsys, monkeypatch):
    """Run ``bigtrain train --preset tiny ...`` in-process; nothing that starts a rank really runs."""
    started: list[tuple] = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, run_dir, lock=None: started.append(("rank", run_dir)) or 0)
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv, **_: started.append(("torchrun", nproc)) or 0)
    monkeypatch.setattr(launch, "init_distributed", lambda *a, **k: started.append(("init",)) or None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # a default run directory would land here, not in the repository
    run_dir = tmp_path / "run"

    def run(*args: str, preset: str | None = "tiny"):
        argv = ["train", *(["--preset", preset] if preset else []), *args, "--output-dir", str(run_dir)]
        code = cli.main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    run.started = started
    run.run_dir = run_dir
    run.root = tmp_path
    return run


def _assert_rejected(train_cli, code, out, err, *fields):
    assert code == 2, (out, err)
    for field in fields:
        assert field in err
    assert err.startswith("bigtrain: invalid configuration:")
    assert "Traceback" not in err and "Traceback" not in out
    assert train_cli.started == []
    assert not train_cli.run_dir.exists()
    assert list(train_cli.root.rglob("metrics.jsonl")) == []


def test_cli_control_a_valid_config_reaches_the_rank(train_cli):
    """The sentinel is really where a run starts, so 'no rank started' below means something."""
    code, out, err = train_cli()
    assert code == 0, err
    assert train_cli.started == [("rank", train_cli.run_dir)]


def test_cli_control_dp2_goes_to_torchrun(train_cli):
    code, out, err = train_cli("--parallel.dp=2")
    assert code == 0, err
    assert train_cli.started == [("torchrun", 2)]
    assert (train_cli.run_dir / "config.toml").exists()


@pytest.mark.parametrize("case_id, overrides, field", CASES, ids=_ids(CASES))
def test_cli_rejects_with_exit_2(train_cli, case_id, overrides, field):
    code, out, err = train_cli(*overrides)
    _assert_rejected(train_cli, code, out, err, field)


# ep = 3 over dp = 4 of a dense model: two problems, each named with its fix.
EP_NOT_DIVIDING = ["--parallel.dp=4", "--parallel.ep=3", "--train.global_batch=16"]


def test_ep_not_dividing_dp_is_named_with_a_fix():
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=EP_NOT_DIVIDING))
    divide, dense = e.value.problems
    assert divide.startswith("parallel.ep = 3 does not divide parallel.dp = 4")
    assert "use parallel.ep = 2 or make parallel.dp a multiple of 3" in divide
    assert dense.startswith("parallel.ep = 3: expert parallelism needs a mixture-of-experts model")
    assert dense.endswith("or parallel.ep = 1")
    # Under Ulysses the replicas are dp x sp, and ep divides their product.
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=["--parallel.dp=2", "--parallel.sp=2", "--parallel.ep=8",
                                                       "--model.n_kv_heads=4"]))
    assert e.value.problems[0].startswith("parallel.ep = 8 does not divide parallel.dp x parallel.sp = 2 x 2 = 4")
    assert "use parallel.ep = 4 or make parallel.dp x parallel.sp a multiple of 8" in e.value.problems[0]


def test_cli_rejects_ep_not_dividing_dp(train_cli):
    code, out, err = train_cli(*EP_NOT_DIVIDING)
    _assert_rejected(train_cli, code, out, err, "parallel.ep = 3 does not divide parallel.dp = 4",
                     "mixture-of-experts")


def test_ep_does_not_multiply_the_world_size():
    cfg = load_config(preset="tiny", overrides=["--parallel.dp=4", "--parallel.ep=2", "--train.global_batch=16"])
    assert cfg.parallel.world_size == 4
    with pytest.raises(ConfigError) as e:  # rejected for the dense model only, not for the world size
        validate(cfg, world_size=4)
    assert len(e.value.problems) == 1 and "mixture-of-experts" in e.value.problems[0]


def test_world_size_mismatch_is_named():
    cfg = load_config(preset="tiny", overrides=["--parallel.dp=2"])
    validate(cfg, world_size=2)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=3)
    assert len(e.value.problems) == 1
    message = e.value.problems[0]
    assert "parallel.dp" in message and "world size" in message
    assert "world size 3" in message and "set parallel.dp = 3" in message


def test_cli_world_size_mismatch_under_an_external_launcher(train_cli, monkeypatch):
    # What torchrun sets (tests/test_preflight.py covers the same variables left over without it).
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"),
                        ("TORCHELASTIC_RUN_ID", "test")):
        monkeypatch.setenv(name, value)
    code, out, err = train_cli("--parallel.dp=2")
    _assert_rejected(train_cli, code, out, err, "parallel.dp", "world size 3")


def test_cuda_requested_without_cuda():
    cfg = load_config(preset="tiny", overrides=["--train.device=cuda"])
    validate(cfg, cuda_available=True)
    with pytest.raises(ConfigError) as e:
        validate(cfg, cuda_available=False)
    assert e.value.problems == ["train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'"]


def test_messages_carry_a_fix():
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=["--train.global_batch=6"]))
    assert "use train.global_batch = 4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=["--model.n_kv_heads=3"]))
    assert "e.g. 2" in str(e.value)


# --------------------------------------------------------------------------- several problems at once

SEVERAL = ["--parallel.dp=0", "--optim.beta1=1.0", "--precision.mode=fp8", "--train.device=tpu",
           "--checkpoint.keep=0", "--model.vocab_size=100"]
SEVERAL_FIELDS = ["parallel.dp", "optim.beta1", "precision.mode", "train.device", "checkpoint.keep",
                  "model.vocab_size"]


def test_several_problems_are_reported_in_one_error():
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset="tiny", overrides=SEVERAL))
    assert len(e.value.problems) == len(SEVERAL_FIELDS)
    for field in SEVERAL_FIELDS:
        assert sum(field in p for p in e.value.problems) == 1, field


def test_several_loading_problems_are_reported_in_one_error():
    with pytest.raises(ConfigError) as e:
        load_config(preset="tiny", overrides=["--train.steps=abc", "--train.stepz=1", "--foo.bar=1",
                                              "--optim.lr=x"])
    assert len(e.value.problems) == 4
    text = str(e.value)
    for needle in ("train.steps", "train.stepz", "[foo]", "optim.lr"):
        assert needle in text


def test_cli_reports_several_problems_at_once(train_cli):
    code, out, err = train_cli(*SEVERAL)
    _assert_rejected(train_cli, code, out, err, *SEVERAL_FIELDS)
    assert sum(line.startswith("  - ") for line in err.splitlines()) == len(SEVERAL_FIELDS)


# --------------------------------------------------------------------------- other CLI front-door errors


def test_cli_unrecognized_argument_exits_2(train_cli):
    code, out, err = train_cli("--parallel-dp=2")
    assert code == 2
    assert "unrecognized arguments: --parallel-dp=2" in err
    assert train_cli.started == []


def test_cli_unknown_preset_exits_2(train_cli):
    code, out, err = train_cli(preset="tiyn")
    _assert_rejected(train_cli, code, out, err, "did you mean 'tiny'")


def test_cli_config_file_problems_exit_2(train_cli):
    path = train_cli.root / "bad.toml"
    path.write_text("[parallel]\ndp = 0\n[optim]\nbeta1 = 1.0\n")
    code, out, err = train_cli("--config", str(path), preset=None)
    _assert_rejected(train_cli, code, out, err, "parallel.dp", "optim.beta1")


def test_cli_config_that_is_a_folder_exits_2(train_cli):
    code, out, err = train_cli("--config", str(train_cli.root), preset=None)
    _assert_rejected(train_cli, code, out, err, "config file")


def test_subprocess_invalid_config_exits_2_without_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "bigtrain", "train", "--preset", "tiny", "--parallel.dp=0",
         "--output-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "parallel.dp = 0: must be > 0" in proc.stderr
    assert not (tmp_path / "run").exists()
