"""logging.profile_steps: a torch.profiler trace of a window of steps, one per rank, in the
trainer's terms (its phases named), written when the window ends or the run does."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from bigtrain.config import ConfigError
from bigtrain.distributed.mesh import Mesh
from bigtrain.testing import run_ranks
from bigtrain.train import Trainer
from helpers import tiny_config, trainer_on_rank

PHASES = ("bigtrain: forward and backward", "bigtrain: gradient reduction", "bigtrain: optimizer step")


def _names(trace: Path) -> set[str]:
    return {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}


def test_a_window_of_steps_is_traced_with_the_trainer_s_phases_and_the_rest_is_not(corpus_cache, tmp_path, capsys):
    cfg = tiny_config(corpus_cache, "--train.steps=4", "--logging.profile_steps=2-3")
    with Trainer(cfg, tmp_path / "run", Mesh({})) as trainer:
        trainer.fit()
    traces = sorted((tmp_path / "run" / "profile").iterdir())
    assert [t.name for t in traces] == ["rank0_steps2-3.json", "rank0_steps2-3.txt"]
    names = _names(traces[0])
    table = traces[1].read_text()
    assert "Self CPU" in table and "aten::" in table and "bigtrain: optimizer step" in table
    assert {"bigtrain: step 2", "bigtrain: step 3", *PHASES} <= names
    assert "bigtrain: step 1" not in names and "bigtrain: step 4" not in names
    assert any(n.startswith("aten::") and "mm" in n for n in names), "the model's matmuls are on the trace"
    assert "traced steps 2-3" in capsys.readouterr().out


def test_a_run_that_ends_inside_the_window_writes_what_it_traced(corpus_cache, tmp_path, capsys):
    """Stopped at step 3 of a 2-4 window (a stop, a failure): steps 2 and 3 are on the trace, and
    its name and the console say so (not 2-4: step 4 never ran)."""
    cfg = tiny_config(corpus_cache, "--train.steps=4", "--logging.profile_steps=2-4", "--logging.profile_memory=true")
    trainer = Trainer(cfg, tmp_path / "run", Mesh({}))
    cfg.train.steps = 3  # the run ends at step 3, as one stopped there would
    trainer.fit()
    trace = tmp_path / "run" / "profile" / "rank0_steps2-3.json"
    assert "traced steps 2-3" in capsys.readouterr().out
    names = _names(trace)
    assert {"bigtrain: step 2", "bigtrain: step 3"} <= names and "bigtrain: step 4" not in names
    assert "[memory]" in names, "profile_memory: the allocations are on the trace"


def _trace_on_rank(rank, world_size, cfg, run_dir):
    trainer_on_rank(rank, world_size, cfg, run_dir).fit()
    return sorted(p.name for p in (Path(run_dir) / "profile").iterdir())


def test_each_rank_writes_its_own_trace_with_its_collectives(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--parallel.dp=2", "--parallel.zero=2", "--train.steps=2",
                      "--logging.profile_steps=2")
    listed = run_ranks(_trace_on_rank, 2, cfg, str(tmp_path))
    assert listed[0] == listed[1] == ["rank0_steps2-2.json", "rank0_steps2-2.txt", "rank1_steps2-2.json",
                                      "rank1_steps2-2.txt"]
    for rank in (0, 1):
        names = _names(tmp_path / "profile" / f"rank{rank}_steps2-2.json")
        assert any("reduce_scatter" in n for n in names), sorted(n for n in names if "gloo" in n or "c10d" in n)


def _trace_names_on_rank(rank, world_size, cfg, run_dir):
    trainer_on_rank(rank, world_size, cfg, run_dir).fit()
    return _names(Path(run_dir) / "profile" / f"rank{rank}_steps1-1.json")


def test_a_pipeline_rank_s_trace_names_each_forward_and_backward_it_ran(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--parallel.pp=2", "--train.micro_batch=4", "--train.steps=1",
                      "--logging.profile_steps=1")
    first, last = run_ranks(_trace_names_on_rank, 2, cfg, str(tmp_path))
    assert {"bigtrain: F0.s0", "bigtrain: F1.s0", "bigtrain: B0.s0", "bigtrain: B1.s0"} <= first
    assert {"bigtrain: F0.s1", "bigtrain: B1.s1"} <= last and "bigtrain: F0.s0" not in last


@pytest.mark.parametrize("text, words", [
    ("3-2", ["logging.profile_steps = '3-2'", "'A-B'", "e.g. '5-6'"]),
    ("0", ["logging.profile_steps = '0'", "counted from 1"]),
    ("five", ["logging.profile_steps = 'five'"]),
    ("5-", ["logging.profile_steps = '5-'", "'A-B'"]),
    ("4-9", ["logging.profile_steps = '4-9' goes past train.steps = 5", "up to 5"]),
])
def test_a_bad_window_is_refused_naming_the_field_and_the_fix(text, words, corpus_cache):
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, "--train.steps=5", f"--logging.profile_steps={text}")
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_trace_has_kernels_and_the_allocator_s_history_is_dumped(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, "--train.device=cuda", "--train.steps=3", "--logging.profile_steps=2-3",
                      "--logging.profile_memory=true")
    with Trainer(cfg, tmp_path / "run", Mesh({}), "cuda") as trainer:
        trainer.fit()
    out = tmp_path / "run" / "profile"
    trace = json.loads((out / "rank0_steps2-3.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in trace), "the GPU's kernels are on the trace"
    with open(out / "rank0_memory.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and snapshot["device_traces"][0], "the allocator's segments and history"


def test_a_trace_that_cannot_be_written_is_said_and_the_run_goes_on(corpus_cache, tmp_path, capsys):
    """A full disk (here: a file where the profile folder goes) costs the trace, not the run."""
    cfg = tiny_config(corpus_cache, "--train.steps=3", "--logging.profile_steps=2")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile").write_text("not a folder")
    with Trainer(cfg, tmp_path / "run", Mesh({})) as trainer:
        assert len(trainer.fit()) == 3
    assert "the trace of steps 2-2 could not be written" in capsys.readouterr().err
