"""Current Llama configs through Hugging Face: a Llama-3.1-style model (llama3 rotary scaling, a head
size apart from dim / heads) and a Qwen2-style one (q/k/v biases, YaRN), made by transformers itself
in the test (random weights, nonzero biases; no download), import into bigtrain with equal logits,
train at tp=2, and export to a folder that transformers' AutoModelForCausalLM loads with logits
equal to bigtrain's for the trained weights."""

import pytest
import torch

from bigtrain.checkpoint.export import checkpoint_weights
from bigtrain.checkpoint.hf import HFWeights
from bigtrain.cli import main
from bigtrain.families.init_from import init_from_architecture
from bigtrain.config import ModelConfig, load_config
from bigtrain.models.llama import build_model
from bigtrain.models.rope import rope_frequencies
from bigtrain.testing import run_ranks
from tests.helpers import run_steps, tiny_config, trainer_on_rank

transformers = pytest.importorskip("transformers")

# The HF rotary settings of each kind and the bigtrain fields they import as.
ROPE_CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, ["--model.rope_scaling=linear", "--model.rope_factor=4"]),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16},
               ["--model.rope_scaling=llama3", "--model.rope_factor=8", "--model.rope_original_max_len=16"]),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
              "beta_slow": 1.0},
             ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=16"]),
}


@pytest.mark.parametrize("kind", list(ROPE_CASES))
def test_rotary_frequencies_equal_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope, overrides = ROPE_CASES[kind]
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=24, max_position_embeddings=64,
                                  rope_theta=500000.0, rope_scaling=rope)
    theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    cfg = load_config(preset="tiny", overrides=[*overrides, "--model.attention_head_dim=24",
                                                "--model.rope_theta=500000"]).model
    ours, our_scale = rope_frequencies(cfg)
    assert torch.equal(ours, theirs) and our_scale == pytest.approx(their_scale, rel=1e-12)
    assert not torch.equal(ours, rope_frequencies(ModelConfig(dim=64, n_heads=4, attention_head_dim=24,
                                                              rope_theta=500000.0))[0])  # scaling changes them


def _llama31_style():
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rope_theta=500000.0,
        rope_scaling=ROPE_CASES["llama3"][0], rms_norm_eps=1e-5, tie_word_embeddings=False)


def _qwen2_style():
    return transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000000.0,
        rope_scaling=ROPE_CASES["yarn"][0], rms_norm_eps=1e-6, tie_word_embeddings=True)


ARCHITECTURES = {"llama31": (_llama31_style, "LlamaForCausalLM"), "qwen2": (_qwen2_style, "Qwen2ForCausalLM")}


def _hf_folder(make_config, folder):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager")
    with torch.no_grad():  # transformers initializes biases to zero: give them values a mistake would show
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return model.eval()


def _hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits, type(model).__name__


def train_and_save(rank, world_size, cfg, run_dir):
    trainer = trainer_on_rank(rank, world_size, cfg, run_dir)
    run_steps(trainer, 2)
    trainer.save()


def _imported_config(cache, folder, *overrides):
    init = f"--model.init_from=hf:{folder}"
    shape = init_from_architecture(load_config(preset="tiny", overrides=[init]))
    return tiny_config(cache, *shape, init, *overrides)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_import_train_at_tp2_and_export_give_transformers_logits(arch, corpus_cache, tmp_path):
    make_config, class_name = ARCHITECTURES[arch]
    original = _hf_folder(make_config, tmp_path / "original")
    cfg = _imported_config(corpus_cache, tmp_path / "original", "--parallel.tp=2", "--train.micro_batch=8")
    m = cfg.model
    assert (m.rope_scaling, m.qkv_bias, m.head_dim) == (("llama3", False, 24) if arch == "llama31" else ("yarn", True, 16))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))

    # Import: bigtrain's plain model with the folder's weights gives transformers' logits.
    model = build_model(m, device="cpu")
    model.init_buffers()
    weights = HFWeights(tmp_path / "original", m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights(name, tuple(p.shape)))
        ours = model(tokens)
        theirs = original(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5

    # Train at tp=2 from those weights, export, and load the export with transformers' Auto classes.
    run_ranks(train_and_save, 2, cfg, str(tmp_path / "run"))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "exported"), "--format", "hf"]) == 0
    theirs, loaded_as = _hf_logits(tmp_path / "exported", tokens)
    assert loaded_as == class_name
    trained = build_model(m, device="cpu")
    trained.init_buffers()
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    trained.load_state_dict(checkpoint_weights(newest), strict=False)  # a tied head is the embedding
    with torch.no_grad():
        ours_trained = trained(tokens)
    assert (ours_trained - ours).abs().max().item() > 1e-3  # training moved the weights
    assert (ours_trained - theirs).abs().max().item() < 1e-5
    bias = "layers.0.attention.wq.bias"
    assert bias in checkpoint_weights(newest) if arch == "qwen2" else bias not in checkpoint_weights(newest)
