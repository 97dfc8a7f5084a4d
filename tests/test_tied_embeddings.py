"""Tied input embedding and output head (``model.tie_embeddings``) train like one process under every
layout: tensor parallel (both uses share one vocabulary shard), data parallel with ZeRO 0-3, and
pipelines, where the first and last stage hold one copy each and sum their gradients.

The reference is the independent single-process loop (``bigtrain.check.reference``), sharing only
the model class and the data sampler with the trainer, so a bug in the trainer at one process
(which once untied the weights) cannot hide.
Tolerance: fp32, per-step loss and gradient norm within 1e-5 relative.
"""

import contextlib
import functools
import shutil

import pytest
import torch

from bigtrain.checkpoint.sharded import ChunkReader
from bigtrain.check.reference import reference_trajectory
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import count_parameters
from bigtrain.testing import RankFailure, run_ranks
from helpers import tiny_config, trainer_on_rank

STEPS = 4
TIED = ["--model.n_layers=4", "--model.tie_embeddings=true", "--train.micro_batch=2", f"--train.steps={STEPS}"]


@functools.lru_cache(maxsize=None)
def _reference(cache_dir: str) -> list[tuple[float, float]]:
    """(loss, gradient norm) per step of the independent single-process loop (bigtrain.check.reference)."""
    losses, norms, _ = reference_trajectory(tiny_config(cache_dir, *TIED), STEPS)
    return list(zip(losses, norms))


def _assert_matches(results: list[tuple[float, float]], expected: list[tuple[float, float]]) -> None:
    torch.testing.assert_close(torch.tensor(results, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)


def _steps(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    return [(r.loss, r.grad_norm) for r in (trainer.train_step() for _ in range(STEPS))]


def test_one_process_keeps_the_tie(corpus_cache, tmp_path):
    """The trainer at one process is the plain loop: one weight, counted and updated once."""
    untied = trainer_on_rank(0, 1, tiny_config(corpus_cache, *TIED[:1], *TIED[2:]), str(tmp_path / "untied"))
    tied = trainer_on_rank(0, 1, tiny_config(corpus_cache, *TIED), str(tmp_path / "tied"))
    m = tied.cfg.model
    assert count_parameters(tied.model) == count_parameters(untied.model) - m.vocab_size * m.dim
    assert tied.model.output.weight is tied.model.tok_embeddings.weight
    results = [(r.loss, r.grad_norm) for r in (tied.train_step() for _ in range(STEPS))]
    _assert_matches(results, _reference(corpus_cache))


LAYOUTS = {
    "tp2": (2, ["--parallel.tp=2"]),
    "dp2-zero0": (2, ["--parallel.dp=2"]),
    "dp2-zero1": (2, ["--parallel.dp=2", "--parallel.zero=1"]),
    "dp2-zero2": (2, ["--parallel.dp=2", "--parallel.zero=2"]),
    "dp2-zero3": (2, ["--parallel.dp=2", "--parallel.zero=3"]),
    "tp2-dp2-zero3": (4, ["--parallel.tp=2", "--parallel.dp=2", "--parallel.zero=3"]),
    "pp2-1f1b": (2, ["--parallel.pp=2"]),
    "pp2-interleaved-v2": (2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"]),
    "pp2-tp2": (4, ["--parallel.pp=2", "--parallel.tp=2"]),
    # Each copy alone in its ZeRO unit, cut alike over dp, gathered around its own use under ZeRO-3.
    "pp2-dp2-zero3": (4, ["--parallel.pp=2", "--parallel.dp=2", "--parallel.zero=3", "--train.micro_batch=1"]),
    # Middle stages hold no copy; the ends get a group of their own.
    "pp4": (4, ["--parallel.pp=4"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_layouts_match_one_process(layout, corpus_cache, tmp_path):
    world_size, parallel = LAYOUTS[layout]
    cfg = tiny_config(corpus_cache, *TIED, *parallel)
    for results in run_ranks(_steps, world_size, cfg, str(tmp_path), timeout=180):
        _assert_matches(results, _reference(corpus_cache))


@pytest.mark.parametrize("compression", ["int8", "none"])
def test_a_head_copy_alone_in_its_unit_is_gathered_until_its_input_gradient(compression, corpus_cache, tmp_path):
    """ZeRO-3, pp 2: the last stage's copy of the tied weight is a unit of its own. Under int8
    compression the head's weight gradient comes from an autograd node of its own, before its input
    gradient reads the weight: the unit's gradients were reduced, and the weight freed, in between
    (fuzz seed 20261314 sample 12 crashed on it). Checked against the reference with int8's bounds."""
    from bigtrain.check.run import check_on_rank

    cfg = tiny_config(corpus_cache, *TIED, "--parallel.pp=2", "--parallel.zero=3", "--train.micro_batch=1",
                      f"--memory.activation_compression={compression}")
    report = next(r for r in run_ranks(check_on_rank, 2, cfg, str(tmp_path), 2, timeout=180) if r is not None)
    assert report.agree and report.steps == 2, report.text()


def _fit(rank, world_size, cfg, run_dir):
    return [(r.loss, r.grad_norm) for r in trainer_on_rank(rank, world_size, cfg, run_dir).fit()]


@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)], ids=["pp2-to-one", "one-to-pp2"])
def test_a_tied_checkpoint_resumes_in_another_layout(saved_on, resumed_on, corpus_cache, tmp_path):
    """Saved once, under the embedding's name, whatever the layout; both pipeline copies load from it."""
    layout = {1: [], 2: ["--parallel.pp=2"]}
    cfg = tiny_config(corpus_cache, *TIED, *layout[saved_on], "--checkpoint.every=2")
    run_ranks(_fit, saved_on, cfg, str(tmp_path))
    shutil.rmtree(tmp_path / "checkpoints" / f"step_{STEPS:08d}")  # as if the run died after step 2
    saved = ChunkReader(tmp_path / "checkpoints" / f"step_{2:08d}")
    assert not saved.has("output.weight") and saved.shape("tok_embeddings.weight") == (256, 64)
    resumed = tiny_config(corpus_cache, *TIED, *layout[resumed_on], "--checkpoint.resume=auto")
    tails = run_ranks(_fit, resumed_on, resumed, str(tmp_path))
    for tail in tails:
        _assert_matches(tail, _reference(corpus_cache)[2:])


class _Pieces:
    """An engine whose gradient of each tied weight starts at a given index of the parameter."""

    def __init__(self, start: int):
        self.start = start

    def grad_piece(self, name):
        return torch.zeros(4), self.start

    def editable_grad_piece(self, name):
        return contextlib.nullcontext(self.grad_piece(name))


def _check_layout(rank, world_size, starts):
    from bigtrain.parallel.tied import TiedCopies

    ends = Mesh({"pp": world_size}, rank).comm("pp_ends")
    names = ["tok_embeddings.weight"] if rank == 0 else ["output.weight"]
    copies = TiedCopies(names, {"output.weight": "tok_embeddings.weight"}, ends)
    copies.check_layout(_Pieces(starts[rank]))


def test_copies_holding_different_parts_of_the_weight_are_refused():
    """Summing two copies' gradients is right only if both ranks hold the same part of the weight."""
    run_ranks(_check_layout, 2, (0, 0))
    with pytest.raises(RankFailure, match="hold different parts of the tied gradients"):
        run_ranks(_check_layout, 2, (0, 4))
