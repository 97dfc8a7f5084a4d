"""Sharded checkpoints reshard: a checkpoint written at any of five layouts loads at any of them.

Each source layout trains 2 steps and saves once (a module fixture); each (source, target) pair
loads that checkpoint at the target layout and takes 3 more steps, which must equal steps 3-5 of
the independent reference (``bigtrain.check.reference``, equal to an uninterrupted run at any
layout) within 1e-5 (fp32). All 25 pairs run here (about a second or two each on 2 cores).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from bigtrain import checkpoint as ckpt
from bigtrain.check.reference import reference_losses
from bigtrain.checkpoint.sharded import ChunkReader
from bigtrain.testing import run_ranks
from helpers import run_steps, tiny_config, trainer_on_rank

SAVED_AT, MORE = 2, 3
BASE = ["--model.n_layers=4", "--train.micro_batch=2", f"--train.steps={SAVED_AT + MORE}"]
LAYOUTS = {
    "one": (1, []),
    "dp4-zero3": (4, ["--parallel.dp=4", "--parallel.zero=3"]),
    "tp2": (2, ["--parallel.tp=2"]),
    "pp2-v2": (2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"]),
    "dp2-tp2-pp2": (8, ["--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=1"]),
}


def _config(cache: str, layout: str):
    return tiny_config(cache, *BASE, *LAYOUTS[layout][1])


def _save(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, SAVED_AT)
    trainer.save()


def _resume(rank, world_size, cfg, run_dir, path):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    assert trainer.resume(path) and trainer.step == SAVED_AT
    return run_steps(trainer, MORE)


@pytest.fixture(scope="module")
def saved(corpus_cache, tmp_path_factory):
    """{layout: path of its step-2 checkpoint}, each written once."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for layout, (world, _) in LAYOUTS.items():
        run_ranks(_save, world, _config(corpus_cache, layout), str(root / layout), timeout=300)
        out[layout] = ckpt.list_checkpoints(root / layout / "checkpoints")[0]
    return out


@functools.lru_cache(maxsize=None)
def _expected(cache: str) -> list[float]:
    return reference_losses(_config(cache, "one"), SAVED_AT + MORE)[SAVED_AT:]


@pytest.mark.parametrize("target", list(LAYOUTS))
@pytest.mark.parametrize("source", list(LAYOUTS))
def test_a_checkpoint_resumes_at_another_layout(source, target, saved, corpus_cache, tmp_path):
    world, _ = LAYOUTS[target]
    tails = run_ranks(_resume, world, _config(corpus_cache, target), str(tmp_path), str(saved[source]), timeout=300)
    for tail in tails:
        torch.testing.assert_close(torch.tensor(tail), torch.tensor(_expected(corpus_cache)), rtol=1e-5, atol=0)


@pytest.mark.parametrize("source", list(LAYOUTS))
def test_one_entry_per_parameter_with_its_full_shape(source, saved, corpus_cache):
    """The format: each parameter once under its name with the full shape (tp padding dropped), its
    optimizer state under optim/<name>/<state>, a manifest listing every file with its checksum."""
    reader = ChunkReader(saved[source])
    model_entries = {k: v for k, v in reader.entries.items() if not k.startswith("optim/")}
    cfg = _config(corpus_cache, "one")
    from bigtrain.models.llama import build_model
    expected = {n: tuple(p.shape) for n, p in build_model(cfg.model).named_parameters()}
    assert {k: tuple(v.size) for k, v in model_entries.items()} == expected
    for name, shape in expected.items():
        assert reader.shape(f"optim/{name}/exp_avg") == shape and reader.has(f"optim/{name}/step")
    meta = json.loads((saved[source] / "meta.json").read_text())
    files = {p.name for p in Path(saved[source]).iterdir() if p.name != "meta.json"}
    assert meta["format"] == ckpt.FORMAT and set(meta["sha256"]) == files and ".metadata" in files
    assert len([f for f in files if f.endswith(".distcp")]) == LAYOUTS[source][0]  # every rank wrote
