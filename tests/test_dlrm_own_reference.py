"""The DLRM against a second, independent plain-PyTorch reference (tests/dlrm_own_reference.py:
nn.EmbeddingBag, nn.Linear, autograd of the plain interaction, torch's AdamW, row-wise Adagrad
written again with an fp64 accumulator), at 3 ranks (the other tests run 2 and 4): tables smaller
than the world, a one-row table, duplicate ids in a bag (3 ids per sample from 2 rows), column
pieces of dim 6 / 3, every kind in one layout; and a run saved at 2 ranks column-wise, resumed at 3
table-wise / mixed. Losses and every weight within 1e-5 relative (fp32). Also the Criteo TSV
reader's bad input: labels other than 0 / 1, a dense feature count other than 13, hotness > 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigtrain.config import load_config
from bigtrain.recsys.data import CriteoTsv, read_criteo_tsv, sampler_for
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from tests.dlrm_own_reference import PlainDLRM
from tests.helpers import trainer_on_rank

STEPS, SAVED_AT = 6, 3


def config(world: int, sharding: str, tables: str, optimizer: str = "rowwise_adagrad", hotness: int = 3,
           dim: int = 6, extra: tuple[str, ...] = ()):
    cfg = load_config(preset="dlrm-tiny", overrides=[
        f"--parallel.dp={world}", f"--embedding.sharding={sharding}", f"--embedding.tables={tables}",
        f"--embedding.dim={dim}", f"--embedding.hotness={hotness}", f"--embedding.optimizer={optimizer}",
        "--train.global_batch=12", "--train.micro_batch=12", f"--train.steps={STEPS}", "--embedding.lr=0.1",
        "--optim.warmup_steps=0", "--optim.grad_clip=0", "--optim.schedule=constant",
        "--model.dlrm_bottom_mlp=8", "--model.dlrm_top_mlp=8", *extra])
    validate(cfg)
    return cfg


def train(rank: int, world: int, cfg, run_dir: str, steps: int, save: bool = False, resume_from: str = ""):
    trainer = trainer_on_rank(rank, world, cfg, run_dir)
    if resume_from:
        assert trainer.resume(resume_from)
    losses = [trainer.train_step().loss for _ in range(steps)]
    if save:
        assert trainer.save()
        trainer.wait_for_save()
    return losses, {k: v.clone() for k, v in trainer.parallel.full_weights().items()}


def check(losses, weights, cfg, skip: int = 0) -> None:
    ref = PlainDLRM(cfg)
    ref_losses = [ref.train_step() for _ in range(skip + len(losses))][skip:]
    for step, (loss, expected) in enumerate(zip(losses, ref_losses)):
        assert abs(loss - expected) <= 1e-5 * abs(expected), f"step {skip + step}: {loss} vs {expected}"
    for name, expected in ref.weights().items():
        err = float((weights[name] - expected).norm() / expected.norm())
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("sharding,optimizer", [("table,data,column,row", "rowwise_adagrad"),
                                                ("column", "sgd"), ("auto", "rowwise_adagrad")])
def test_three_ranks_against_own_reference(tmp_path, sharding, optimizer):
    # table 0: 2 rows (fewer than the ranks, hotness 3: duplicate ids in every bag); table 1: one row
    cfg = config(3, sharding, "2,1,6,9", optimizer)
    losses, weights = run_ranks(train, 3, cfg, str(tmp_path / "run"), STEPS, timeout=300)[0]
    check(losses, weights, cfg)


def _train_counting_forwards(rank: int, world: int, cfg, run_dir: str, steps: int):
    """``train``, the batch size of every forward of the bottom MLP on this rank (a forward hook), and
    the bytes this rank handed each all-to-all in the first step and how many it called (what its
    AxisComm recorded)."""
    trainer = trainer_on_rank(rank, world, cfg, run_dir)
    sizes: list[int] = []
    trainer.parallel.model.bottom.register_forward_pre_hook(lambda _, args: sizes.append(args[0].shape[0]))
    before = trainer.mesh.stats.snapshot()
    losses = [trainer.train_step().loss]
    step = trainer.mesh.stats.since(before)
    payload, calls = ({op.split(":", 1)[1]: n for (_, op), n in counted.items() if op.startswith("all_to_all:emb")}
                      for counted in (step.payload, step.calls))
    losses += [trainer.train_step().loss for _ in range(steps - 1)]
    return losses, {k: v.clone() for k, v in trainer.parallel.full_weights().items()}, sizes, (payload, calls)


def test_micro_batches_accumulate_against_own_reference(tmp_path):
    """train.micro_batch was ignored by the DLRM (each rank took its 4 samples in one forward). Now
    each rank takes micro-batches of it (3 + 1: the last one smaller) and the tables' and the dense
    part's gradients are accumulated into one update, against the plain loop that accumulates .grad
    over micro-batches of the global batch; every kind of piece in the layout. The planner's payload
    per step (``bigtrain plan --micro-batch``) is what each rank measured: every micro-batch exchanges
    its own ids, counts and pooled embeddings (the row-wise table's id counts twice, not once), and
    so are its all-to-all calls per step (each pays a collective's latency: 4 an exchange, 2 of them)."""
    from bigtrain.parallel.embedding_layout import all_to_all_payload
    from bigtrain.recsys.placement import step_calls, step_payload
    from bigtrain.recsys.train import layout_for

    cfg = config(3, "table,data,column,row", "2,1,6,9", extra=("--train.micro_batch=3",))
    ranks = run_ranks(_train_counting_forwards, 3, cfg, str(tmp_path / "run"), 2, timeout=300)
    losses, weights, sizes, _ = ranks[0]
    assert sizes == [3, 1, 3, 1]  # two steps
    check(losses, weights, cfg)
    layout = layout_for(cfg, 3)
    for rank, (*_, (measured, calls)) in enumerate(ranks):
        assert calls == step_calls(layout, 4, 3) == dict.fromkeys(
            ("emb_ids", "emb_id_counts", "emb_pooled", "emb_pooled_backward"), 2), (rank, calls)
        assert measured == step_payload(layout, rank, 4, 3, 3), rank
        assert measured["emb_id_counts"] == 2 * all_to_all_payload(layout, rank, 4, 3)["emb_id_counts"]


def test_plan_command_takes_micro_batch_and_refuses_the_dense_planners_flags(capsys):
    """bigtrain plan priced a DLRM's all-to-all as one exchange of the rank's batch whatever
    --micro-batch said, and ignored --layers, --hardware, ... without a word (the config's model was
    priced). --micro-batch now reaches its planner (train.micro_batch: an exchange per micro-batch);
    the flags its planner does not read are refused in one line naming them."""
    import json

    from bigtrain.cli import main

    plan = ["plan", "--preset", "dlrm-tiny", "--gpus", "2", "--global-batch", "64", "--json"]
    found = {}
    for micro in ("32", "10"):
        assert main(plan + ["--micro-batch", micro]) == 0
        found[micro] = json.loads(capsys.readouterr().out)
    assert found["32"]["micro_batches"] == [32] and found["10"]["micro_batches"] == [10, 10, 10, 2]
    assert main(plan + ["--micro-batch", "0"]) == 2
    assert "--micro-batch = 0: must be a positive integer" in capsys.readouterr().err
    for flags, named in ((["--layers", "4"], "--layers"), (["--hardware", "h100-80g"], "--hardware"),
                         (["--precision", "bf16", "--hw", "a=1", "--top", "3"], "--hw, --precision, --top")):
        assert main(plan + flags) == 2, flags
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith(f"bigtrain plan: {named}: model.family = 'dlrm' has a planner of its own, "
                                       f"which takes the model from the config and reads only --gpus, "
                                       f"--global-batch, --micro-batch and --json; leave "), captured.err


def test_resume_two_ranks_column_to_three_ranks_against_own_reference(tmp_path):
    saved = config(2, "column", "2,4,66,9")
    run_ranks(train, 2, saved, str(tmp_path / "a"), SAVED_AT, True, timeout=300)
    checkpoint = str(Path(tmp_path / "a") / "checkpoints" / f"step_{SAVED_AT:08d}")
    resumed = config(3, "data,table,row,column", "2,4,66,9")
    losses, weights = run_ranks(train, 3, resumed, str(tmp_path / "b"), STEPS - SAVED_AT, False, checkpoint,
                                timeout=300)[0]
    check(losses, weights, saved, skip=SAVED_AT)


# -- the Criteo TSV reader's bad input -------------------------------------------------------------------
def _line(label: str, dense: int = 13, tables: int = 26) -> str:
    return "\t".join([label] + ["3"] * dense + ["a1"] * tables)


def test_tsv_label_other_than_0_or_1_is_refused_by_line(tmp_path):
    path = tmp_path / "day_0.tsv"
    for bad in ("2", "-1", ""):
        path.write_text(_line("0") + "\n" + _line(bad) + "\n")
        with pytest.raises(ValueError, match=rf"day_0.tsv:2: label '{bad}' is not 0 or 1"):
            read_criteo_tsv(path, [100] * 26)


def test_tsv_reads_the_configured_dense_feature_count(tmp_path):
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(_line(str(i % 2), dense=10) for i in range(20)) + "\n")
    cfg = config(1, "table", "26x100", hotness=1, extra=(f"--data.source={path}", "--model.dlrm_dense_features=10"))
    dense, ids, labels = sampler_for(cfg, [100] * 26).batch(0, 0, 4)
    assert dense.shape == (4, 10) and ids.shape == (4, 26, 1)
    assert CriteoTsv(path, [100] * 26, 4, dense=10).held_out().batch(0, 0, 1)[0].shape == (1, 10)
    with pytest.raises(ValueError, match=r"expected 1 label \+ 13 dense \(model.dlrm_dense_features\)"):
        read_criteo_tsv(path, [100] * 26)


def test_tsv_with_hotness_above_one_is_refused_before_launch(tmp_path):
    path = tmp_path / "day_0.tsv"
    path.write_text(_line("1") + "\n")
    from bigtrain.config import ConfigError
    with pytest.raises(ConfigError, match="embedding.hotness = 2: a Criteo TSV file"):
        config(1, "table", "26x100", hotness=2, extra=(f"--data.source={path}",))


def test_tsv_short_file_holds_out_a_sample_not_its_training_data(tmp_path):
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(_line(str(i % 2)) for i in range(5)) + "\n")  # 10% of 5 lines rounds to 0
    sampler = CriteoTsv(path, [100] * 26, global_batch=2)
    assert sampler.split == 4 and sampler.held_out().samples(0, 1)[2].tolist() == [0.0]  # line 5, label 0
    path.write_text(_line("1") + "\n")
    with pytest.raises(ValueError, match="1 sample"):
        CriteoTsv(path, [100] * 26, global_batch=2)



# -- preflight: the tables against this machine's memory ---------------------------------------------------
def test_preflight_refuses_tables_larger_than_the_machine(tmp_path, monkeypatch):
    """dlrm-criteo's 90 GiB of tables passed preflight on a 23 GiB host (only embedding.budget_gb was
    checked) and the ranks were then killed allocating them. The planner's bytes of the fullest rank
    x the ranks sharing the host must fit the host (a GPU's memory per rank with CUDA)."""
    import bigtrain.plan.fit as fit
    from bigtrain.config import ConfigError
    from bigtrain.preflight import preflight

    cfg = load_config(preset="dlrm-criteo", overrides=["--parallel.dp=8"])
    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (64 * 2**30, "this machine has"))
    with pytest.raises(ConfigError, match=r"embedding.tables \(26 tables, .*13.053 GiB.* x 8 ranks on this machine, "
                                          r"and this machine has 64.000 GiB"):
        preflight(cfg, tmp_path / "run", local_ranks=8)
    # one rank per GPU of 80 GiB: 13 GiB each fits; on 8 hosts of 16 GiB, one rank each, too
    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (80 * 2**30, "each GPU of this machine has"))
    preflight(cfg, tmp_path / "run", local_ranks=8, cuda=True)
    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (16 * 2**30, "this machine has"))
    preflight(cfg, tmp_path / "run", local_ranks=1)
    small = load_config(preset="dlrm-tiny", overrides=["--parallel.dp=2"])
    preflight(small, tmp_path / "tiny", local_ranks=2)


# -- the planner -----------------------------------------------------------------------------------------
def _payload_piece_by_piece(layout, rank: int, batch: int, hotness: int) -> dict[str, int]:
    """The payload summed over the pieces one by one (the formula of docs/recommenders.md)."""
    pieces = layout.pieces
    rows = layout.kinds.count("row")
    out = {"emb_ids": 8 * batch * hotness * (sum(layout.kinds[p.table] != "row" for p in pieces) + rows),
           "emb_pooled": 4 * layout.world * batch * sum(p.width for p in pieces if p.rank == rank),
           "emb_pooled_backward": 4 * batch * sum(p.width for p in pieces)}
    if rows:
        out["emb_id_counts"] = 8 * layout.world * rows
    return out


def test_planner_at_a_thousand_ranks_is_quick_and_prices_as_piece_by_piece():
    """26 row-wise tables on 1000 ranks are 26,000 pieces: the layout rebuilt and sorted them for
    every rank asked about (the planner's rank_bytes, the payload, each lookup's splits): 54 s to plan
    and describe on 200 ranks, ~20 min on 1000."""
    import time

    from bigtrain.parallel.embedding_layout import all_to_all_payload
    from bigtrain.plan.embedding import describe_plan, plan_embedding

    start = time.perf_counter()
    layout = plan_embedding([1000] * 26, 16, 1000, "auto", 4, 0)
    describe_plan(layout, 4, 2)
    assert time.perf_counter() - start < 20  # 0.2 s here
    assert set(layout.kinds) == {"row"} and layout.pieces is layout.pieces
    for layout in (plan_embedding([12, 8, 6, 24, 4], 6, 2, "table,row,column,data,table"),
                   plan_embedding([12, 8, 6, 24, 4], 6, 3, "column,table,row,row,data"),
                   plan_embedding([64, 8, 6, 24, 4], 8, 4, "auto", 4, 1200)):
        for rank in range(layout.world):
            assert all_to_all_payload(layout, rank, 5, 3) == _payload_piece_by_piece(layout, rank, 5, 3)


@pytest.mark.parametrize("gpus,message", [(0, "--gpus = 0: must be a positive integer"),
                                          (-1, "--gpus = -1: must be a positive integer"),
                                          (3, "train.global_batch = 256 is not divisible by --gpus = 3")])
def test_plan_command_refuses_bad_gpus_by_name(gpus, message):
    """--gpus 0 was a ZeroDivisionError traceback, -1 'min() arg is an empty sequence', and 3 priced a
    floored batch of 85 a rank that no run takes (a run refuses 256 over 3 ranks)."""
    from bigtrain.config import ConfigError
    from bigtrain.recsys.placement import cmd_plan_embedding

    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        cmd_plan_embedding(load_config(preset="dlrm-tiny"), gpus)


def test_plan_command_takes_global_batch_flag(capsys):
    """bigtrain plan --global-batch priced a DLRM's payload at the config's batch (256) all the same."""
    import json

    from bigtrain.cli import main

    assert main(["plan", "--preset", "dlrm-tiny", "--gpus", "2", "--global-batch", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_per_rank"] == 32
    assert main(["plan", "--preset", "dlrm-tiny", "--gpus", "2", "--global-batch", "0"]) == 2
    assert "--global-batch = 0: must be a positive integer" in capsys.readouterr().err
    assert main(["plan", "--preset", "dlrm-tiny", "--gpus", "3", "--global-batch", "64"]) == 2
    assert "train.global_batch = 64 is not divisible by --gpus = 3" in capsys.readouterr().err
