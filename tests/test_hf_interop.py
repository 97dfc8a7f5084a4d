"""Hugging Face interop: ``bigtrain export --format hf`` loads in transformers' LlamaForCausalLM with
the same logits, and ``model.init_from = "hf:PATH"`` reads it back bit for bit. Offline: the
transformers model is built from the exported local folder, never downloaded."""

import json

import pytest
import torch

from bigtrain.checkpoint.export import checkpoint_weights
from bigtrain.checkpoint.hf import from_rotate_half, to_rotate_half
from bigtrain.cli import main
from bigtrain.config import ConfigError
from bigtrain.models.llama import build_model
from bigtrain.testing import run_ranks
from bigtrain.validation import validate
from tests.helpers import run_steps, tiny_config, trainer_on_rank


def train_and_save(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 2)
    trainer.save()


def _bigtrain_logits(run_dir, cfg, tokens):
    model = build_model(cfg.model, device="cpu")
    model.init_buffers()
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    model.load_state_dict(checkpoint_weights(newest), strict=False)  # a tied head is the embedding
    with torch.no_grad():
        return model(tokens)


def test_rotate_half_permutation_is_inverted_exactly():
    w = torch.randn(2 * 8, 5)
    assert torch.equal(from_rotate_half(to_rotate_half(w, 2), 2), w)
    # Head 0's interleaved pairs (rows 0,1), (2,3), ... become (0, 4), (1, 5), ...: evens first.
    assert to_rotate_half(torch.arange(8.0)[:, None], 1).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("tp, tied", [(2, False), (1, True)])
def test_exported_folder_gives_llama_for_causal_lm_the_same_logits(corpus_cache, tmp_path, tp, tied):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(corpus_cache, f"--parallel.tp={tp}", f"--model.tie_embeddings={tied}")
    run_ranks(train_and_save, tp, cfg, str(tmp_path / "run"))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0

    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings is tied and hf.config.num_key_value_heads == 2
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = _bigtrain_logits(tmp_path / "run", cfg, tokens)
    assert (theirs - ours).abs().max().item() < 1e-5


def test_init_from_then_export_round_trips_bit_for_bit(corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache)
    run_ranks(train_and_save, 1, cfg, str(tmp_path / "run"))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "a"), "--format", "hf"]) == 0

    imported = tiny_config(corpus_cache, f"--model.init_from=hf:{tmp_path / 'a'}", "--parallel.tp=2")
    run_ranks(lambda rank, world, c, d: trainer_on_rank(rank, world, c, d).save(), 2, imported,
              str(tmp_path / "imported"))
    assert main(["export", str(tmp_path / "imported"), str(tmp_path / "b"), "--format", "hf"]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_train_takes_the_model_shape_from_the_folder(corpus_cache, tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    hf = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(hf))
    (folder / "model.safetensors").write_bytes(b"")  # weights are looked for, not read, before launch
    assert main(["config", "--preset", "tiny", f"--model.init_from=hf:{folder}"]) == 0
    out = capsys.readouterr().out
    assert "dim = 32" in out and "n_layers = 1" in out and "ffn_hidden = 64" in out

    (folder / "config.json").write_text(json.dumps({**hf, "mlp_bias": True, "head_dim": 8,
                                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    assert main(["config", "--preset", "tiny", f"--model.init_from=hf:{folder}"]) == 0
    out = capsys.readouterr().out
    assert "mlp_bias = true" in out and "attention_head_dim = 8" in out and 'rope_scaling = "linear"' in out

    (folder / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    assert main(["config", "--preset", "tiny", f"--model.init_from=hf:{folder}"]) == 2
    assert "rope_scaling type 'dynamic'; bigtrain has 'linear', 'llama3' and 'yarn'" in capsys.readouterr().err

    # The small preset's data.seq_len = 128 past the folder's 64 positions: "raise model.max_seq_len",
    # the fix it named, was then refused as a mismatch with the folder
    (folder / "config.json").write_text(json.dumps(hf))
    assert main(["config", f"--model.init_from=hf:{folder}"]) == 2
    assert (f"data.seq_len = 128 exceeds model.max_seq_len = 64, which model.init_from's {folder / 'config.json'} "
            f"(max_position_embeddings) sets; lower data.seq_len to at most 64") in capsys.readouterr().err


def test_init_from_problems_name_the_field_and_the_fix(corpus_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"model.init_from = 'runs/x': write 'hf:PATH'"):
        validate(tiny_config(corpus_cache, "--model.init_from=runs/x"))
    with pytest.raises(ConfigError, match="is not a folder"):
        validate(tiny_config(corpus_cache, f"--model.init_from=hf:{tmp_path / 'missing'}"))


def test_exports_are_readable_like_any_new_file_and_init_from_says_it_was_used(corpus_cache, tmp_path, capsys):
    import os

    args = ["--preset", "tiny", f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000", "--train.steps=1",
            "--logging.report=false"]
    assert main(["train", *args, "--output-dir", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "w.safetensors")]) == 0
    mask = os.umask(0)
    os.umask(mask)
    for path in (tmp_path / "hf" / "model.safetensors", tmp_path / "w.safetensors"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, oct(path.stat().st_mode)  # safetensors alone: 0600
    capsys.readouterr()
    assert main(["train", *args, "--output-dir", str(tmp_path / "tuned"), f"--model.init_from=hf:{tmp_path / 'hf'}"]) == 0
    assert f"bigtrain: initial weights from model.init_from = 'hf:{tmp_path / 'hf'}'" in capsys.readouterr().out


def test_a_refused_hf_export_writes_nothing(corpus_cache, tmp_path, capsys):
    """An MoE Llama has no Hugging Face Llama counterpart: the export is refused, and it left a
    config.json (and the folder) behind, which from_pretrained then half-read."""
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--preset", "moe-tiny", f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000",
                 "--train.steps=1", "--logging.report=false", "--logging.progress=false",
                 "--output-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", str(run), str(out), "--format", "hf"]) == 1
    assert "model.moe_experts = 4: bigtrain's MoE Llama has no Hugging Face architecture; export its weights with " \
        "--format safetensors" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier export's: kept as it was
    assert main(["export", str(run), str(out), "--format", "hf"]) == 1
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "{}"


@pytest.mark.parametrize("model_type, positions", [("llama", 2048), ("qwen2", 32768)])
def test_a_config_json_without_max_position_embeddings_gets_transformers_default(model_type, positions):
    """What transformers' own config class defaults it to for that model type (LlamaConfig 2048,
    Qwen2Config 32768): a Qwen2 file without it got 2048 here."""
    from bigtrain.checkpoint.hf import model_values

    fields = {"model_type": model_type, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    assert model_values(fields, "config.json")["max_seq_len"] == positions
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoConfig.for_model(model_type).max_position_embeddings == positions


def test_a_config_json_with_attention_dropout_is_refused_for_bigtrains_llama():
    """The Llama family has no dropout: a folder asking for it was fine-tuned without it, silently
    (model.family = 'hf' refused it already); 0.0 and a missing field load."""
    from bigtrain.checkpoint.hf import HFFormatError, model_values

    fields = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    assert model_values({**fields, "attention_dropout": 0.0}, "config.json")["dim"] == 64
    with pytest.raises(HFFormatError, match=r'attention_dropout = 0.1; .*"attention_dropout": 0.0'):
        model_values({**fields, "attention_dropout": 0.1}, "config.json")
