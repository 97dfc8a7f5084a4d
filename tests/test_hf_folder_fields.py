"""A Hugging Face folder's config.json fields on the way in (``model.init_from = "hf:PATH"`` with
``model.family = "hf"``) and out (``bigtrain export RUN OUT --format hf``): every field that decides
what the weights compute is the model's, or the run is refused naming it.

- A folder of the same shapes as model.hf_config but another rope_theta, rms_norm_eps,
  sliding_window or activation (Mistral v0.1's config.json and v0.2's weights) was accepted: its
  weights trained silently in another function than the one they were trained for. Conversely, a
  folder transformers saved from model.hf_config's own model was refused for "head_dim None vs 16"
  (a field the file left to its default).
- A config.json transformers 5 saved in bf16 carries ``"dtype": "bfloat16"``, which it reads before
  ``torch_dtype``: the fp32 export of such a run loaded in bf16 by default (logits 1e-2 off).
"""

from __future__ import annotations

import json

import pytest
import torch

from bigtrain.config import ConfigError, ModelConfig
from tests.helpers import tiny_config
from tests.test_hf_family import FIXTURES, hf_config

transformers = pytest.importorskip("transformers")


def config_file(folder, arch: str, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    base = json.loads((FIXTURES / arch / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**base, **fields}))
    return folder


def saved_folder(folder, arch: str, **fields):
    """A folder transformers writes (config.json and safetensors) for ``arch``'s fixture with ``fields``."""
    from bigtrain.families.hf import hf_config as transformers_config

    conf = transformers_config(ModelConfig(hf_config=str(config_file(folder / "source", arch, **fields))))
    getattr(transformers, conf.architectures[0])(conf).save_pretrained(folder / "saved")
    return folder / "saved"


def init_from_problems(cache: str, arch: str, folder) -> list[str]:
    try:
        hf_config(cache, arch, f"--model.init_from=hf:{folder}")
    except ConfigError as e:
        return e.problems
    return []


def test_init_from_a_folder_that_computes_another_function_is_refused_naming_the_fields(corpus_cache, tmp_path):
    other = saved_folder(tmp_path / "other", "mistral", rope_theta=1e6, sliding_window=8, rms_norm_eps=1e-5)
    problems = init_from_problems(corpus_cache, "mistral", other)
    assert len(problems) == 1 and "describes another model than model.hf_config" in problems[0], problems
    for field in ("rope_parameters", "'rope_theta': 1000000.0", "sliding_window None vs 8", "rms_norm_eps 1e-06 vs 1e-05",
                  f"point model.hf_config at {other / 'config.json'}"):
        assert field in problems[0], (field, problems[0])
    gelu = saved_folder(tmp_path / "gelu", "llama", hidden_act="gelu")
    assert any("hidden_act 'silu' vs 'gelu'" in p for p in init_from_problems(corpus_cache, "llama", gelu))


def test_init_from_a_folder_whose_positions_only_differ_is_a_context_extension_said_not_refused(corpus_cache,
                                                                                               tmp_path):
    """A longer context on a folder's weights (another max_position_embeddings and rope_theta in
    model.hf_config, nothing else): the run trains with model.hf_config's positions, said before launch."""
    from bigtrain.preflight import init_from_position_warnings

    folder = saved_folder(tmp_path / "short", "llama")
    longer = config_file(tmp_path / "long", "llama", max_position_embeddings=4096, rope_theta=5e5)
    cfg = tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={longer}",
                      f"--model.init_from=hf:{folder}")  # accepted: validation raised nothing
    said = init_from_position_warnings(cfg)
    assert len(said) == 1 and "max_position_embeddings" in said[0] and "4096" in said[0], said
    assert "a context extension" in said[0] and f"point model.hf_config at {folder / 'config.json'}" in said[0]
    same = tiny_config(corpus_cache, "--model.family=hf", f"--model.hf_config={folder}", f"--model.init_from=hf:{folder}")
    assert init_from_position_warnings(same) == []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_init_from_the_folder_transformers_saves_of_the_same_model_is_accepted(corpus_cache, tmp_path, arch):
    """Its config.json spells out what the fixture leaves to defaults (Llama's head_dim), in
    transformers 5's words (rope_parameters, dtype), and sets what computes nothing (token ids)."""
    assert init_from_problems(corpus_cache, arch, saved_folder(tmp_path, arch)) == []
    assert init_from_problems(corpus_cache, arch, saved_folder(tmp_path / "ids", arch, bos_token_id=7,
                                                               initializer_range=0.5)) == []


def test_an_export_of_a_config_json_saved_in_bf16_loads_in_fp32_with_the_runs_logits(tmp_path):
    from bigtrain.families.hf import causal_lm, export_folder

    model = ModelConfig(family="hf", hf_config=str(config_file(tmp_path / "run", "qwen2", dtype="bfloat16")))
    ours = causal_lm(model, "cpu").eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    export_folder(model, {n: p.detach() for n, p in ours.named_parameters()}, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="sdpa")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    tokens = torch.randint(0, 256, (2, 16), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(tokens).logits, ours(tokens), rtol=0, atol=0)  # the same ops


def fp8_folder(folder, arch: str):
    """``arch``'s fixture saved as a block-FP8 checkpoint is stored (Qwen3-FP8's layout): each
    projection's weight float8 codes of its full shape, its scale in ``weight_scale_inv`` beside it."""
    from safetensors.torch import load_file, save_file

    saved = saved_folder(folder, arch)
    quantized = {}
    for name, tensor in load_file(saved / "model.safetensors").items():
        if name.endswith("proj.weight"):
            scale = tensor.abs().amax() / 448
            tensor = (tensor / scale).to(torch.float8_e4m3fn)
            quantized[name.replace(".weight", ".weight_scale_inv")] = scale.reshape(1, 1)
        quantized[name] = tensor
    save_file(quantized, str(saved / "model.safetensors"), metadata={"format": "pt"})
    fields = json.loads((saved / "config.json").read_text())
    fields["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (saved / "config.json").write_text(json.dumps(fields))
    return saved


def test_a_quantized_folder_is_refused_before_launch_naming_quantization_config(corpus_cache, tmp_path, capsys):
    """Its float8 codes have the weights' shapes: they loaded unscaled (5e3 off, relative), silently,
    in both families (the hf family's docs point model.hf_config at the folder itself)."""
    from bigtrain.cli import main
    from bigtrain.generate import GenerateError, load_model

    folder = fp8_folder(tmp_path / "qwen2", "qwen2")
    for family in (["--model.family=hf", f"--model.hf_config={folder}"], []):
        with pytest.raises(ConfigError, match=r"quantization_config \(quant_method 'fp8'\).*unquantized"):
            tiny_config(corpus_cache, *family, f"--model.init_from=hf:{folder}")
    llama = fp8_folder(tmp_path / "llama", "llama")
    assert main(["config", "--preset", "tiny", f"--model.init_from=hf:{llama}"]) == 2  # the shape read from it
    assert "quantization_config (quant_method 'fp8')" in capsys.readouterr().err
    with pytest.raises(GenerateError, match="quantization_config"):
        load_model(llama)


def test_float8_weights_are_refused_when_read_whatever_the_config_json_says(tmp_path):
    from bigtrain.checkpoint.hf import HFFormatError, SafetensorsWeights

    folder = fp8_folder(tmp_path, "qwen2")
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(HFFormatError, match=f"'{name}' is stored as torch.float8_e4m3fn"):
        SafetensorsWeights(folder)(name, (64, 64))
    assert SafetensorsWeights(folder)("model.norm.weight", (64,)).dtype == torch.float32
