"""A checkpoint of another model never loads: every shape the run's model has must be the saved one.

A rank reads only the rectangles its layout holds, and a read of fewer rows than were saved
succeeds. So a checkpoint of 4 experts loaded into a model of 2 (the first two kept), of experts with
a wider MLP into narrower ones (each cut), and of a Hugging Face model into one whose config.json was
edited since (a layer dropped, an MLP cut), each without a word, and the run trained on. Now the
experts' fields are compared like the other shape fields (before launch and in the ranks), and the
ranks compare the checkpoint's entries, names and full shapes, with the run's model on the meta
device before reading any (``bigtrain.checkpoint.resume.check_same_entries``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bigtrain.checkpoint.compat import compare_configs
from bigtrain.checkpoint.resume import ResumeError
from helpers import run_steps, tiny_config, trainer_on_rank

MOE = ["--train.global_batch=4", "--train.micro_batch=1", "--model.moe_top_k=1", "--train.steps=4"]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"


def _saved_after_one_step(cfg, run_dir: Path) -> Path:
    trainer = trainer_on_rank(0, 1, cfg, str(run_dir))
    run_steps(trainer, 1)
    trainer.save()
    trainer.wait_for_save()
    return run_dir / "checkpoints" / "step_00000001"


@pytest.mark.parametrize("changed", [["--model.moe_experts=2"], ["--model.moe_ffn_hidden=64"]],
                         ids=["fewer-experts", "narrower-experts"])
def test_a_checkpoint_of_other_experts_does_not_load(changed, corpus_cache, tmp_path):
    saved = _saved_after_one_step(tiny_config(corpus_cache, *MOE, "--model.moe_experts=4"), tmp_path / "a")
    other = tiny_config(corpus_cache, *MOE, "--model.moe_experts=4", *changed)
    field = changed[0].split("=")[0][2:]
    with pytest.raises(ResumeError, match=field):
        trainer_on_rank(0, 1, other, str(tmp_path / "b")).resume(str(saved))


def test_the_experts_fields_are_compared_before_launch_and_only_where_there_are_experts(corpus_cache):
    saved = tiny_config(corpus_cache, "--model.moe_experts=4", "--model.moe_top_k=1").to_dict()
    for field, value in [("moe_experts", 2), ("moe_every", 2), ("moe_ffn_hidden", 64), ("moe_shared_expert", "true"),
                         ("moe_router", "sigmoid-bias")]:
        run = tiny_config(corpus_cache, "--model.moe_experts=4", "--model.moe_top_k=1", f"--model.{field}={value}")
        errors, _ = compare_configs(saved, run, "step_3")
        assert errors and errors[0].startswith(f"model.{field} = "), (field, errors)
    # the routing width is no shape (a warning, not an error), and a dense model's expert fields mean nothing
    top2 = tiny_config(corpus_cache, "--model.moe_experts=4", "--model.moe_top_k=2")
    assert compare_configs(saved, top2, "s")[0] == []
    dense = tiny_config(corpus_cache).to_dict()
    assert compare_configs(dense, tiny_config(corpus_cache, "--model.moe_every=3"), "s")[0] == []


@pytest.mark.parametrize("edit,entry", [({"num_hidden_layers": 1}, "the checkpoint holds model.layers.1"),
                                        ({"intermediate_size": 64}, "mlp.gate_proj.weight is (128, 64)")],
                         ids=["a-layer-fewer", "a-narrower-mlp"])
def test_a_hugging_face_checkpoint_does_not_load_into_an_edited_config_json(edit, entry, corpus_cache, tmp_path):
    """No field of the config differs (model.hf_config names the same file): only the entries do."""
    folder = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2", folder)
    cfg = tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={folder}", "--train.global_batch=4",
                      "--train.micro_batch=2", "--data.seq_len=32", "--train.steps=4")
    saved = _saved_after_one_step(cfg, tmp_path / "run")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ResumeError, match="was written by another model") as refused:
        trainer_on_rank(0, 1, cfg, str(tmp_path / "run")).resume(str(saved))
    assert entry in str(refused.value)
