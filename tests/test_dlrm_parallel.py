"""The DLRM's sharded tables at 2 and 4 Gloo ranks against the one-process plain-PyTorch reference:
table-, row-, column-wise, replicated and mixed layouts, both sparse optimizers, 10 steps within
1e-5; the all-to-all payload of a step against the formula; the tables' bytes per rank, measured,
against the planner's; a budget one rank cannot meet, met on 4."""

from __future__ import annotations

import pytest
import torch

from bigtrain.check.reference_dlrm import reference_dlrm
from bigtrain.config import load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.optim.sparse import SparseOptimizer
from bigtrain.parallel.embedding_layout import all_to_all_payload
from bigtrain.plan.embedding import plan_embedding
from bigtrain.recsys.train import gather_tables
from bigtrain.train import Trainer
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from tests.helpers import assert_rel_close

STEPS, TABLES, DIM, BATCH, HOT = 10, "4x64,2x32", 8, 16, 2
MIX = "table,row,column,data,table,row"
# A 64-row table with its Adagrad rows is 64 x (8 x 4 + 4) = 2304 bytes, the six 11,520: 3,000 a rank
# holds on 4 ranks only once a table is cut, and never on one.
BUDGET_GB = 3000 / 2**30


def dlrm_config(world: int, sharding: str, optimizer: str = "rowwise_adagrad", budget_gb: float = 0.0,
                overrides: tuple[str, ...] = ()):
    cfg = load_config(preset="dlrm-tiny", overrides=[
        f"--parallel.dp={world}", f"--embedding.sharding={sharding}", f"--embedding.tables={TABLES}",
        f"--embedding.dim={DIM}", f"--embedding.hotness={HOT}", f"--embedding.optimizer={optimizer}",
        f"--embedding.budget_gb={budget_gb}", f"--train.global_batch={BATCH}", f"--train.steps={STEPS}",
        "--embedding.lr=0.1", "--optim.warmup_steps=2", "--optim.grad_clip=0.5", *overrides])
    validate(cfg)
    return cfg


def train_layouts(rank: int, world: int, configs: list) -> list[dict]:
    out = []
    for cfg in configs:
        trainer = Trainer(cfg, "unused-run-dir", Mesh.from_config(cfg.parallel, rank, world))
        stats = trainer.mesh.stats
        before = stats.snapshot()
        losses = [trainer.train_step().loss]
        first_step = stats.since(before)
        losses += [trainer.train_step().loss for _ in range(STEPS - 1)]
        payload = {op.split(":", 1)[1]: n for (axis, op), n in first_step.payload.items()
                   if op.startswith("all_to_all:emb")}
        table_placements = {n: p for n, p in trainer.parallel.placements.items() if n.startswith("embeddings.")}
        out.append({
            "losses": losses,
            "tables": gather_tables(trainer.parallel, trainer.parallel.layout),
            "dense": {n: p.detach().clone() for n, p in trainer.parallel.dense.named_parameters()},
            "payload": payload,
            "expected_payload": all_to_all_payload(trainer.parallel.layout, rank, BATCH // world, HOT),
            "measured_bytes": trainer.parallel.embedding_bytes(),
            "planned_bytes": trainer.parallel.layout.rank_bytes(rank, SparseOptimizer(cfg.embedding.optimizer, 0.1)
                                                                .state_bytes_per_row()),
            "kinds": trainer.parallel.layout.kinds,
            "reduced_by_engine": [n for n in table_placements if table_placements[n].grad_axis is not None],
            "engine_params": len(trainer.engine.params),
        })
    return out


_references: dict[str, tuple] = {}


def reference(optimizer: str) -> tuple:
    if optimizer not in _references:  # the reference does not depend on the layout
        _references[optimizer] = reference_dlrm(dlrm_config(1, "table", optimizer), STEPS)
    return _references[optimizer]


def check_against_reference(result: dict, optimizer: str, what: str) -> None:
    ref_losses, ref_weights = reference(optimizer)
    for step, (loss, ref) in enumerate(zip(result["losses"], ref_losses)):
        assert abs(loss - ref) <= 1e-5 * abs(ref), f"{what}: loss at step {step}: {loss} vs {ref}"
    for t, table in result["tables"].items():
        assert_rel_close(table, ref_weights[f"embeddings.tables.{t}.weight"], 1e-5, f"{what}: table {t}")
    for name, weight in result["dense"].items():
        assert_rel_close(weight, ref_weights[name], 1e-5, f"{what}: {name}")


LAYOUTS = [("table", "rowwise_adagrad"), ("row", "rowwise_adagrad"), ("column", "rowwise_adagrad"),
           (MIX, "rowwise_adagrad"), (MIX, "sgd")]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_tables_equal_one_process(world):
    layouts = LAYOUTS + ([("auto", "rowwise_adagrad")] if world == 4 else [])
    configs = [dlrm_config(world, s, o, BUDGET_GB if s == "auto" else 0.0) for s, o in layouts]
    for _, optimizer in layouts:
        reference(optimizer)  # in the parent, before the fork: the ranks inherit torch's warm imports
    per_rank = run_ranks(train_layouts, world, configs, timeout=300)
    for (sharding, optimizer), *results in zip(layouts, *per_rank):
        what = f"{sharding} ({optimizer}) at {world} ranks"
        for rank, result in enumerate(results):
            check_against_reference(result, optimizer, f"{what}, rank {rank}")
            assert result["payload"] == result["expected_payload"], f"{what}, rank {rank}: all-to-all bytes"
            assert result["measured_bytes"] == result["planned_bytes"], f"{what}, rank {rank}: table bytes"
            assert result["reduced_by_engine"] == [] and result["engine_params"] == 8
        if sharding == "auto":  # the budget forced a cut; one rank could not have held the tables
            assert {"row", "column"} & set(results[0]["kinds"])
            assert max(r["measured_bytes"] for r in results) <= BUDGET_GB * 2**30
            with pytest.raises(ValueError, match="embedding.budget_gb"):
                plan_embedding([64] * 4 + [32] * 2, DIM, 1, "auto", 4, int(BUDGET_GB * 2**30))


def test_payload_formula_by_hand():
    """The formula itself, for two ranks and one table of each kind (4 ids a sample, batch 3 per rank)."""
    layout = plan_embedding([8, 8, 8], 4, 2, "table,row,column")
    for rank in range(2):
        id_blocks = 1 + 1 + 2  # the table, the row-wise table's ids (bucketized: once), two column pieces
        local_width = (4 if layout.owners[0] == rank else 0) + 4 + 2
        assert all_to_all_payload(layout, rank, 3, 4) == {
            "emb_ids": 8 * 3 * 4 * id_blocks, "emb_id_counts": 8 * 2 * 1, "emb_pooled": 4 * 2 * 3 * local_width,
            "emb_pooled_backward": 4 * 3 * (4 + 2 * 4 + 2 * 2)}


def test_call_counts_by_hand():
    """All-to-all calls a step (the latency each pays): per micro-batch the ids, the pooled
    embeddings and their gradients, and the id counts only with a row-wise table; none on one rank
    (the exchange is a copy) or with every table replicated (no exchange). Measured against the
    ranks: tests/test_dlrm_own_reference.py::test_micro_batches_accumulate_against_own_reference."""
    from bigtrain.recsys.placement import step_calls

    assert step_calls(plan_embedding([8, 8], 4, 2, "table,column"), 6, 4) == {
        "emb_ids": 2, "emb_pooled": 2, "emb_pooled_backward": 2}  # micro-batches of 4 and 2
    assert step_calls(plan_embedding([8, 8], 4, 2, "row"), 3, 3) == {
        "emb_ids": 1, "emb_id_counts": 1, "emb_pooled": 1, "emb_pooled_backward": 1}
    assert step_calls(plan_embedding([8, 8], 4, 1, "table"), 3, 1) == {}
    assert step_calls(plan_embedding([8, 8], 4, 2, "data"), 3, 1) == {}


def lookup_with_an_idle_row_piece(rank: int, world: int) -> dict:
    """Row-wise tables whose ids all fall in rank 0's rows: rank 1's pieces receive no id at all
    (every one of their bags is empty) and are left as they were by the update."""
    from bigtrain.distributed.mesh import Mesh as MeshOf
    from bigtrain.parallel.embedding import ShardedEmbeddingBags

    layout = plan_embedding([8, 6], 3, world, "row")
    emb = ShardedEmbeddingBags(layout, MeshOf({"dp": world}, rank).comm("dp_sp"), SparseOptimizer("sgd", 1.0))
    full = {t: torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) for t, rows in enumerate(layout.rows)}
    emb.init_from(lambda t: full[t])
    ids = (torch.tensor([[[0, 3], [2, 2]], [[1, 1], [0, 1]]]) + rank) % 3  # rows < 3: rank 0's pieces
    out = emb(ids)
    out.backward(torch.ones_like(out))
    emb.finish_update(apply=True)  # the update waits for the step's decision
    expected = torch.stack([torch.stack([full[t][ids[b, t]].sum(0) for t in range(2)]) for b in range(2)])
    return {"out": out.detach(), "expected": expected,
            "moved": [not torch.equal(emb.weight(t), full[t][layout.pieces_of(t)[rank].rows[0]:]
                                      [:layout.pieces_of(t)[rank].shape[0]]) for t in range(2)]}


def test_row_pieces_that_receive_no_ids_give_empty_bags():
    results = run_ranks(lookup_with_an_idle_row_piece, 2)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["out"], result["expected"], rtol=0, atol=0)
    assert results[0]["moved"] == [True, True] and results[1]["moved"] == [False, False]
