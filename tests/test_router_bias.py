"""The sigmoid-bias router's bias is model state: it is checkpointed (under its module name, whole),
a checkpoint written at one layout resumes at another equal to an uninterrupted run, and a step the
NaN policy skips leaves it as it was (the statistics are still reported)."""

from __future__ import annotations

import torch

from bigtrain import checkpoint as ckpt
from bigtrain.check.reference import ReferenceRun
from bigtrain.checkpoint.sharded import ChunkReader
from bigtrain.models.moe import moe_blocks
from bigtrain.testing import run_ranks
from helpers import run_steps, tiny_config, trainer_on_rank

SAVED_AT, MORE = 2, 2
MOE = ["--train.global_batch=4", "--train.micro_batch=1", "--model.moe_experts=4", "--model.moe_top_k=2",
       "--model.moe_router=sigmoid-bias", f"--train.steps={SAVED_AT + MORE}"]
SAVE_LAYOUT = ["--parallel.dp=2", "--parallel.ep=2"]
RESUME_LAYOUT = ["--parallel.pp=2"]  # each stage holds half the blocks' biases; no ep


def _biases(model) -> dict[str, torch.Tensor]:
    return {f"{name}.expert_bias": block.expert_bias.detach().cpu().clone() for name, block in moe_blocks(model)}


def _reference(cfg, steps: int, zero_biases_at: int | None = None):
    run = ReferenceRun(cfg)
    losses = []
    for step in range(steps):
        if step == zero_biases_at:
            for _, block in moe_blocks(run.compute):
                block.expert_bias.zero_()
        losses.append(run.train_step().loss)
    return losses, _biases(run.compute)


def _save(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, SAVED_AT)
    trainer.save()
    return _biases(trainer.model)


def _resume(rank, world_size, cfg, run_dir, path):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    assert trainer.resume(path) and trainer.step == SAVED_AT
    loaded = _biases(trainer.model)
    return loaded, run_steps(trainer, MORE), _biases(trainer.model)


def test_router_bias_checkpoints_and_resumes_at_another_layout(corpus_cache, tmp_path):
    saving = tiny_config(corpus_cache, *MOE, *SAVE_LAYOUT)
    saved = run_ranks(_save, 2, saving, str(tmp_path / "saved"), timeout=240)[0]
    assert all(b.abs().sum() > 0 for b in saved.values()), "the biases must have moved, or this proves nothing"
    path = ckpt.list_checkpoints(tmp_path / "saved" / "checkpoints")[0]
    reader = ChunkReader(path)
    for name, value in saved.items():  # one whole entry per block, under the module's name
        stored = reader.empty(name)
        reader.read([(name, (0,), stored)])
        assert torch.equal(stored, value), name

    resuming = tiny_config(corpus_cache, *MOE, *RESUME_LAYOUT)
    ranks = run_ranks(_resume, 2, resuming, str(tmp_path / "resumed"), str(path), timeout=240)
    loaded = {n: b for r in ranks for n, b in r[0].items()}
    assert loaded.keys() == saved.keys()  # the stages' blocks together
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name

    uninterrupted, final = _reference(resuming, SAVED_AT + MORE)  # equal to an uninterrupted run at any layout
    for _, tail, _ in ranks:
        torch.testing.assert_close(torch.tensor(tail), torch.tensor(uninterrupted[SAVED_AT:]), rtol=1e-5, atol=0)
    after = {n: b for r in ranks for n, b in r[2].items()}
    for name, value in final.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-9)

    # The comparison can fail: a resume that lost the biases (zeros) trains differently.
    lost, _ = _reference(resuming, SAVED_AT + MORE, zero_biases_at=SAVED_AT)
    err = max(abs(a - b) / abs(b) for a, b in zip(lost[SAVED_AT:], uninterrupted[SAVED_AT:]))
    assert err > 1e-5


def _skip_one_step(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 1)
    before = _biases(trainer.model)
    original = trainer.parallel.loss_sum
    trainer.parallel.loss_sum = lambda logits, targets: original(logits, targets) + float("nan")
    skipped = trainer.train_step()
    trainer.parallel.loss_sum = original
    during = _biases(trainer.model)
    applied = trainer.train_step()
    return before, skipped.skipped, skipped.moe, during, applied.skipped, _biases(trainer.model)


def test_a_skipped_step_does_not_move_the_router_bias(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *MOE, *SAVE_LAYOUT)
    for before, skipped, metrics, during, applied_skipped, after in run_ranks(_skip_one_step, 2, cfg, str(tmp_path)):
        assert skipped and not applied_skipped
        assert all(sum(m["load"]) > 0 for m in metrics.values())  # its loads are still reported
        for name, value in before.items():
            assert torch.equal(during[name], value), f"{name} moved on a skipped step"
            assert not torch.equal(after[name], value), f"{name} did not move on the applied step"
